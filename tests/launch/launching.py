"""What the launch tests share: free ports, reading logs, the tiny example's environment and a
reference run to compare a resumed run against."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Dict

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "launch/examples/tiny_cpu.sh"
LAUNCH_VARIABLES = ("SLURM_", "WORLD_SIZE", "MASTER_", "RANK", "LOCAL_RANK", "RDZV_", "NNODES",
                    "NODE_RANK", "NPROC_PER_NODE", "TORCHRUN_ARGS", "GROUP_RANK", "LAUNCHER")


def free_port() -> int:
    """A port nothing listens on now (the kernel's choice), for a rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else f"({path} does not exist)"


def tail(path: Path, lines: int = 40) -> str:
    return f"--- {path.name} (tail)\n" + "\n".join(read(path).splitlines()[-lines:])


def losses(log: str) -> Dict[int, str]:
    """{iteration: loss as logged} of every training log line (a later line of the same
    iteration, from a resumed start, replaces an earlier one)."""
    return {int(m.group(1)): m.group(2) for m in
            re.finditer(r"iteration\s+(\d+)/\s*\d+ \|.*?\| loss: ([0-9.Ee+-]+)", log)}


def tiny_env(data, out: Path, **extra: str) -> Dict[str, str]:
    """launch/examples/tiny_cpu.sh's environment on this host (two processes of one thread each
    under torchrun on a free port; none of the caller's launcher variables)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_VARIABLES)}
    return {**env, "DATA": data.prefix, "TOKENIZER": data.spm, "MODEL_CONFIG": data.config,
            "NPROC_PER_NODE": "2", "PYTHON": sys.executable, "OUT": str(out),
            "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1", **extra}


def reference_losses(data, out: Path, iterations: int, *flags: str,
                     **env: str) -> Dict[int, str]:
    """The losses of the tiny example run straight from scratch to `iterations` (its
    --exit-interval) with `flags`: what a run stopped and resumed must log, step for step."""
    proc = subprocess.run(["bash", str(TINY), *flags, "--exit-interval", str(iterations)],
                          env=tiny_env(data, out, **env), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = losses(read(out / "log.txt"))
    assert sorted(got) == list(range(1, iterations + 1)), got
    return got

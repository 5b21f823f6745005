"""Two hosts on one machine: two network namespaces joined by a veth pair (the `two_hosts`
fixture), launch/torchrun.sh in each with NNODES=2, rendezvous and gloo over that link. The
training matches the single-host run loss for loss; a rank killed, or a host cut off, ends the
other host's job, non-zero, within the distributed timeout."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launching import free_port

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
PORT = 29611  # any port: each namespace is fresh, nothing else listens there


def env(**extra: str) -> dict:
    out = {k: v for k, v in os.environ.items()
           if not k.startswith(("MASTER_", "RDZV_", "NNODES", "NODE_RANK", "NPROC_PER_NODE",
                                "TORCHRUN_ARGS", "WORLD_SIZE", "RANK", "LOCAL_RANK", "SLURM_"))}
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**out, "PYTHONPATH": path, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
            **extra}


def flags(data, cache: Path, iters: int, *extra: str) -> list:
    """Global batch 4 in micro-batches of 2: one micro-batch per rank on 2 ranks."""
    return ["--data-path", data.prefix, "--tokenizer-model", data.spm, "--model-config",
            data.config, "--data-cache-path", str(cache), "--split", "90,5,5",
            "--num-workers", "0", "--encoder-seq-length", "64", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--train-iters", str(iters), "--lr", "3e-3",
            "--lr-warmup-iters", "1", "--seed", "7", "--eval-interval", "3", "--eval-iters", "1",
            "--log-interval", "1", *extra]


def logged_losses(text: str) -> dict:
    return {int(m.group(1)): m.group(2)
            for m in re.finditer(r"iteration +(\d+)/ *\d+ \|.*?loss: (\S+) \|", text)}


def start_nodes(hosts, argv: list, logs: Path, rdzv: str = "static") -> list:
    """launch/torchrun.sh on both hosts (one process each), output to logs/host<i>.log."""
    procs = []
    for i in (0, 1):
        launch = {"NNODES": "2", "NPROC_PER_NODE": "1", "TORCHRUN_ARGS": "--max-restarts 0"}
        if rdzv == "static":
            launch.update(NODE_RANK=str(i), MASTER_ADDR=hosts.addrs[0], MASTER_PORT=str(PORT))
        else:  # c10d: torchrun picks the node ranks
            # The hostname resolves to 127.0.0.1 on both hosts: name each host's address, or
            # node 0 would publish an unreachable MASTER_ADDR to the workers, and say which host
            # serves the endpoint, or neither would (torchrun compares it with the hostname).
            launch.update(RDZV_ENDPOINT=f"{hosts.addrs[0]}:{PORT}", RDZV_ID="two-hosts")
            launch["TORCHRUN_ARGS"] += f" --local-addr {hosts.addrs[i]}" + (
                " --rdzv-conf is_host=1" if i == 0 else "")
        log = open(logs / f"host{i}.log", "w")
        procs.append(hosts.run(i, [str(REPO / "launch/torchrun.sh"), *argv], env(**launch),
                               cwd=logs, stdout=log, stderr=subprocess.STDOUT))
        log.close()
    return procs


def read(logs: Path, i: int) -> str:
    return (logs / f"host{i}.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def single_host_losses(tiny_data, tmp_path_factory):
    """Plain torchrun, 2 processes, in this host's own network namespace."""
    out = tmp_path_factory.mktemp("single_host")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()), "-m", "megatron.pretrain_t5",
           *flags(tiny_data, out / "cache", 6)]
    proc = subprocess.run(cmd, cwd=out, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = logged_losses(proc.stdout)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6], proc.stdout[-3000:]
    return losses


@pytest.mark.parametrize("rdzv", ["static", "c10d"])
def test_two_hosts_train_like_one(rdzv, two_hosts, single_host_losses, tiny_data, tmp_path):
    """Same data order, same all-reduce over 2 ranks: the logged losses are the same strings."""
    procs = start_nodes(two_hosts, flags(tiny_data, tmp_path / "cache", 6), tmp_path, rdzv)
    for proc in procs:
        try:
            proc.wait(timeout=240)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running after 240 s\n--- host 0\n{read(tmp_path, 0)[-3000:]}\n"
                        f"--- host 1\n{read(tmp_path, 1)[-3000:]}")
    outputs = [read(tmp_path, i) for i in (0, 1)]
    assert [p.returncode for p in procs] == [0, 0], "\n---\n".join(o[-3000:] for o in outputs)
    assert logged_losses("".join(outputs)) == single_host_losses, outputs


@pytest.mark.parametrize("fault", ["kill", "unplug"])
def test_a_lost_rank_on_one_host_ends_the_other(fault, two_hosts, tiny_data, tmp_path):
    """Mid-run, SIGKILL the worker on host 1 (its sockets close: gloo raises at once) or take
    host 1's link down (nothing closes: the watchdog must fire). Either way host 0's rank says
    what it waited for and its torchrun exits non-zero within the timeout plus a margin."""
    timeout_s = 12
    argv = flags(tiny_data, tmp_path / "cache", 500, "--distributed-timeout-minutes",
                 str(timeout_s / 60))
    host0, host1 = start_nodes(two_hosts, argv, tmp_path)
    deadline = time.monotonic() + 180
    while max(logged_losses(read(tmp_path, 0)), default=0) < 2:
        assert host0.poll() is None and host1.poll() is None and time.monotonic() < deadline, (
            read(tmp_path, 0)[-3000:] + read(tmp_path, 1)[-3000:])
        time.sleep(0.2)
    if fault == "kill":
        workers = subprocess.run(["pgrep", "-P", str(host1.pid)], capture_output=True,
                                 text=True).stdout.split()
        assert len(workers) == 1, workers
        os.kill(int(workers[0]), signal.SIGKILL)
    else:
        subprocess.run(["ip", "-n", two_hosts.names[1], "link", "set", two_hosts.ifnames[1],
                        "down"], check=True)
    faulted_at = time.monotonic()
    try:
        host0.wait(timeout=timeout_s + 60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"host 0 still running {timeout_s + 60} s after the {fault}\n"
                    f"{read(tmp_path, 0)[-3000:]}")
    took = time.monotonic() - faulted_at
    output = read(tmp_path, 0)
    assert host0.returncode != 0, output[-3000:]
    watchdog = re.search(r"rank 0: no progress for \d+ s while waiting for .*", output)
    # gloo's error names no collective: the rank's one line names the phase it was in, and a
    # peer that left ends the rank without a traceback (the peer reports its own failure)
    failed = re.search(r"rank 0\b[^\n]*: failed while waiting for ([^:\n]+): [^\n]*"
                       r"Connection (closed|reset) by peer[^\n]*", output)
    assert watchdog or (fault == "kill" and failed), output[-3000:]
    if not watchdog:  # (the watchdog's report is the stacks it dumps)
        assert not re.search(r'File "[^"]*/megatron/(training|model|data)/', output), output[-3000:]
    said = (watchdog or failed).group(0)[:240]
    print(f"\n{fault}: host 0 exited {host0.returncode} {took:.1f} s later: {said}")
    two_hosts.kill_all()
    assert two_hosts.pids(0) == two_hosts.pids(1) == []

"""One writer per checkpoint folder under a real torchrun (launch/examples/tiny_cpu.sh): a
second launch on the --save of a running job is refused, naming the holder; SIGKILL to torchrun
alone (its workers live in sessions of their own) ends the workers within seconds, and they
write nothing more; the next launch takes the dead job's lock over and resumes from the
checkpoint the tracker names."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from launching import free_port

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def running_in(folder: Path) -> list:
    """The processes whose command line names `folder` (this test's runs)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if str(folder) in " ".join(proc.cmdline()):
                found.append(proc)
        except psutil.Error:
            pass
    return found


def test_one_writer_and_no_orphans(tiny_data, tmp_path):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "WORLD_SIZE", "MASTER_", "RANK", "LOCAL_RANK"))}
    env.update(DATA=tiny_data.prefix, TOKENIZER=tiny_data.spm, MODEL_CONFIG=tiny_data.config,
               NPROC_PER_NODE="2", PYTHON=sys.executable, OUT=str(tmp_path / "run"),
               ITERS="1000000")
    example = ["bash", str(REPO / "launch/examples/tiny_cpu.sh"), "--eval-interval", "0"]
    ckpt = tmp_path / "run/ckpt"
    # its output goes to a pipe that nobody reads: once full, every write blocks (the workers'
    # last words must not keep them alive)
    first = subprocess.Popen(example + ["--save-interval", "2"],
                             env={**env, "MASTER_PORT": str(free_port())}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not (ckpt / "latest_checkpointed_iteration.txt").exists():
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.5)
        workers = psutil.Process(first.pid).children(recursive=True)  # tiny_cpu.sh execs torchrun
        assert len([w for w in workers if "pretrain_t5" in " ".join(w.cmdline())]) == 2

        second = subprocess.run(example, env={**env, "MASTER_PORT": str(free_port())},
                                capture_output=True, text=True, timeout=180)
        # refused by every rank before any process group: one message (rank 0's), no traceback
        assert second.returncode != 0
        assert second.stderr.count("is being written by another job") == 1, second.stderr[-3000:]
        assert not re.search(r"\[rank\d+\]: *Traceback", second.stderr), second.stderr[-3000:]
        assert f"pid {workers[0].pid}" in second.stderr or \
            any(f"pid {w.pid}" in second.stderr for w in workers)

        os.kill(first.pid, signal.SIGKILL)  # torchrun alone
        first.wait(10)
        gone, alive = psutil.wait_procs(workers, timeout=15)
        assert not alive, f"workers outlived torchrun: {[p.pid for p in alive]}"
        # nothing left that could write more: no process of this run at all
        assert not running_in(tmp_path), running_in(tmp_path)
        # Usually the dead job's lock stays behind. When rank 1 exits first, rank 0's next
        # collective fails and it releases its lock on the way out: nothing to take over then.
        stale = (ckpt / "writer.lock").exists()
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        for proc in running_in(tmp_path):
            try:
                proc.kill()
            except psutil.Error:
                pass

    done = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    third = subprocess.run(example + ["--exit-interval", str(done + 1)],
                           env={**env, "MASTER_PORT": str(free_port())}, capture_output=True,
                           text=True, timeout=240)
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
    log = (tmp_path / "run/log.txt").read_text()
    assert ("took over the writer lock of a job that is gone" in log) == stale
    assert f"resumed from {ckpt} at iteration {done}" in log
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(done + 1)
    assert not (ckpt / "writer.lock").exists()

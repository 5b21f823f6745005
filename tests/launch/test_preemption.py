"""Preemption with real data-loader workers under a real torchrun: SIGTERM to torchrun (what a
scheduler or `kill` sends) reaches every process of the ranks' groups, the loader workers
included; the workers leave it to their rank, which saves at the next step boundary and exits,
and the same command line resumes exactly where the run stopped: its losses are the straight
run's, compared as the float32 values of the TensorBoard scalars (the log line rounds them to 5
digits). (Slurm's signal to every process of a job step: tests/launch/test_slurm.py.)"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest

from launching import TINY, losses, read, reference_losses, tail, tiny_env

from megatron.plot.events import read_events

pytestmark = pytest.mark.slow
LONG = ("--eval-interval", "0", "--save-interval", "1000000")  # only the signal saves


@pytest.mark.parametrize("workers", [1, 2])
def test_sigterm_to_torchrun_saves_and_resumes_exactly(tiny_data, tmp_path, workers):
    out = tmp_path / "run"
    common = ("--num-workers", str(workers), *LONG)
    flags = (*common, "--tensorboard-dir", str(out / "tb"))
    run = subprocess.Popen(["bash", str(TINY), *flags],
                           env=tiny_env(tiny_data, out, ITERS="1000000"), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while max(losses(read(out / "log.txt")), default=0) < 3:
            assert run.poll() is None, run.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "no third step in time"
            time.sleep(0.2)
        os.kill(run.pid, signal.SIGTERM)  # tiny_cpu.sh and torchrun.sh exec: this is torchrun
        output, _ = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait(10)
    describe = f"{output[-4000:]}\n{tail(out / 'log.txt')}"
    # torchrun itself ends in exit 1 on SIGTERM (docs/slurm.md, "Preemption"); its workers save and
    # exit 0, with no traceback of theirs ("[rankN]:" lines) and no dead loader worker
    assert run.returncode == 1, describe
    assert "DataLoader worker" not in output, describe
    assert not re.search(r"\[rank\d+\]: *Traceback", output), describe
    match = re.search(r"exiting at iteration (\d+): signal SIGTERM \(checkpoint saved\)",
                      read(out / "log.txt"))
    assert match, describe
    stopped = int(match.group(1))
    assert (out / "ckpt/latest_checkpointed_iteration.txt").read_text().strip() == str(stopped)

    # The same command line again, two more steps, then the reference run straight through.
    end = stopped + 2
    proc = subprocess.run(["bash", str(TINY), *flags, "--exit-interval", str(end)],
                          env=tiny_env(tiny_data, out, ITERS="1000000"), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = read(out / "log.txt")
    assert f"resumed from {out / 'ckpt'} at iteration {stopped}" in log, tail(out / "log.txt")
    straight = tmp_path / "straight"
    want = reference_losses(tiny_data, straight, end, *common, "--tensorboard-dir",
                            str(straight / "tb"), ITERS="1000000")
    assert losses(log) == want
    # Bit for bit (float32): the loss scalars of the two starts, the second taking over after
    # the stop, against the straight run's.
    got = read_events(out / "tb", "resumed")
    assert got.starts == 2 and sorted(got.train["loss"]) == list(range(1, end + 1)), got.train
    assert got.train["loss"] == read_events(straight / "tb", "straight").train["loss"]

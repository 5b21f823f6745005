"""Asynchronous saves against the job's end. SIGKILL of a whole job (torchrun and both workers,
at once) at several moments while saves are being written: the checkpoint the tracker names
always loads, and the next launch resumes from it (each save's writer first sleeps 0.2 s, the
tests' pause, so that the kills land before, during and after the files and the commit).
And a stop signal during a save: both saves committed, exit 0.

The kill moments are a sample: the first save's start, 1.3 s after it, and KILL_SAMPLES moments
drawn between them, from a seed printed by the test (T5_KILL_SEED replays a run's sample). Each
CI run so tries other moments; the whole range was swept once (20 evenly spaced moments, all
sound) when the test was written."""

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from train_workers import base_argv

from megatron.checkpoint.io.checkpointing import damaged_file, read_tracker, tag_for

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
KILL_SAMPLES = 4
LAST_KILL_S = 1.3
"""From the first save's start to LAST_KILL_S later: before, during and after its files and its
commit (the tests' pause is 0.2 s; a tiny model's files take a few tenths more)."""


def kill_moments(seed: int):
    """The seconds after a save's start at which the rounds kill the job: both ends of the range
    and KILL_SAMPLES moments drawn between them with `seed`, in order."""
    drawn = random.Random(seed).sample(range(1, 130), KILL_SAMPLES)
    return [0.0, *sorted(d * LAST_KILL_S / 130 for d in drawn), LAST_KILL_S]


def kill_job(proc):
    family = [proc.pid]
    with contextlib.suppress(psutil.Error):
        family += [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    for pid in family:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(30)
    psutil.wait_procs([p for p in map(_process, family) if p is not None], timeout=10)


def _process(pid):
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def test_kills_during_async_saves_never_lose_the_tracked_checkpoint(train_data, tmp_path):
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.txt"
    flags = base_argv(train_data, "--save", str(ckpt), "--load", str(ckpt), "--async-save",
                      "--save-interval", "1", "--log-file", str(log), "--eval-interval", "0",
                      iters=100000)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WORLD_SIZE", "RANK"))}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", MEGATRON_CHECKPOINT_TEST_PAUSE_S="0.2")
    first = subprocess.run(  # a first checkpoint, so that every round has one to lose
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
         "-m", "megatron.pretrain_t5", *flags, "--exit-interval", "1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0 and read_tracker(ckpt) == 1, first.stderr[-3000:]
    seed = int(os.environ.get("T5_KILL_SEED", random.SystemRandom().randrange(2**32)))
    moments = kill_moments(seed)
    print(f"kill moments (T5_KILL_SEED={seed}): {', '.join(f'{m:.2f}' for m in moments)} s")
    seen = []
    for moment in moments:
        before = log.read_text().count("saving checkpoint") if log.exists() else 0
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--standalone", "-m", "megatron.pretrain_t5", *flags]
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            deadline = time.monotonic() + 180
            while not (log.exists() and log.read_text().count("saving checkpoint") > before):
                assert proc.poll() is None, proc.stderr.read()[-3000:]
                assert time.monotonic() < deadline
                time.sleep(0.02)
            time.sleep(moment)
        finally:
            kill_job(proc)
        iteration = read_tracker(ckpt)
        folder = ckpt / tag_for(iteration)
        assert (folder / "meta.json").is_file() and damaged_file(folder) is None, \
            f"killed {moment:.2f} s into a save (T5_KILL_SEED={seed})"
        seen.append(iteration)
    assert seen == sorted(seen) and seen[-1] > seen[0], (seen, f"T5_KILL_SEED={seed}")
    # the last tracked checkpoint resumes (a launch that ends by itself)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
         "-m", "megatron.pretrain_t5", *flags, "--exit-interval", str(seen[-1] + 1)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from {ckpt} at iteration {seen[-1]}" in log.read_text()
    assert read_tracker(ckpt) == seen[-1] + 1


def test_a_stop_signal_during_an_async_save(train_data, tmp_path):
    """SIGTERM while a save is being written (its writer sleeps 3 s first): the run agrees to
    stop at the next step boundary, saves that step (after committing the outstanding save)
    and exits 0 with both committed and sound."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.txt"
    flags = base_argv(train_data, "--save", str(ckpt), "--load", str(ckpt), "--async-save",
                      "--save-interval", "3", "--log-file", str(log), "--eval-interval", "0",
                      iters=100000)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WORLD_SIZE", "RANK"))}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1",
               MEGATRON_CHECKPOINT_TEST_PAUSE_S="3:3")
    proc = subprocess.Popen([sys.executable, "-m", "megatron.pretrain_t5", *flags], cwd=tmp_path,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not (log.exists() and "saving checkpoint 3 in the background" in log.read_text()):
            assert proc.poll() is None, proc.stderr.read()[-3000:]  # it ended: say why
            assert time.monotonic() < deadline, "no third save in time"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, proc.stderr.read()[-3000:]
    finally:
        if proc.poll() is None:
            kill_job(proc)
    text = log.read_text()
    stopped = int(text.split(" exiting at iteration ")[1].split(":")[0])
    assert stopped > 3 and f"exiting at iteration {stopped}: signal SIGTERM (checkpoint saved)" \
        in text
    assert f"saved checkpoint {ckpt / 'iter_0000003'}" in text
    assert read_tracker(ckpt) == stopped and damaged_file(ckpt / tag_for(stopped)) is None
    assert not list(ckpt.glob("*.tmp"))

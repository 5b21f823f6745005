"""Checkpoints that never lose the last good state: a diverged run stops before it saves
(--check-for-nan-in-loss-and-grad, on by default), --keep-last removes only older, committed
checkpoints, and a full disk (a small tmpfs) fails a save without touching the last one."""

import json
import subprocess

import pytest

from harness import run_workers
from train_workers import base_argv, run_pretrain, run_pretrain_until_error

pytestmark = pytest.mark.slow


def tracker(root):
    return (root / "latest_checkpointed_iteration.txt").read_text().strip()


def test_a_diverging_run_stops_before_saving(train_data, tmp_path):
    """Resumed from a good checkpoint with a learning rate so large that the first update sends
    the fp32 weights towards overflow: the next step is not finite, the run stops there
    (every rank, one message naming the iteration and the rank) and saves nothing; the tracker
    still names the good checkpoint. With the check off, the same run goes on and saves. (The
    divergence guard, which would stop it one step earlier at the weights' growth, is off here:
    tests/training/test_divergence_runs.py is its test.)"""
    ckpt = tmp_path / "ckpt"
    good = base_argv(train_data, "--save", str(ckpt), "--save-interval", "2", iters=2)
    wild = base_argv(train_data, "--load", str(ckpt), "--save", str(ckpt), "--save-interval",
                     "2", "--lr", "1e30", "--use-new-lr", "--log-interval", "1",
                     "--no-check-for-divergence", iters=6)
    first = run_workers(2, run_pretrain_until_error, [good, wild], timeout=600)
    assert all("error" not in r[0] for r in first)
    for rank_result in first:
        error = rank_result[1]["error"]
        # the update of step 3 (lr 8e29) makes step 4's gradients overflow (its loss stays
        # finite: the RMS norms rescale the huge weights)
        assert error.startswith("NonFiniteError: iteration 4: the gradient norm is not finite "
                                "(seen by rank ")
        assert "stopping without saving" in error
    assert tracker(ckpt) == "2"
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000002"]
    unchecked = wild + ["--no-check-for-nan-in-loss-and-grad", "--exit-interval", "4"]
    second = run_workers(2, run_pretrain_until_error, [unchecked], timeout=600)
    assert all("error" not in r[0] for r in second)
    assert tracker(ckpt) == "4"  # the diverged model, saved: what the check prevents


def test_keep_last(train_data, tmp_path):
    ckpt = tmp_path / "ckpt"
    argv = base_argv(train_data, "--save", str(ckpt), "--save-interval", "1", "--keep-last", "2",
                     "--exit-interval", "4", iters=5)
    resume = base_argv(train_data, "--save", str(ckpt), "--load", str(ckpt), "--save-interval",
                       "1", "--keep-last", "2", iters=5)
    run_workers(2, run_pretrain, [argv], timeout=600)
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("iter_")) == \
        ["iter_0000003", "iter_0000004"]
    assert tracker(ckpt) == "4"
    result = run_workers(2, run_pretrain, [resume], timeout=600)[0][0]
    assert sorted(result["losses"]) == [5]
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("iter_")) == \
        ["iter_0000004", "iter_0000005"]
    assert json.loads((ckpt / "iter_0000005" / "meta.json").read_text())["iteration"] == 5


@pytest.fixture
def small_disk(tmp_path):
    """A 6 MiB tmpfs: room for one checkpoint of the tiny model (3.9 MB), not two."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs needs root (CI runs as root): {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_full_disk_keeps_the_last_checkpoint(train_data, small_disk, tmp_path, mode):
    """Save 2 fits; save 4 runs out of space (ENOSPC) on rank 0: every rank drops it, the
    partial folder goes, the run warns and goes on; the final save (5) fails the same way and,
    with nothing left to try again, ends the run with an error. The tracker names 2 throughout,
    and that checkpoint resumes."""
    ckpt, log = small_disk / "ckpt", tmp_path / f"{mode}.log"
    extra = ["--async-save"] if mode == "async" else []
    argv = base_argv(train_data, "--save", str(ckpt), "--save-interval", "2", "--log-file",
                     str(log), *extra, iters=5)
    results = run_workers(2, run_pretrain_until_error, [argv], timeout=600)
    errors = [r[0]["error"] for r in results]
    assert all(e.startswith("SaveFailed: saving iteration 5 to ") for e in errors), errors
    assert "No space left on device" in errors[0]  # rank 0 writes the model file
    text = log.read_text()
    assert "warning: saving iteration 4 to" in text and "trying again at the next save" in text
    assert tracker(ckpt) == "2"
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("iter_")) == \
        ["iter_0000002"]
    resumed = run_workers(2, run_pretrain, [base_argv(
        train_data, "--load", str(ckpt), "--save", str(tmp_path / "elsewhere"), iters=5)],
        timeout=600)[0][0]
    assert sorted(resumed["losses"]) == [3, 4, 5]


def test_a_truncated_file_at_load_is_named(train_data, tmp_path):
    """A file cut short (a writer killed outside our protocol, a copy that ran out of space):
    one message naming it and its size at the save, on every rank, before anything starts,
    instead of a zip or pickle traceback (a checkpoint saved without the sizes: named when the
    run loads it, tests/unit/test_checkpoint_completeness.py)."""
    ckpt = tmp_path / "ckpt"
    run_workers(2, run_pretrain, [base_argv(train_data, "--save", str(ckpt), "--exit-interval",
                                            "2", iters=4)], timeout=600)
    target = ckpt / "iter_0000002" / "mp_rank_00_model_states.pt"
    size = target.stat().st_size
    target.write_bytes(target.read_bytes()[:size // 2])
    results = run_workers(2, run_pretrain_until_error, [base_argv(
        train_data, "--load", str(ckpt), iters=4)], timeout=600)
    for rank_results in results:
        error = rank_results[0]["error"]
        assert error.startswith("ArgumentsError"), error
        assert (f"--load {ckpt}: the checkpoint of iteration 2 is incomplete: {target} has "
                f"{size // 2} bytes, the save wrote {size}; no earlier complete iteration"
                in error), error


def test_a_stuck_async_writer_is_named(train_data, tmp_path, monkeypatch):
    """An asynchronous save whose writer makes no progress (the tests' pause: 600 s before the
    first file of iteration 2) fails the run once --checkpoint-timeout-minutes (3 s) pass,
    naming the file it is stuck on; the tracker stays at the save before."""
    monkeypatch.setenv("MEGATRON_CHECKPOINT_TEST_PAUSE_S", "2:600")
    ckpt = tmp_path / "ckpt"
    argv = base_argv(train_data, "--save", str(ckpt), "--save-interval", "1", "--async-save",
                     "--checkpoint-timeout-minutes", "0.05", "--eval-interval", "0",
                     iters=100000)
    results = run_workers(2, run_pretrain_until_error, [argv], timeout=600)
    for rank, rank_results in enumerate(results):
        error = rank_results[0]["error"]
        assert error.startswith(f"CheckpointError: saving iteration 2 to {ckpt}: a rank's "
                                f"checkpoint writer made no progress for 0.05 minutes"), error
    assert f"(this rank: still writing {ckpt / 'iter_0000002.tmp'}" in results[0][0]["error"]
    assert tracker(ckpt) == "1"

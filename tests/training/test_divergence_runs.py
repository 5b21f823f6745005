"""The divergence guard on real runs (megatron/training/divergence.py; the checks themselves are
unit-tested against hand-computed sequences in tests/unit/test_divergence.py).

Issue 24's reproduction, quick: the tiny model resumed from a healthy checkpoint (iteration 2)
with --lr 1e6. Step 3's update multiplies the weights by millions; step 4's loss is stuck at
ln(4100) = 8.31874 with a gradient norm of exactly 0; step 5's gradient norm is NaN. The weight
growth stops the run at 3; with it off, the zero norm stops it at 4 and the save of iteration 3,
held for want of step 4's verdict, is removed; with the guard off, iterations 3 and 4 are
committed (what the guard prevents). Every rank raises the same message, and the tracker names
iteration 2. A pipeline (the loss on the last stage) agrees in the same way, and the entry point
exits 1 with the message printed once."""

import math
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from harness import run_workers
from train_workers import base_argv, run_pretrain, run_pretrain_until_error

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
STUCK = f"{math.log(4100):.6g}"  # the loss of logits that are all equal: ln(vocabulary)
ADVICE = ("(lower the learning rate or lengthen its warmup, and start again: --load resumes "
          "from that checkpoint; if the run was healthy, raise the threshold, or "
          "--no-check-for-divergence turns this guard off)")


def free_port():
    """A port nobody listens on now (the default 29500 may be another job's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tracker(root):
    return (root / "latest_checkpointed_iteration.txt").read_text().strip()


def folders(root):
    return sorted(p.name for p in root.iterdir() if p.name.startswith("iter_"))


@pytest.fixture(scope="module")
def healthy(train_data, tmp_path_factory):
    """Two healthy steps on 2 ranks, saved at 1 and 2 (both committed: the tracker names 2)."""
    ckpt = tmp_path_factory.mktemp("healthy") / "ckpt"
    run_workers(2, run_pretrain, [base_argv(train_data, "--save", str(ckpt), "--save-interval",
                                            "1", iters=2)], timeout=600)
    assert tracker(ckpt) == "2" and folders(ckpt) == ["iter_0000001", "iter_0000002"]
    return ckpt


def blow_up(train_data, healthy, tmp_path, *extra):
    """Resume a copy of the healthy checkpoint at --lr 1e6, saving every step; every rank's
    result (an error or the run's state) and the copy."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(healthy, ckpt)
    argv = base_argv(train_data, "--load", str(ckpt), "--save", str(ckpt), "--save-interval",
                     "1", "--lr", "1e6", "--use-new-lr", "--log-interval", "1", *extra,
                     iters=8)
    results = run_workers(2, run_pretrain_until_error, [argv], timeout=600)
    return [r[0] for r in results], ckpt


def same_error(results):
    """The message every rank raised (they must agree)."""
    errors = {r.get("error") for r in results}
    assert len(errors) == 1 and None not in errors, results
    return errors.pop()


def test_the_update_that_blows_up_is_never_saved(train_data, healthy, tmp_path):
    results, ckpt = blow_up(train_data, healthy, tmp_path)
    error = same_error(results)
    assert error.startswith("DivergenceError: iteration 3: the run diverged (weight growth): the "
                            "norm of a weight tensor grew "), error
    grew = float(error.split(" grew ")[1].split(" times")[0])
    assert grew > 1e5  # Adam moved weights of size ~0.2 by ~1e6
    assert error.endswith("(--divergence-weight-growth 2); stopping without saving iteration 3, "
                          f"so the last checkpoint in {ckpt} stays the one its tracker names: "
                          f"iteration 2 {ADVICE}"), error
    assert tracker(ckpt) == "2" and folders(ckpt) == ["iter_0000001", "iter_0000002"]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_zero_norms_remove_the_held_save(train_data, healthy, tmp_path, mode):
    """Weight growth off: step 4's norm is exactly 0 (--divergence-zero-grad-steps 1 stops at
    the first), so the weights saved at 3 are diverged; that save waited, uncommitted, for
    step 4 and is removed."""
    results, ckpt = blow_up(train_data, healthy, tmp_path, "--divergence-weight-growth", "0",
                            "--divergence-zero-grad-steps", "1",
                            *(["--async-save"] if mode == "async" else []))
    error = same_error(results)
    assert error == (f"DivergenceError: iteration 4: the run diverged (zero gradient norm): the "
                     f"gradient norm was exactly 0 at iteration 4; the loss {STUCK} "
                     f"(--divergence-zero-grad-steps 1); stopping without saving iteration 4 "
                     f"(the held, uncommitted save of iteration 3 removed), so the last "
                     f"checkpoint in {ckpt} stays the one its tracker names: iteration 2 "
                     f"{ADVICE}")
    assert tracker(ckpt) == "2" and folders(ckpt) == ["iter_0000001", "iter_0000002"]


def test_with_the_guard_off_the_diverged_weights_are_saved(train_data, healthy, tmp_path):
    """Issue 24 as reported: the NaN guard stops at 5, after iterations 3 and 4, whose weights
    give the stuck loss and a zero gradient norm, were committed."""
    results, ckpt = blow_up(train_data, healthy, tmp_path, "--no-check-for-divergence")
    error = same_error(results)
    assert error.startswith("NonFiniteError: iteration 5: the gradient norm is not finite")
    assert "its tracker names: iteration 4 (" in error
    assert tracker(ckpt) == "4" and folders(ckpt) == [f"iter_000000{i}" for i in range(1, 5)]


def test_a_pipeline_agrees_on_the_loss_of_its_last_stage(train_data, tmp_path):
    """PP 2 from scratch, weight growth off: step 1 (lr 1e6) blows the model up, step 2's norm
    is 0 and its loss, computed on the last stage only, is in both stages' message."""
    ckpt = tmp_path / "ckpt"
    argv = base_argv(train_data, "--pipeline-model-parallel-size", "2", "--save", str(ckpt),
                     "--save-interval", "1", "--lr", "1e6", "--lr-warmup-iters", "0",
                     "--divergence-weight-growth", "0", "--divergence-zero-grad-steps", "1")
    error = same_error([r[0] for r in run_workers(2, run_pretrain_until_error, [argv],
                                                  timeout=600)])
    assert error.startswith(f"DivergenceError: iteration 2: the run diverged (zero gradient "
                            f"norm): the gradient norm was exactly 0 at iteration 2; the loss "
                            f"{STUCK} "), error
    assert "(the held, uncommitted save of iteration 1 removed)" in error
    assert "its tracker names: none yet" in error
    assert not ckpt.exists() or folders(ckpt) == []


def test_the_entry_point_exits_1_and_says_it_once(train_data, tmp_path):
    """One process, `python -m megatron.pretrain_t5`, --lr 1e6 without warmup: exit 1 at
    iteration 1, the message once on stderr (not on stdout) and in the log file, nothing saved."""
    save, log = tmp_path / "ckpt", tmp_path / "run.log"
    argv = base_argv(train_data, "--save", str(save), "--save-interval", "1", "--log-file",
                     str(log), "--lr", "1e6", "--lr-warmup-iters", "0", iters=3)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env.pop("WORLD_SIZE", None)
    done = subprocess.run([sys.executable, "-m", "megatron.pretrain_t5", *argv], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    start = "error: iteration 1: the run diverged (weight growth): "
    assert done.stderr.count(start) == 1 and start not in done.stdout, done.stderr[-3000:]
    assert "its tracker names: none yet" in done.stderr
    assert log.read_text().count(start) == 1
    assert not save.exists() or folders(save) == []

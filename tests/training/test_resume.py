"""Exact resume: k steps, save, load, k more steps give the losses of 2k steps straight, bit for
bit (fp32, ZeRO 0 and 3, dropout on so the random states matter); what --no-load-optim and
--finetune restore; atomic saves."""

import pytest

from harness import run_workers
from train_workers import base_argv, run_pretrain

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("stage", ["0", "3"])
def test_resume_is_exact(train_data, tmp_path, stage):
    ckpt = str(tmp_path / "ckpt")
    run = lambda *extra: base_argv(train_data, "--zero-stage", stage, *extra,  # noqa: E731
                                   model=train_data.tiny_dropout, iters=6)
    straight, first, second = run_workers(2, run_pretrain, [
        run(), run("--save", ckpt, "--exit-interval", "3"), run("--save", ckpt, "--load", ckpt),
    ], timeout=600)[0]
    assert first["iteration"] == 3 and second["iteration"] == 6
    assert sorted(first["losses"]) == [1, 2, 3] and sorted(second["losses"]) == [4, 5, 6]
    for i in range(1, 7):  # exact float equality: the same bits
        assert (first["losses"] | second["losses"])[i] == straight["losses"][i], i
    # evaluations: at 2 (before the stop), at 4 and at the end (after the resume)
    assert first["evals"] + second["evals"] == straight["evals"]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "6\n"


def test_no_load_optim_and_finetune(train_data, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run = lambda *extra: base_argv(train_data, "--zero-stage", "1", *extra, iters=6)  # noqa: E731
    straight, first, weights_only, finetune = run_workers(2, run_pretrain, [
        run(), run("--save", ckpt, "--exit-interval", "3"),
        run("--load", ckpt, "--no-load-optim", "--no-load-rng"),
        run("--load", ckpt, "--finetune", "--lr", "0"),
    ], timeout=600)[0]
    # Same weights and the same batch: the first resumed step's loss is the straight run's;
    # the fresh Adam state then takes another path.
    assert weights_only["losses"][4] == straight["losses"][4]
    assert weights_only["losses"][5] != straight["losses"][5]
    # --finetune: the weights of iteration 3, everything else fresh (iteration 0, first batch).
    assert sorted(finetune["losses"]) == list(range(1, 7))
    assert finetune["losses"][1] < straight["losses"][1]
    # lr 0: the weights stay those of iteration 3, so every evaluation (the same valid batches)
    # gives the same loss
    valid = [e[2] for e in finetune["evals"] if e[1] == "valid"]
    assert len(set(valid)) == 1


@pytest.mark.parametrize("world,extra", [
    (2, ["--zero-stage", "0"]),
    (2, ["--zero-stage", "3"]),
    (2, ["--zero-stage", "2", "--offload-optimizer", "cpu"]),
    (2, ["--tensor-model-parallel-size", "2", "--zero-stage", "1"]),
    (4, ["--pipeline-model-parallel-size", "2", "--zero-stage", "1"]),
], ids=["dp2_z0", "dp2_z3", "dp2_z2_offload", "tp2_z1", "pp2_dp2_z1"])
def test_async_save_resume_is_exact(train_data, tmp_path, world, extra):
    """--async-save: the files are written in the background while steps go on, committed at a
    later step boundary (or before the exit); resuming gives the straight run's losses, bit for
    bit, as a synchronous save does."""
    ckpt = str(tmp_path / "ckpt")
    run = lambda *more: base_argv(train_data, *extra, *more,  # noqa: E731
                                  model=train_data.tiny_dropout, iters=6)
    straight, first, second = run_workers(world, run_pretrain, [
        run(),
        run("--save", ckpt, "--save-interval", "1", "--async-save", "--exit-interval", "3"),
        run("--save", ckpt, "--load", ckpt, "--async-save", "--save-interval", "2"),
    ], timeout=900)[0]
    assert first["iteration"] == 3 and second["iteration"] == 6
    for i in range(1, 7):
        assert (first["losses"] | second["losses"])[i] == straight["losses"][i], i
    assert first["evals"] + second["evals"] == straight["evals"]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "6\n"
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("iter_*")) == [
        "iter_0000001", "iter_0000002", "iter_0000003", "iter_0000004", "iter_0000006"]

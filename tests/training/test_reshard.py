"""Resharding with the optimizer states: a checkpoint converted to another layout
(`convert_checkpoint.py --load CKPT --to megatron OUT --target-...`) resumes with `--load OUT`
and continues with the losses of the run that wrote it, uninterrupted (fp32, rel 1e-5).

The chain TP 2 (ZeRO-0) -> TP 1 (DP 2, ZeRO-2) -> TP 4 (ZeRO-1), and PP 2 (ZeRO-1) -> PP 1 (one
process; DP 2 with ZeRO-3; DP 2 with ZeRO-2 and the optimizer offloaded to the CPU). The reference is each source run's own losses after the step it
saved at. A resume without the optimizer states (--no-load-optim: same weights, same data, fresh
Adam) leaves them at once: the comparison can fail."""

import pytest

from harness import run_workers
from train_workers import base_argv, losses, run_pretrain

from data_tools import convert_checkpoint

pytestmark = pytest.mark.slow

RTOL = 1e-5


def convert(source, out, *extra):
    rc = convert_checkpoint.main(["--load", str(source), "--to", "megatron", str(out),
                                  "--no-progress", *extra])
    assert rc == 0


def after(result, start):
    """The losses of steps after `start`, in order."""
    return [result["losses"][i] for i in sorted(result["losses"]) if i > start]


@pytest.fixture(scope="module")
def runs(train_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")

    def argv(*extra, iters=6):
        return base_argv(train_data, *extra, iters=iters)

    sources = run_workers(2, run_pretrain, [
        argv("--tensor-model-parallel-size", "2", "--save", str(root / "tp2"),
             "--save-interval", "2"),
        argv("--pipeline-model-parallel-size", "2", "--zero-stage", "1",
             "--save", str(root / "pp2"), "--save-interval", "2", iters=4),
        argv("--pipeline-model-parallel-size", "2", "--zero-stage", "1", "--bf16",
             "--save", str(root / "pp2_bf16"), "--save-interval", "2", iters=4),
    ], timeout=1200)[0]
    convert(root / "tp2", root / "tp2_as_tp1", "--iteration", "2")
    convert(root / "tp2", root / "tp2_as_tp2", "--iteration", "2",
            "--target-tensor-parallel-size", "2")
    convert(root / "pp2", root / "pp2_as_pp1", "--iteration", "2")
    convert(root / "pp2_bf16", root / "pp2_bf16_again", "--iteration", "2",
            "--target-pipeline-parallel-size", "2")
    resumed = run_workers(2, run_pretrain, [
        argv("--zero-stage", "2", "--load", str(root / "tp2_as_tp1"),
             "--save", str(root / "tp1"), "--exit-interval", "4"),
        argv("--tensor-model-parallel-size", "2", "--load", str(root / "tp2_as_tp2")),
        argv("--zero-stage", "2", "--load", str(root / "tp2_as_tp1"), "--no-load-optim"),
        argv("--zero-stage", "3", "--load", str(root / "pp2_as_pp1"), iters=4),
        argv("--zero-stage", "2", "--offload-optimizer", "cpu",
             "--load", str(root / "pp2_as_pp1"), iters=4),
        argv("--pipeline-model-parallel-size", "2", "--zero-stage", "1", "--bf16",
             "--load", str(root / "pp2_bf16_again"), iters=4),
    ], timeout=1200)[0]
    convert(root / "tp1", root / "tp1_as_tp4", "--target-tensor-parallel-size", "4")
    tp4 = run_workers(4, run_pretrain, [
        argv("--tensor-model-parallel-size", "4", "--zero-stage", "1",
             "--load", str(root / "tp1_as_tp4")),
    ], timeout=1200)[0][0]
    one = run_workers(1, run_pretrain, [argv("--load", str(root / "pp2_as_pp1"), iters=4)],
                      timeout=600)[0][0]
    return {"tp2": sources[0], "pp2": sources[1], "pp2_bf16": sources[2], "tp1": resumed[0],
            "tp2_again": resumed[1], "fresh_adam": resumed[2], "pp2_as_dp2_z3": resumed[3],
            "pp2_as_offload": resumed[4], "pp2_bf16_again": resumed[5], "tp4": tp4,
            "pp2_as_one": one}


def test_tp2_to_tp1_to_tp4_continues_the_losses(runs):
    reference = runs["tp2"]
    assert sorted(runs["tp1"]["losses"]) == [3, 4] and runs["tp1"]["iteration"] == 4
    assert after(runs["tp1"], 2) == pytest.approx(after(reference, 2)[:2], rel=RTOL)
    assert sorted(runs["tp4"]["losses"]) == [5, 6]
    assert after(runs["tp4"], 4) == pytest.approx(after(reference, 4), rel=RTOL)
    # the evaluations after the resume (steps 4 and 6) too
    assert [e[2] for e in runs["tp4"]["evals"]] == pytest.approx(
        [e[2] for e in reference["evals"] if e[0] == 6], rel=RTOL)


def test_same_layout_round_trip_is_a_plain_resume(runs):
    """Converted to its own layout, the checkpoint resumes as DeepSpeed's own files do: fp32
    ZeRO-0, and bf16 through DeepSpeed's BF16 optimizer (its masters and moments are fp32 in the
    converted files; its bf16 weights are theirs rounded, as DeepSpeed makes them)."""
    assert after(runs["tp2_again"], 2) == pytest.approx(after(runs["tp2"], 2), rel=1e-6)
    assert after(runs["pp2_bf16_again"], 2) == pytest.approx(after(runs["pp2_bf16"], 2),
                                                             rel=1e-6)


def test_pp2_to_pp1_continues_the_losses(runs):
    reference = after(runs["pp2"], 2)
    assert len(reference) == 2
    assert after(runs["pp2_as_one"], 2) == pytest.approx(reference, rel=RTOL)
    assert after(runs["pp2_as_dp2_z3"], 2) == pytest.approx(reference, rel=RTOL)
    # DeepSpeedCPUAdam (its step an int) with the ZeRO-2 partitions on the host
    assert after(runs["pp2_as_offload"], 2) == pytest.approx(reference, rel=RTOL)


def test_without_the_optimizer_states_the_losses_part(runs):
    """--no-load-optim: the converted weights and the data position, a fresh Adam."""
    reference, fresh = after(runs["tp2"], 2), after(runs["fresh_adam"], 2)
    assert fresh[0] == pytest.approx(reference[0], rel=RTOL)  # same weights, same batch
    assert abs(fresh[1] - reference[1]) > 100 * RTOL * abs(reference[1])
    assert losses(runs["fresh_adam"])[:1] == fresh[:1]


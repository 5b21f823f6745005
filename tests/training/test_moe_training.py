"""Mixture-of-Experts training is independent of the layout: losses and gradient norms of 4 steps
with experts split over ranks (EP 2; ZeRO 0, 1 and 2; with data parallelism beside it; with
TP 2; with a pipeline of 2 stages, the balancing losses crossing them) equal one process that
reaches the same global batch by accumulation; and a run that stops and resumes under EP 2, with
and without a pipeline, equals the straight run."""

import pytest

from harness import run_workers

from data_tools import convert_checkpoint
from train_workers import assert_same_run, base_argv, losses, run_pretrain

pytestmark = pytest.mark.slow

MOE = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-z-loss-coeff", "1e-2",
       "--moe-aux-loss-coeff", "1e-1")


CAPACITY = ("--moe-expert-capacity-factor", "1.0")


@pytest.fixture(scope="module")
def singles(train_data):
    return run_workers(1, run_pretrain, [base_argv(train_data, *MOE),
                                         base_argv(train_data, *MOE, *CAPACITY)],
                       timeout=600)[0]


@pytest.fixture(scope="module")
def single(singles):
    return singles[0]


def assert_same_moe_stats(got, want):
    """The logged per-layer numbers (global quantities: every rank's tokens) agree."""
    assert sorted(got) == sorted(want) == [2, 4]
    for iteration in want:
        assert sorted(got[iteration]) == sorted(want[iteration])
        for layer, values in want[iteration].items():
            assert got[iteration][layer] == pytest.approx(values, rel=1e-4, abs=1e-7), layer


def test_moe_single_process_learns_and_reports_its_layers(singles):
    got = losses(singles[0])
    assert got[-1] < got[0]
    for run, capacity in zip(singles, (False, True)):
        layers = run["moe"][4]
        # tiny.json: 2 + 2 blocks, every block sparse by default
        assert sorted(layers) == ["decoder.block.0", "decoder.block.1", "encoder.block.0",
                                  "encoder.block.1"]
        for values in layers.values():
            assert values["max_load"] >= 1.0
            assert (values["dropped"] > 0) == capacity
            # E x sum_e f_e P_e with k = 2: at least 2 (uniform), at most 2 E
            assert 2.0 - 1e-6 <= values["aux_loss"] <= 8.0
            assert values["z_loss"] > 0


def test_expert_parallel_zero_stages_match_one_process(train_data, single):
    runs = [["--expert-model-parallel-size", "2", "--zero-stage", str(s)] for s in (0, 1, 2)]
    got = run_workers(2, run_pretrain, [base_argv(train_data, *MOE, *r) for r in runs],
                      timeout=900)
    assert got[0] == got[1]
    for flags, result in zip(runs, got[0]):
        assert_same_run(result, single, rtol=2e-5, label=flags)
        assert_same_moe_stats(result["moe"], single["moe"])


def test_expert_parallel_with_data_and_tensor_parallel_match_one_process(train_data, singles):
    runs = [["--expert-model-parallel-size", "2", "--zero-stage", "1",
             "--micro-batch-size", "1", *CAPACITY],
            ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
             "--zero-stage", "2"]]
    got = run_workers(4, run_pretrain, [base_argv(train_data, *MOE, *r) for r in runs],
                      timeout=900)
    assert all(g == got[0] for g in got)
    for flags, result, reference in zip(runs, got[0], singles[::-1]):
        assert_same_run(result, reference, rtol=2e-5, label=flags)
        assert_same_moe_stats(result["moe"], reference["moe"])


@pytest.mark.parametrize("stage", ["0", "1", "2"])
def test_expert_parallel_resume_is_exact(train_data, tmp_path, stage):
    """EP 2: 3 steps, save, load, 3 more give the 6 straight steps bit for bit (dropout on, the
    expert bias on: its state is in the checkpoint too); the experts of each expert-parallel
    rank come back from their own file."""
    ckpt = str(tmp_path / "ckpt")
    run = lambda *extra: base_argv(  # noqa: E731
        train_data, *MOE, "--expert-model-parallel-size", "2", "--zero-stage", stage,
        "--moe-router-enable-expert-bias", *extra, model=train_data.tiny_dropout, iters=6)
    straight, first, second = run_workers(2, run_pretrain, [
        run(), run("--save", ckpt, "--exit-interval", "3"), run("--save", ckpt, "--load", ckpt),
    ], timeout=600)[0]
    assert first["iteration"] == 3 and second["iteration"] == 6
    for i in range(1, 7):
        assert (first["losses"] | second["losses"])[i] == straight["losses"][i], i
    assert first["evals"] + second["evals"] == straight["evals"]
    files = sorted(p.name for p in (tmp_path / "ckpt" / "iter_0000003").glob("expert_*"))
    assert files == ["expert_parallel_rank_00_mp_rank_00_model_states.pt",
                     "expert_parallel_rank_01_mp_rank_00_model_states.pt"]


@pytest.mark.parametrize("zero", ["0", "1"])
def test_expert_parallel_with_a_pipeline_matches_one_process(train_data, single, tmp_path, zero):
    """PP 2 x EP 2 (DP 2): the encoder's balancing losses travel to the last stage with the
    hidden state and their gradients come back; the per-layer numbers gathered from both
    stages carry the single-process names. Its checkpoint (DeepSpeed's MoE layout: each stage's
    weights in its model file) converts with the optimizer states, and both one process and
    PP 2 x EP 2 resume from the conversion with the losses of the uninterrupted run."""
    layout = ("--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
              "--zero-stage", zero)
    ckpt, converted = tmp_path / "ckpt", tmp_path / "converted"
    got = run_workers(4, run_pretrain, [base_argv(train_data, *MOE, *layout, "--save", str(ckpt),
                                                  "--save-interval", "2")], timeout=900)
    assert all(g == got[0] for g in got)
    assert_same_run(got[0][0], single, rtol=2e-5)
    assert_same_moe_stats(got[0][0]["moe"], single["moe"])

    assert convert_checkpoint.main(["--load", str(ckpt), "--iteration", "2", "--to", "megatron",
                                    str(converted), "--no-progress"]) == 0
    resume = ("--load", str(converted))
    one = run_workers(1, run_pretrain, [base_argv(train_data, *MOE, *resume)], timeout=600)
    again = run_workers(4, run_pretrain, [base_argv(train_data, *MOE, *layout, *resume)],
                        timeout=900)
    for result in (one[0][0], again[0][0]):
        assert sorted(result["losses"]) == [3, 4]
        assert [result["losses"][i] for i in (3, 4)] == pytest.approx(
            [single["losses"][i] for i in (3, 4)], rel=2e-5)


def test_expert_parallel_resume_with_a_pipeline_is_exact(train_data, tmp_path):
    """PP 2 x EP 2: 3 steps, save, load, 3 more give the 6 straight steps bit for bit (dropout
    and the expert bias on)."""
    ckpt = str(tmp_path / "ckpt")
    run = lambda *extra: base_argv(  # noqa: E731
        train_data, *MOE, "--expert-model-parallel-size", "2",
        "--pipeline-model-parallel-size", "2", "--moe-router-enable-expert-bias", *extra,
        model=train_data.tiny_dropout, iters=6)
    straight, first, second = run_workers(4, run_pretrain, [
        run(), run("--save", ckpt, "--exit-interval", "3"), run("--save", ckpt, "--load", ckpt),
    ], timeout=900)[0]
    assert first["iteration"] == 3 and second["iteration"] == 6
    for i in range(1, 7):
        assert (first["losses"] | second["losses"])[i] == straight["losses"][i], i
    assert first["evals"] + second["evals"] == straight["evals"]
    files = sorted(p.name for p in (tmp_path / "ckpt" / "iter_0000003").glob("expert_*"))
    assert files == [f"expert_parallel_rank_{e:02d}_mp_rank_{m:02d}_model_states.pt"
                     for e in range(2) for m in range(2)]


def test_bf16_pipeline_with_expert_parallelism_follows_fp32(train_data, single):
    """PP 2 x EP 2 in bf16 with ZeRO-1 (DeepSpeed's BF16 optimizer, its expert groups): the
    losses and gradient norms of the fp32 single-process run, to bf16's precision (the losses
    within one unit in the last place of bf16, 2^-8)."""
    argv = base_argv(train_data, *MOE, "--expert-model-parallel-size", "2",
                     "--pipeline-model-parallel-size", "2", "--zero-stage", "1", "--bf16")
    got = run_workers(4, run_pretrain, [argv], timeout=900)[0][0]
    assert losses(got) == pytest.approx(losses(single), rel=2 ** -8)
    assert [got["grad_norms"][i] for i in sorted(got["grad_norms"])] == pytest.approx(
        [single["grad_norms"][i] for i in sorted(single["grad_norms"])], rel=2e-2)

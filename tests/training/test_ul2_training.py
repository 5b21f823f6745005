"""`--t5-objective ul2` trains: the losses of 6 steps fall, and DP 2, TP 2 and PP 2 have the
losses, gradient norms and evaluation losses of one process (the samples depend on the seed and
their index only)."""

import pytest

from harness import run_workers
from train_workers import base_argv, losses, run_pretrain

pytestmark = pytest.mark.slow

UL2 = ("--t5-objective", "ul2")


def test_ul2_is_the_same_in_every_layout_and_learns(train_data):
    single = run_workers(1, run_pretrain, [base_argv(train_data, *UL2, iters=6)],
                         timeout=600)[0][0]
    got = losses(single)
    assert len(got) == 6 and got[-1] < got[0]
    layouts = [(), ("--tensor-model-parallel-size", "2"),
               ("--pipeline-model-parallel-size", "2")]
    runs = run_workers(2, run_pretrain, [base_argv(train_data, *UL2, *layout, iters=6)
                                         for layout in layouts], timeout=900)[0]
    for layout, result in zip(layouts, runs):
        assert sorted(result["losses"]) == sorted(single["losses"]), layout
        assert losses(result) == pytest.approx(got, rel=2e-5), layout
        assert [e[2] for e in result["evals"]] == pytest.approx(
            [e[2] for e in single["evals"]], rel=2e-5), layout

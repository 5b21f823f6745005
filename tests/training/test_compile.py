"""--compile: each transformer block under torch.compile gives the losses, gradient norms and
evaluation losses of the uncompiled run (fp32, rel 1e-5) for 5 steps, with and without
activation checkpointing, and with TP 2."""

import pytest

from harness import run_workers
from train_workers import base_argv, losses, run_pretrain

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("extra", [(), ("--checkpoint-activations",)],
                         ids=["plain", "checkpointed"])
def test_compiled_blocks_train_as_the_uncompiled_ones(train_data, extra):
    plain, compiled = run_workers(1, run_pretrain, [
        base_argv(train_data, *extra, iters=5),
        base_argv(train_data, *extra, "--compile", iters=5)], timeout=900)[0]
    assert sorted(compiled["losses"]) == [1, 2, 3, 4, 5]
    assert losses(compiled) == pytest.approx(losses(plain), rel=1e-5)
    norms = lambda r: [r["grad_norms"][i] for i in sorted(r["grad_norms"])]  # noqa: E731
    assert norms(compiled) == pytest.approx(norms(plain), rel=1e-5)
    assert [e[2] for e in compiled["evals"]] == pytest.approx([e[2] for e in plain["evals"]],
                                                              rel=1e-5)


def test_compiled_blocks_with_tensor_parallelism(train_data):
    tp = ("--tensor-model-parallel-size", "2", "--global-batch-size", "2",
          "--micro-batch-size", "2")
    plain, compiled = run_workers(2, run_pretrain, [
        base_argv(train_data, *tp, iters=3), base_argv(train_data, *tp, "--compile", iters=3)],
        timeout=900)[0]
    assert losses(compiled) == pytest.approx(losses(plain), rel=1e-5)

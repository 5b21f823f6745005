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


def _compiled_tiny_model_steps(dropout_rate: float):
    """A tiny model's blocks compiled, three training steps on the CPU: (dynamo's graph-break
    reasons, graphs compiled, losses, the uncompiled twin's losses)."""
    import torch
    from torch._dynamo.utils import counters

    from megatron.model import T5Config, T5Model
    from megatron.model.t5 import compile_blocks
    from megatron.tensor_parallel import model_parallel_seed

    config = T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                      num_decoder_layers=2, num_heads=4, feed_forward_proj="gated-gelu",
                      dropout_rate=dropout_rate)
    model_parallel_seed(0)
    compiled, plain = T5Model(config).train(), T5Model(config).train()
    plain.load_state_dict(compiled.state_dict())
    torch._dynamo.reset()
    counters.clear()
    compile_blocks(compiled)
    enc, dec = torch.randint(0, 128, (2, 12)), torch.randint(0, 128, (2, 7))
    losses = {"compiled": [], "plain": []}
    try:
        for _ in range(3):
            for name, model in (("compiled", compiled), ("plain", plain)):
                loss = model(enc, dec, labels=dec).loss
                loss.backward()
                losses[name].append(loss.item())
        return (list(counters["graph_break"]), counters["stats"]["unique_graphs"],
                losses["compiled"], losses["plain"])
    finally:
        torch._dynamo.reset()


def test_compiled_cpu_blocks_are_whole_graphs():
    """Without dropout each block is one graph (four shapes of block: the first encoder and decoder
    blocks own the relative bias), no break: on the CPU the compiled blocks trace the composed
    attention, not the eager kernel's in-place buffers."""
    breaks, graphs, compiled, plain = _compiled_tiny_model_steps(0.0)
    assert breaks == [] and graphs == 4
    assert compiled == pytest.approx(plain, rel=1e-5)


def test_compiled_cpu_dropout_breaks_only_at_the_rng_fork():
    """With dropout, torch's dropout is traced (the CPU mask's int32 draws are not traceable);
    the only breaks left are the tensor-parallel RNG tracker's state swaps around dropout."""
    breaks, _, _, _ = _compiled_tiny_model_steps(0.1)
    assert breaks and all("get_rng_state" in r or "set_rng_state" in r for r in breaks)

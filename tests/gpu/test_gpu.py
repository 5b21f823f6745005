"""On one CUDA GPU (`make gpu-check`; skipped with "needs CUDA" elsewhere): bf16 and fp16 (loss
scaling) training steps of a small model with ZeRO-1 and ZeRO-3 over NCCL with one rank, fused
Adam; 'flex' attention forward and backward against eager in bf16 (outputs and the bias table's
gradient, 1e-2 relative); the --dry-run memory estimate against torch.cuda.max_memory_allocated."""

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

FIELDS = dict(vocab_size=4200, d_model=256, d_kv=32, d_ff=1024, num_layers=4,
              num_decoder_layers=4, num_heads=8, dropout_rate=0.0,
              feed_forward_proj="gated-gelu", tie_word_embeddings=False)


@pytest.mark.parametrize("precision", ["--bf16", "--fp16"])
@pytest.mark.parametrize("zero", ["1", "3"])
def test_training_steps_on_one_gpu(train_data, precision, zero):
    from harness import run_workers
    from train_workers import base_argv, losses, run_pretrain

    argv = base_argv(train_data, precision, "--zero-stage", zero, "--distributed-backend",
                     "nccl", iters=6)
    [result] = run_workers(1, run_pretrain, [argv], timeout=600)[0]
    got = losses(result)
    assert len(got) == 6 and all(math.isfinite(x) for x in got)
    assert got[-1] < got[0]


def test_fused_adam_matches_torch_adamw():
    from deepspeed.ops.adam import FusedAdam

    torch.manual_seed(0)
    a = torch.nn.Linear(64, 64).cuda()
    b = torch.nn.Linear(64, 64).cuda()
    b.load_state_dict(a.state_dict())
    fused = FusedAdam(a.parameters(), lr=1e-3, weight_decay=0.01, adam_w_mode=True)
    plain = torch.optim.AdamW(b.parameters(), lr=1e-3, weight_decay=0.01)
    for _ in range(5):
        x = torch.randn(8, 64, device="cuda")
        for model, opt in ((a, fused), (b, plain)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("is_decoder", [False, True])
def test_flex_forward_and_backward_match_eager_in_bf16(is_decoder):
    from megatron.model import T5Config, T5Model

    torch.manual_seed(0)
    config = T5Config(**FIELDS)
    eager = T5Model(config, attention_backend="eager").cuda().to(torch.bfloat16)
    flex = T5Model(config, attention_backend="flex").cuda().to(torch.bfloat16)
    flex.load_state_dict(eager.state_dict())
    enc = torch.randint(2, 4000, (4, 256), device="cuda")
    dec = torch.randint(2, 4000, (4, 64), device="cuda")
    mask = torch.ones_like(enc)
    mask[1, 200:] = 0
    outs = []
    for model in (eager, flex):
        out = model(enc, dec, mask, labels=dec)
        out.loss.backward()
        stack = model.decoder if is_decoder else model.encoder
        table = stack.block[0].layer[0].SelfAttention.relative_attention_bias.weight
        outs.append((out.logits.float(), table.grad.float()))
    (la, ga), (lb, gb) = outs
    torch.testing.assert_close(lb, la, rtol=1e-2, atol=1e-2 * la.abs().max().item())
    torch.testing.assert_close(gb, ga, rtol=1e-2, atol=1e-2 * ga.abs().max().item())


def test_dry_run_memory_estimate_against_the_allocator(train_data):
    """The estimate of --dry-run for the run's layout within 25% of the peak the allocator saw
    over a few steps."""
    from harness import run_workers
    from train_workers import base_argv

    argv = base_argv(train_data, "--bf16", "--zero-stage", "1", "--distributed-backend",
                     "nccl", iters=3)
    [(estimate, peak)] = run_workers(1, _estimate_and_peak, argv, timeout=600)
    assert peak == pytest.approx(estimate, rel=0.25)


def _estimate_and_peak(rank, world_size, argv):
    import os

    from megatron import parallel_state
    from megatron.arguments import parse_args
    from megatron.cost.memory import estimate_run
    from megatron.initialize import initialize_distributed
    from megatron.pretrain_t5 import pretrain

    config = parse_args(argv, env=os.environ)
    estimate = estimate_run(config.layout(), "cuda").total
    initialize_distributed(config.runtime, config.parallel)
    torch.cuda.reset_peak_memory_stats()
    try:
        pretrain(config)
    finally:
        parallel_state.destroy_model_parallel()
    return estimate, torch.cuda.max_memory_allocated()

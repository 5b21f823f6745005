"""On one CUDA GPU (`make gpu-check`; skipped with "needs CUDA" elsewhere): bf16 and fp16 (loss
scaling) training steps of a small model with ZeRO-1 and ZeRO-3 over NCCL with one rank against
the same steps in fp32 on the CPU, fused Adam; 'flex' attention forward and backward in bf16
as close to fp32 as eager's (outputs and the bias table's gradient); the --dry-run memory
estimate against torch.cuda.max_memory_allocated on a model whose states and activations, not
DeepSpeed's buckets, make the total."""

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

FIELDS = dict(vocab_size=4200, d_model=256, d_kv=32, d_ff=1024, num_layers=4,
              num_decoder_layers=4, num_heads=8, dropout_rate=0.0,
              feed_forward_proj="gated-gelu", tie_word_embeddings=False)


# A CUDA run in bf16 or fp16 against the same run in fp32 on the CPU: same seed, same weights (drawn
# in fp32 on the CPU, megatron/tensor_parallel/layers.py), same batches. On the CPU a bf16 run's 6
# losses and 4 evaluation losses are within 4.3e-4 of fp32's (measured, AMD EPYC without
# avx512_bf16: the bf16 roundings of weights and activations, 2^-9 relative each, mostly average
# out in the loss). The bound allows 2^-7, one bf16 ulp of the loss, for CUDA's other kernels
# (cuBLAS, fused attention); fp16 (10 bits) is held to the same bound.
BF16_RTOL = 2.0 ** -7
# DeepSpeed's dynamic scaler starts at --initial-loss-scale, 2^32 by default: the scaled
# gradients overflow fp16 (65504) and DeepSpeed skips those steps while it halves the scale, so
# the first steps would not be the fp32 run's. From 2^12 they stay finite (a tiny model's
# gradients are far below 16) and every step applies; the scaler still scales and checks each.
FP16_SCALE = ("--initial-loss-scale", "4096")


def run_on_the_cpu(world_size, target, *args, timeout):
    """run_workers with CUDA hidden from the spawned workers: they pick the CPU and gloo, as on
    a machine without a GPU."""
    from harness import run_workers

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUDA_VISIBLE_DEVICES", "")
        return run_workers(world_size, target, *args, timeout=timeout)


@pytest.fixture(scope="module")
def cpu_fp32(train_data):
    """The 6 steps of the tests below in fp32 on the CPU."""
    from train_workers import base_argv, run_pretrain

    return run_on_the_cpu(1, run_pretrain, [base_argv(train_data, iters=6)], timeout=600)[0][0]


@pytest.mark.parametrize("precision", ["--bf16", "--fp16"])
@pytest.mark.parametrize("zero", ["1", "3"])
def test_training_steps_on_one_gpu(train_data, cpu_fp32, precision, zero):
    from harness import run_workers
    from train_workers import base_argv, losses, run_pretrain

    scale = FP16_SCALE if precision == "--fp16" else ()
    argv = base_argv(train_data, precision, *scale, "--zero-stage", zero,
                     "--distributed-backend", "nccl", iters=6)
    [result] = run_workers(1, run_pretrain, [argv], timeout=600)[0]
    got, want = losses(result), losses(cpu_fp32)
    assert len(got) == 6 and all(math.isfinite(x) for x in got), got
    assert got == pytest.approx(want, rel=BF16_RTOL), f"CUDA {precision} {got}, CPU fp32 {want}"
    assert [e[:2] for e in result["evals"]] == [e[:2] for e in cpu_fp32["evals"]]
    assert [e[2] for e in result["evals"]] == pytest.approx(
        [e[2] for e in cpu_fp32["evals"]], rel=BF16_RTOL)
    assert want[-1] < want[0]  # the reference learns: equal losses are a run that trains


def test_fused_adam_matches_torch_adamw():
    from deepspeed.ops.adam import FusedAdam

    from megatron.deepspeed_internals import deepspeed_op_build_env

    torch.manual_seed(0)
    a = torch.nn.Linear(64, 64).cuda()
    b = torch.nn.Linear(64, 64).cuda()
    b.load_state_dict(a.state_dict())
    with deepspeed_op_build_env():  # H100/H200 images set TORCH_CUDA_ARCH_LIST="...;9.0a"
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
def test_flex_forward_and_backward_are_as_close_to_fp32_as_eager_in_bf16(is_decoder):
    # bf16 against bf16 cannot judge: on an H200 the two backends' logits differed by up to
    # 0.07 (2 bf16 ulps of logits near 5) in 18 of 1.1 M elements, each within its own rounding.
    # So both are measured against the same model in fp32, as FlashAttention's tests do: flex's
    # largest error may be at most twice eager's (plus 1e-3 of the largest value).
    from megatron.model import T5Config, T5Model

    torch.manual_seed(0)
    config = T5Config(**FIELDS)
    reference = T5Model(config, attention_backend="eager").cuda()
    eager = T5Model(config, attention_backend="eager").cuda().to(torch.bfloat16)
    flex = T5Model(config, attention_backend="flex").cuda().to(torch.bfloat16)
    eager.load_state_dict(reference.state_dict())
    flex.load_state_dict(reference.state_dict())
    enc = torch.randint(2, 4000, (4, 256), device="cuda")
    dec = torch.randint(2, 4000, (4, 64), device="cuda")
    mask = torch.ones_like(enc)
    mask[1, 200:] = 0
    outs = []
    for model in (reference, eager, flex):
        out = model(enc, dec, mask, labels=dec)
        out.loss.backward()
        stack = model.decoder if is_decoder else model.encoder
        table = stack.block[0].layer[0].SelfAttention.relative_attention_bias.weight
        outs.append((out.logits.float(), table.grad.float()))
    (logits, grad), (la, ga), (lb, gb) = outs
    for want, by_eager, by_flex in ((logits, la, lb), (grad, ga, gb)):
        eager_error = (by_eager - want).abs().max().item()
        flex_error = (by_flex - want).abs().max().item()
        assert flex_error <= 2 * eager_error + 1e-3 * want.abs().max().item(), (
            flex_error, eager_error)


# A T5-large-like model (d_model 1024, 24 + 24 blocks, gated-gelu: 0.73 B parameters on the
# tiny vocabulary) with 8 x 512 tokens per micro-batch: in bf16 ZeRO-1 the estimate is about
# 10.8 GiB of model states and 6.7 GiB of activations against 0.9 GiB of DeepSpeed's buckets
# (500 M elements), so the comparison judges the model and activation terms, which the tiny
# model left to the buckets (0.93 of its 1.15 GiB).
MEMORY_MODEL = dict(d_model=1024, d_kv=64, d_ff=2816, num_layers=24, num_decoder_layers=24,
                    num_heads=16)
MEMORY_FLAGS = ("--bf16", "--zero-stage", "1", "--encoder-seq-length", "512",
                "--micro-batch-size", "8", "--global-batch-size", "16")


def memory_argv(train_data, folder):
    """The run the memory estimate is judged on: MEMORY_MODEL, 3 steps of MEMORY_FLAGS."""
    import json

    from train_workers import base_argv

    config = json.loads(open(train_data.tiny).read())
    path = folder / "memory_model.json"
    path.write_text(json.dumps({**config, **MEMORY_MODEL}))
    return base_argv(train_data, *MEMORY_FLAGS, "--distributed-backend", "nccl",
                     model=str(path), iters=3)


def memory_estimate(argv):
    """--dry-run's estimate of `argv` on one CUDA device, checked to be one where the model and
    the activations, not the buckets, make the total."""
    import os

    from megatron.arguments import parse_args
    from megatron.cost.memory import estimate_run

    config = parse_args(argv, env={**os.environ, "WORLD_SIZE": "1"})
    estimate = estimate_run(config.layout(), "cuda")
    states = estimate.parameters + estimate.gradients + estimate.optimizer_states
    assert estimate.buffers < 0.1 * estimate.total, estimate.table()
    assert states > 0.4 * estimate.total and estimate.activations > 0.2 * estimate.total, \
        estimate.table()
    return estimate


def test_dry_run_memory_estimate_against_the_allocator(train_data, tmp_path):
    """The estimate of --dry-run for the run's layout within 25% of the peak the allocator saw
    over a few steps, on a model whose states and activations outweigh DeepSpeed's buckets."""
    from harness import run_workers

    argv = memory_argv(train_data, tmp_path)
    estimate = memory_estimate(argv)
    [peak] = run_workers(1, _peak, argv, timeout=600)
    assert peak == pytest.approx(estimate.total, rel=0.25), \
        "\n".join([f"allocator peak {peak / 2 ** 30:.3f} GiB; estimate:", *estimate.table()])


def _peak(rank, world_size, argv):
    import os

    from megatron import parallel_state
    from megatron.arguments import parse_args
    from megatron.initialize import initialize_distributed
    from megatron.pretrain_t5 import pretrain

    config = parse_args(argv, env=os.environ)
    initialize_distributed(config.runtime, config.parallel)
    torch.cuda.reset_peak_memory_stats()
    try:
        pretrain(config)
    finally:
        parallel_state.destroy_model_parallel()
    return torch.cuda.max_memory_allocated()

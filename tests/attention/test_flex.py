"""Attention backend 'flex' (megatron/model/flex.py): T5's relative bias computed inside
FlexAttention from the bucket table, padding and causality in a block mask. Its outputs equal the
eager backend's (fp32, 1e-5) for encoder self-attention (bidirectional buckets), decoder causal
self-attention (unidirectional buckets) and cross-attention, with padding, at TP 1 and 2, through
torch's eager reference (the compiled kernel runs on CUDA only: tests/gpu/test_gpu.py; torch's
compiled CPU kernel drops rows now and then, see flex.COMPILED); training with it on the CPU is
refused before start."""

import sys
from pathlib import Path

import pytest
import torch

from megatron.model import T5Config, T5Model, flex
from megatron.model.flex import FlexBias, flex_core_attention
from megatron.model.state_dict import gather_full_state_dict
from megatron.model.transformer import relative_bias

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from harness import run_workers  # noqa: E402
import flex_workers  # noqa: E402

FIELDS = dict(vocab_size=300, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
              num_heads=4, dropout_rate=0.0, feed_forward_proj="gated-gelu",
              relative_attention_num_buckets=32, relative_attention_max_distance=64,
              tie_word_embeddings=False)


@pytest.fixture
def compiled(monkeypatch):
    """COMPILED as in a run; on the CPU that is torch's eager reference."""
    monkeypatch.setattr(flex, "COMPILED", True)
    return True


def test_the_cpu_runs_the_eager_reference(monkeypatch):
    calls = []
    monkeypatch.setattr(flex, "flex_function", lambda compiled: calls.append(compiled) or (
        lambda q, k, v, **kwargs: q))
    q = torch.zeros(1, 1, 4, 8)
    flex_core_attention(q, q, q, FlexBias(None, False, 0, 0, None, False))
    assert calls == [False]


def batch_with_padding():
    g = torch.Generator().manual_seed(1)
    enc = torch.randint(2, 300, (2, 80), generator=g)
    dec = torch.randint(2, 300, (2, 24), generator=g)
    enc_mask, dec_mask = torch.ones_like(enc), torch.ones_like(dec)
    enc_mask[1, 50:] = 0
    dec_mask[1, 17:] = 0
    return enc, dec, enc_mask, dec_mask


def assert_close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-5,
                               atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("is_decoder", [False, True], ids=["bidirectional", "causal"])
def test_the_kernel_bias_equals_the_materialized_one(compiled, is_decoder):
    """One attention: flex with the table inside the kernel against softmax(q k + bias) v with
    the [heads, q, k] bias and the additive mask built as the eager backend builds them."""
    torch.manual_seed(0)
    config = T5Config(**FIELDS)
    model = T5Model(config, attention_backend="eager")
    stack = model.decoder if is_decoder else model.encoder
    attention = stack.block[0].layer[0].SelfAttention
    q_len = 40
    query, key, value = (torch.randn(2, 4, q_len, 8) for _ in range(3))
    valid = torch.ones(2, q_len, dtype=torch.bool)
    valid[1, 29:] = False
    with torch.no_grad():
        bias = relative_bias(attention.relative_attention_bias, config, is_decoder, q_len, q_len)
        keep = valid[:, None, None, :]
        if is_decoder:
            keep = keep & torch.ones(q_len, q_len, dtype=torch.bool).tril()
        scores = query @ key.transpose(-1, -2) + bias
        scores = scores.masked_fill(~keep, float("-inf"))
        expected = torch.softmax(scores, -1) @ value
        got = flex_core_attention(query, key, value, FlexBias(
            attention.relative_attention_bias.weight.detach(), not is_decoder,
            config.relative_attention_num_buckets, config.relative_attention_max_distance,
            valid, is_decoder))
    assert_close(got, expected)


def test_the_model_with_flex_equals_eager(compiled):
    """Encoder, decoder and cross-attention, with padding in both stacks: the logits."""
    torch.manual_seed(0)
    config = T5Config(**FIELDS)
    eager = T5Model(config, attention_backend="eager").eval()
    with_flex = T5Model(config, attention_backend="flex").eval()
    with_flex.load_state_dict(eager.state_dict())
    batch = batch_with_padding()
    with torch.no_grad():
        assert_close(with_flex(*batch).logits, eager(*batch).logits)


@pytest.mark.slow
@pytest.mark.parametrize("use_compiled", [True])
def test_flex_under_tensor_parallelism_equals_one_eager_process(use_compiled):
    torch.manual_seed(0)
    eager = T5Model(T5Config(**FIELDS), attention_backend="eager").eval()
    full = gather_full_state_dict(eager)
    batch = batch_with_padding()
    with torch.no_grad():
        expected = eager(*batch).logits[..., :FIELDS["vocab_size"]]
    for logits in run_workers(2, flex_workers.flex_logits, FIELDS, full, batch, use_compiled,
                              timeout=600):
        assert_close(logits, expected)


def test_training_with_flex_on_the_cpu_is_refused_naming_the_alternatives(train_data):
    from megatron.arguments import ArgumentsError, parse_args

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
    from train_workers import base_argv

    with pytest.raises(ArgumentsError) as e:
        parse_args(base_argv(train_data, "--attention-backend", "flex"))
    text = str(e.value)
    assert "--attention-backend flex" in text and "eager" in text and "sdpa" in text

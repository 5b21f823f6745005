"""Floating-point operations of a T5 training step, from the encoder-decoder formula.

A multiply-add is 2 FLOPs; backward costs twice the forward, so a training step is 3 forwards
(and one more forward of the blocks when activations are recomputed: that is hardware work, not
model work, and MFU leaves it out). Per sample, with inner = num_heads * d_kv:

    encoder block, per encoder token:  2 * (4 d inner + n_ff d d_ff)  + 2 * 2 * enc_len * inner
    decoder block, per decoder token:  2 * (6 d inner + n_ff d d_ff)  + 2 * 2 * dec_len * inner
                                                                      + 2 * 2 * enc_len * inner
    cross-attention K and V, per encoder token and decoder block:  2 * 2 d inner
    LM head, per decoder token:  2 d vocab

n_ff is 3 for gated feed-forwards and 2 otherwise; "6 d inner" is self-attention's q, k, v, o and
cross-attention's q, o. The score and value products count the full (unmasked) matrices, which is
what the kernels compute. The decoder-only shortcut 6 N (L_in + L_out) charges every parameter to
every token and overcounts T5 about twofold.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.model.config import T5Config


@dataclass(frozen=True)
class StepFlops:
    """model: FLOPs of forward and backward. hardware: plus recomputation, when enabled."""

    model: int
    hardware: int


def forward_flops_per_sample(config: T5Config, enc_len: int, dec_len: int,
                             vocab_size: int) -> dict:
    """Forward FLOPs of one sample, by part: 'encoder', 'decoder', 'cross_kv', 'lm_head'."""
    d, inner, ff = config.d_model, config.inner_dim, config.d_ff
    n_ff = 3 if config.is_gated_act else 2
    encoder_token = 2 * (4 * d * inner + n_ff * d * ff) + 4 * enc_len * inner
    decoder_token = 2 * (6 * d * inner + n_ff * d * ff) + 4 * dec_len * inner + 4 * enc_len * inner
    return {
        "encoder": config.num_layers * enc_len * encoder_token,
        "decoder": config.num_decoder_layers * dec_len * decoder_token,
        "cross_kv": config.num_decoder_layers * enc_len * 4 * d * inner,
        "lm_head": dec_len * 2 * d * vocab_size,
    }


def training_step_flops(config: T5Config, samples: int, enc_len: int, dec_len: int,
                        vocab_size: int, recompute_activations: bool = False) -> StepFlops:
    """FLOPs of one optimizer step over `samples` samples (the global batch).

    Args:
        vocab_size: the size the LM head computes (the padded vocabulary).
        recompute_activations: blocks run their forward a second time in backward.
    """
    parts = forward_flops_per_sample(config, enc_len, dec_len, vocab_size)
    forward = sum(parts.values())
    model = 3 * forward * samples
    blocks = parts["encoder"] + parts["decoder"] + parts["cross_kv"]
    hardware = model + (blocks * samples if recompute_activations else 0)
    return StepFlops(model=model, hardware=hardware)

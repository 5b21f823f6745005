"""Floating-point operations of a T5 training step, from the model's own modules.

Each layer states its forward FLOPs (`forward_flops` of the linears, `query_flops` and
`key_value_flops` of T5Attention, `forward_flops` of a T5Block, `head_flops` of T5Model); this
module sums them over the model built on the meta device (model/meta.py), so a new layer kind is
counted by the layer itself. A multiply-add is 2 FLOPs; backward costs twice the forward, so a
training step is 3 forwards (and one more forward of the blocks when activations are recomputed:
that is hardware work, not model work, and MFU leaves it out). Per sample, with inner =
num_heads * d_kv, the layers' sums come to:

    encoder block, per encoder token:  2 * (4 d inner + n_ff d d_ff)  + 2 * 2 * enc_len * inner
    decoder block, per decoder token:  2 * (6 d inner + n_ff d d_ff)  + 2 * 2 * dec_len * inner
                                                                      + 2 * 2 * enc_len * inner
    cross-attention K and V, per encoder token and decoder block:  2 * 2 d inner
    LM head, per decoder token:  2 d vocab

n_ff is 3 for gated feed-forwards and 2 otherwise; "6 d inner" is self-attention's q, k, v, o and
cross-attention's q, o. The score and value products count the full (unmasked) matrices, which is
what the kernels compute. The decoder-only shortcut 6 N (L_in + L_out) charges every parameter to
every token and overcounts T5 about twofold.

This is the one FLOPs function: the log line's TFLOP/s and MFU, the pipeline's cut, the planner
and the benchmarks all read it.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Dict, Tuple

from megatron.model.config import T5Config
from megatron.model.meta import meta_model
from megatron.model.t5 import head_flops, shared_embedding, untied_lm_head
from megatron.tensor_parallel.group import SINGLE


@dataclass(frozen=True)
class StepFlops:
    """model: FLOPs of forward and backward. hardware: plus recomputation, when enabled."""

    model: int
    hardware: int


def forward_flops_per_sample(config: T5Config, enc_len: int, dec_len: int,
                             vocab_size: int) -> Dict[str, int]:
    """Forward FLOPs of one sample, by part: 'encoder', 'decoder' (without its cross-attention
    K/V projections), 'cross_kv' (those, over encoder tokens) and 'lm_head'.

    vocab_size: the rows the LM head computes (the padded vocabulary).
    """
    return dict(_parts(json.dumps(config.to_dict(), sort_keys=True), enc_len, dec_len,
                       vocab_size))


@functools.lru_cache(maxsize=256)
def _parts(config_json: str, enc_len: int, dec_len: int, vocab_size: int):
    config = T5Config.from_dict(json.loads(config_json))
    model = meta_model(config, 1)  # its blocks are the same at any vocabulary size
    build = shared_embedding if config.tie_word_embeddings else untied_lm_head
    head = build(config, vocab_size, SINGLE, device="meta")  # exactly vocab_size rows
    decoder = model.decoder.block
    return (("encoder", sum(b.forward_flops(enc_len) for b in model.encoder.block)),
            ("decoder", sum(b.forward_flops(dec_len, enc_len, cross_key_value=False)
                            for b in decoder)),
            ("cross_kv", sum(b.layer[1].EncDecAttention.key_value_flops(enc_len)
                             for b in decoder)),
            ("lm_head", head_flops(head, dec_len)))


def block_flops_per_sample(config: T5Config, enc_len: int, dec_len: int
                           ) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """(each encoder block's, each decoder block's forward FLOPs of one sample; a decoder
    block's with its cross-attention K/V projections): a sparse block counts its router and
    the k experts each token runs, so blocks of one stack may differ."""
    return _blocks(json.dumps(config.to_dict(), sort_keys=True), enc_len, dec_len)


@functools.lru_cache(maxsize=64)
def _blocks(config_json: str, enc_len: int, dec_len: int):
    model = meta_model(T5Config.from_dict(json.loads(config_json)), 1)
    return (tuple(b.forward_flops(enc_len) for b in model.encoder.block),
            tuple(b.forward_flops(dec_len, enc_len) for b in model.decoder.block))


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

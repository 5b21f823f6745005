"""T5 attention on FlexAttention (`attention_backend='flex'`): the relative position bias computed
inside the kernel from the [buckets, heads per rank] table, never as a [batch, heads, q, k]
tensor.

- `score_mod` buckets (k - q) inline, with the same arithmetic as `relative_position_bucket`
  (Mesh TensorFlow's: exact small distances, logarithmic up to max_distance, split by sign
  where bidirectional), and adds the table's entry of the query's head.
- A block mask carries the padding (keys whose attention mask is 0) and the decoder's
  causality, so blocks that are wholly masked are skipped; cross-attention has the mask only.
- FlexAttention is compiled on accelerators (`torch.compile(flex_attention)`, once per
  process; the CPU runs torch's eager reference, see COMPILED); a new shape
  class (batch, heads, lengths, head size, dtype, device) or a new score_mod structure compiles
  again: the table and the masks are captured tensors, so new values do not.

Limits (torch 2.13, read in torch/nn/attention/flex_attention.py): no backward on the CPU (the
trainer refuses `flex` training there, naming the backend and the alternatives); no attention
dropout (refused in training with dropout > 0); on CUDA the Triton backend computes the table's
gradient with atomics (not bit-deterministic).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

_MINIMUM = torch.finfo(torch.float32).min


@functools.lru_cache(maxsize=None)
def _compiled():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_function(compiled: bool = True):
    from torch.nn.attention.flex_attention import flex_attention

    return _compiled() if compiled else flex_attention


@dataclass
class FlexBias:
    """What a stack's attention needs instead of a bias tensor: the bucket table (None for
    cross-attention), the bucketing, the keys that are not padding, and causality."""

    table: Optional[torch.Tensor]
    """[buckets, heads per rank], or None (no position bias)."""
    bidirectional: bool
    num_buckets: int
    max_distance: int
    key_valid: Optional[torch.Tensor]
    """bool [batch, keys]: False at padding; None: no padding."""
    causal: bool
    _block_masks: Dict[tuple, object] = field(default_factory=dict, repr=False)
    """Built once per shape and shared by the stack's layers (they all read one FlexBias)."""

    @classmethod
    def padding(cls, additive_mask: Optional[torch.Tensor]) -> "FlexBias":
        """No position bias, only the keys an additive mask hides (cross-attention)."""
        return cls(None, False, 0, 0, key_valid_from_additive(additive_mask), False)

    def score_mod(self):
        if self.table is None:
            return None
        table, bidirectional = self.table, self.bidirectional
        num_buckets, max_distance = self.num_buckets, self.max_distance
        if bidirectional:
            num_buckets //= 2
        max_exact = num_buckets // 2
        log_scale = (num_buckets - max_exact) / math.log(max_distance / max_exact)

        def mod(score, b, h, q_idx, kv_idx):
            relative = kv_idx - q_idx
            if bidirectional:
                offset = (relative > 0).to(torch.int64) * num_buckets
                distance = relative.abs()
            else:
                offset = 0
                distance = -torch.clamp(relative, max=0)
            large = max_exact + (torch.log(distance.float() / max_exact) * log_scale).to(
                torch.int64)
            large = torch.clamp(large, max=num_buckets - 1)
            bucket = offset + torch.where(distance < max_exact, distance, large)
            return score + table[bucket, h].to(score.dtype)
        return mod

    def block_mask(self, batch: int, query_length: int, key_length: int, device):
        key = (batch, query_length, key_length, str(device))
        if key not in self._block_masks:
            self._block_masks[key] = self._build_block_mask(batch, query_length, key_length,
                                                            device)
        return self._block_masks[key]

    def _build_block_mask(self, batch: int, query_length: int, key_length: int, device):
        from torch.nn.attention.flex_attention import create_block_mask

        if self.key_valid is None and not self.causal:
            return None
        valid, causal = self.key_valid, self.causal

        def mask(b, h, q_idx, kv_idx):
            keep = (q_idx >= kv_idx) if causal else (q_idx >= 0)
            if valid is not None:
                keep = keep & valid[b, kv_idx]
            return keep
        return create_block_mask(mask, batch if valid is not None else None, None,
                                 query_length, key_length, device=device)


def key_valid_from_additive(mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """bool [batch, keys] from an additive [batch, 1, q, keys] mask (its last query row sees
    every key a causal row can)."""
    if mask is None:
        return None
    return mask[:, 0, -1, :] == 0


COMPILED = True
"""Run FlexAttention compiled (its fused kernel) on accelerators; False: torch's eager reference
(it builds the scores whole: for tests and debugging only). On the CPU the reference always
runs: torch 2.13's compiled CPU kernel returns rows of zeros now and then for the last batch and
head of a padded batch (seen on an AVX2 host with 40 queries and keys, no score_mod needed;
torch's flex issues report the like), and the CPU runs flex for evaluation only (no backward)."""


def flex_core_attention(query, key, value, bias: FlexBias):
    """softmax(q k^T + relative bias, masked) v over [batch, heads, length, d_kv], unscaled."""
    batch, _, q_len, _ = query.shape
    block_mask = bias.block_mask(batch, q_len, key.shape[2], query.device)
    compiled = COMPILED and query.device.type != "cpu"
    return flex_function(compiled)(query, key, value, score_mod=bias.score_mod(),
                                   block_mask=block_mask, scale=1.0)

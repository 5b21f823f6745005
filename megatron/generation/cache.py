"""The decoding cache and the `step` function the search algorithms call.

The encoder runs once; each decoder block's cross-attention keys and values of its output are
computed once (`T5Model.cross_key_values`); each step runs the decoder on the newest position
only, appending its self-attention keys and values to the block's `LayerCache`
(`T5Model.decode_step`). Rows are hypotheses: a batch, or a batch x beams; beam search reorders
them (`Decoder.reorder`). The model runs with `test_time_routing`: CPM-2-MoE's BASE layers
(router 'cpm2') route greedily while decoding, as at test time in the BASE layers paper
(megatron/model/moe_cpm2.py).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from megatron.model.t5 import T5Model
from megatron.tensor_parallel.mappings import gather_from_tensor_model_parallel_region


class LayerCache:
    """One decoder block's keys and values: self-attention [rows, heads per rank, positions,
    d_kv] (grown one position a step), cross-attention of the encoder output (fixed).

    The self-attention keys and values live in buffers with room for more positions (doubled
    when full), so a step writes its position in place instead of copying all earlier ones
    (`torch.cat`); `key` and `value` are views of the filled positions."""

    def __init__(self, cross: Tuple[torch.Tensor, torch.Tensor]) -> None:
        # contiguous once: the projections come as transposed views, which the attention
        # kernel would otherwise copy at every step (CPU: [rows x heads, enc_len, d_kv] each)
        self.cross = tuple(t.contiguous() for t in cross)
        self._key: Optional[torch.Tensor] = None
        self._value: Optional[torch.Tensor] = None
        self.length = 0

    @property
    def key(self) -> Optional[torch.Tensor]:
        return None if self._key is None else self._key[:, :, :self.length]

    @property
    def value(self) -> Optional[torch.Tensor]:
        return None if self._value is None else self._value[:, :, :self.length]

    @staticmethod
    def _grown(buffer: Optional[torch.Tensor], new: torch.Tensor, filled: int,
               capacity: int) -> torch.Tensor:
        rows, heads, _, d_kv = new.shape
        out = new.new_empty((rows, heads, capacity, d_kv))
        if buffer is not None:
            out[:, :, :filled] = buffer[:, :, :filled]
        return out

    def append(self, key: torch.Tensor, value: torch.Tensor):
        """Add the newest position's keys and values; returns all positions'."""
        start, end = self.length, self.length + key.shape[2]
        if self._key is None or end > self._key.shape[2]:
            capacity = max(2 * end, 32)
            self._key = self._grown(self._key, key, start, capacity)
            self._value = self._grown(self._value, value, start, capacity)
        self._key[:, :, start:end] = key
        self._value[:, :, start:end] = value
        self.length = end
        return self.key, self.value

    def reorder(self, rows: torch.Tensor) -> None:
        """Keep rows `rows` (beam search's surviving hypotheses) of the self-attention cache.
        The cross-attention rows of one input are equal, and rows move only within an input."""
        if self._key is not None:
            self._key = self._key.index_select(0, rows)
            self._value = self._value.index_select(0, rows)


class Decoder:
    """`step(ids) -> logits` over a model: the encoder run once, then one position a step.

    Args:
        model: in evaluation mode; any tensor-parallel size (the logits are gathered, so every
            rank sees the same, full vocabulary).
        encoder_input_ids, encoder_attention_mask: [batch, enc_len].
        expand: rows per input (beams): each input's encoder output repeated `expand` times.
    """

    def __init__(self, model: T5Model, encoder_input_ids: torch.Tensor,
                 encoder_attention_mask: torch.Tensor, expand: int = 1) -> None:
        self.model = model
        self.vocab_size = model.config.vocab_size
        with torch.no_grad():
            encoder_output, mask = model.encode(encoder_input_ids, encoder_attention_mask,
                                                test_time_routing=True)
            if expand > 1:
                encoder_output = encoder_output.repeat_interleave(expand, dim=0)
                mask = mask.repeat_interleave(expand, dim=0)
            self.encoder_mask = mask
            self.layers: List[LayerCache] = [LayerCache(kv) for kv in
                                             model.cross_key_values(encoder_output)]
        self.position = 0

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab_size] (float32, padding of the vocabulary cut) of the token
        after `ids` [rows], the decoder input at the next position."""
        with torch.no_grad():
            logits = self.model.decode_step(ids[:, None], self.position, self.encoder_mask,
                                            self.layers, test_time_routing=True)
            logits = gather_from_tensor_model_parallel_region(logits,
                                                              self.model.tensor_parallel)
        self.position += 1
        return logits[:, 0, :self.vocab_size].float()

    def reorder(self, rows: torch.Tensor) -> None:
        for layer in self.layers:
            layer.reorder(rows)

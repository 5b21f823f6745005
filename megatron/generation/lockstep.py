"""Decoding in lockstep over an expert-parallel group.

Each Mixture-of-Experts layer runs an all-to-all over the expert-parallel group
(megatron/model/moe.py, SparseMLP._exchange), so every rank of the group must run the model
the same number of times, although each decodes its own inputs: one ends its search earlier,
or has one micro-batch fewer. `Lockstep` wraps a `Decoder`: before each real step the ranks
all-reduce how many of them still decode; a rank whose search has returned (`drain`) keeps
feeding dummy steps (its rows, the pad id; the logits discarded) until none does. A rank with
no micro-batch left decodes a dummy one (`dummy_decoder`) and drains at once. Each round is one
all-reduce and then, unless every rank is done, one model step on every rank: the rounds match.
`decode` is the one call every user of the decoder makes (generate.py, fine-tuning's validation).
"""

from __future__ import annotations

from typing import List, Tuple

import torch
import torch.distributed as dist

from megatron.generation.cache import Decoder
from megatron.generation.pipeline import decoder_for
from megatron.generation.search import Hypothesis, search
from megatron.generation.settings import DecodingSettings, SpecialTokens


class Lockstep:
    """`step` and `reorder` of `decoder`, in lockstep over `group` (None: no other rank)."""

    def __init__(self, decoder: Decoder, group, pad_id: int) -> None:
        self.decoder, self.group, self.pad_id = decoder, group, pad_id
        self.vocab_size = decoder.vocab_size

    def _others_decode(self, mine: bool) -> bool:
        """All-reduce this rank's flag; True while any rank of the group still decodes."""
        device = self.decoder.encoder_mask.device
        flag = torch.tensor([int(mine)], dtype=torch.long, device=device)
        dist.all_reduce(flag, group=self.group)
        return bool(flag.item())

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            self._others_decode(True)
        return self.decoder.step(ids)

    def reorder(self, rows: torch.Tensor) -> None:
        self.decoder.reorder(rows)

    def drain(self) -> None:
        """After this rank's search: dummy steps while any rank of the group decodes."""
        if self.group is None:
            return
        rows = self.decoder.encoder_mask.shape[0]
        ids = torch.full((rows,), self.pad_id, dtype=torch.long,
                         device=self.decoder.encoder_mask.device)
        while self._others_decode(False):
            self.decoder.step(ids)


def padded(rows: List[List[int]], pad_id: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) [len(rows), longest] on `device`: the rows padded on the right
    with `pad_id` (the encoder input `decode` takes; a decoder input likewise)."""
    length = max(len(row) for row in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, :len(row)] = 1
    return ids.to(device), mask.to(device)


def dummy_decoder(model, token_id: int, device) -> Decoder:
    """A one-row, one-token input's decoder (its encoder run: the encoder's all-to-alls), for a
    rank with no micro-batch left in a round (a `PipelineDecoder` over a pipeline stage: every
    stage of the pipeline group has none left in the same round)."""
    ids = torch.full((1, 1), token_id, dtype=torch.long, device=device)
    return decoder_for(model, ids, torch.ones_like(ids))


def decode(model, encoder_input_ids: torch.Tensor, encoder_attention_mask: torch.Tensor,
           tokens: SpecialTokens, settings: DecodingSettings, group=None,
           stop=None) -> List[Hypothesis]:
    """One `Hypothesis` per row of the encoder input [batch, enc_len] (on the model's device):
    the search `settings` asks for on `model` (a T5Model, or this rank's PipelineStage: every
    rank of its pipeline calls this with the same input), in lockstep over the expert-parallel
    `group` (None: no other rank); `stop`: search.py's (every rank of a pipeline ends the same
    rows: it must decide from the ids alone)."""
    expand = settings.num_beams
    decoder = Lockstep(decoder_for(model, encoder_input_ids, encoder_attention_mask, expand),
                       group, tokens.pad)
    found = search(decoder, encoder_input_ids.shape[0], tokens, settings,
                   device=encoder_input_ids.device, stop=stop)
    decoder.drain()
    return found

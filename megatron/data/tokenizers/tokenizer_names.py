"""The names the rest of the code reads from a tokenizer, whichever type it is (SentencePiece,
megatron/data/tokenizers/tokenizer.py; CPM-2's word pieces, megatron/data/tokenizers/cpm2_tokenizer.py): Megatron's and
Hugging Face's spellings of the special ids, computed once here for both."""

from __future__ import annotations

from typing import Iterable, List

import numpy as np


class TokenizerNames:
    """The names the rest of the code reads from either tokenizer type (Megatron's and Hugging
    Face's spellings). A subclass sets `vocab_size`, `eos_id`, `pad_id`, `sentinel_ids` and
    defines `decoder_start_token_id`."""

    vocab_size: int
    eos_id: int
    pad_id: int
    sentinel_ids: List[int]

    @property
    def eod(self) -> int:
        """End-of-document id (Megatron's name): the eos."""
        return self.eos_id

    eod_id = eos = eod

    @property
    def pad(self) -> int:
        """Megatron's name for the pad id."""
        return self.pad_id

    @property
    def additional_special_tokens_ids(self) -> List[int]:
        """Sentinel ids in order (Megatron/HF name)."""
        return list(self.sentinel_ids)

    @property
    def token_dtype(self) -> type:
        """Smallest numpy dtype for token ids (Megatron's rule: uint16 below 65500, else int32)."""
        return np.uint16 if self.vocab_size < 65500 else np.int32

    def __len__(self) -> int:
        return self.vocab_size

    def sentinel_id(self, i: int) -> int:
        """Id of sentinel `i` (`<extra_id_i>`, CPM-2's `<s_i>`)."""
        if not 0 <= i < len(self.sentinel_ids):
            raise IndexError(f"sentinel index {i} out of range [0, {len(self.sentinel_ids)})")
        return self.sentinel_ids[i]

    def checked_ids(self, ids: Iterable[int]) -> List[int]:
        """`ids` (a list, a numpy array, ...) as Python ints, each in [0, vocab_size).

        Raises:
            ValueError: naming the first id outside."""
        if isinstance(ids, np.ndarray):
            ids = ids.tolist()
        ids = [int(i) for i in ids]
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} out of range [0, {self.vocab_size})")
        return ids


def pad_id_of(tokenizer) -> int:
    """The id that pads a batch's rows and the rows decoding has finished, and that decoded
    text leaves out: the tokenizer's pad (both tokenizer types have one: `TokenizerNames`); for
    a tokenizer without one, the decoder's start id, which T5 pads with. Decoding
    (megatron/generation/settings.py SpecialTokens, used by generate and fine-tuning's
    validation) and fine-tuning's metrics (megatron/training/finetune_metrics.py) take it from
    here."""
    return getattr(tokenizer, "pad_id", tokenizer.decoder_start_token_id)

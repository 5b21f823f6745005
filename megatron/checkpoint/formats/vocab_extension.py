"""`convert_checkpoint.py --extend-vocab NEW`: a checkpoint grown to an extended vocabulary
(CPM-2's bilingual stage; megatron/data/tokenizers/extend.py makes the vocabulary).

A transform on the stream of full, unpadded tensors that `--to megatron` writes, before any
resharding, so the result loads in any TP x PP x EP x DP and ZeRO stage. The vocabulary tensors
(`shared.weight`, and `lm_head.weight` when the head is untied) get one row per id of the new
vocabulary, taken from the old row `row_sources` names: an old token keeps its row under its new
id (a T5 sentinel moves up with its id), a new token starts from its longest old prefix or from a
seeded random old token. Rows the old model had beyond its tokenizer (a config vocab_size larger
than the tokenizer's, as Google's T5 has) stay, after the new vocabulary. Every other tensor
passes through unchanged.

Optimizer states (Adam's moments), where the conversion carries them: the old tokens' rows are
kept (moved with their ids) and the new tokens' rows are zero, i.e. fresh. The step count is the
run's, so Adam's bias correction is ~1 for the new rows: their first updates are larger than a
fresh optimizer's would be (about 3x the learning rate for Adam's default betas) until their
second moment builds up.
"""

from __future__ import annotations

from typing import Dict, Iterable, Iterator, Optional, Tuple

import torch

from megatron.checkpoint.formats.weights import VOCAB_PARAMETERS
from megatron.data.tokenizers.extend import RowPlan, VocabularyExtensionError

SPECIAL_ID_FIELDS = ("pad_token_id", "eos_token_id", "decoder_start_token_id")


def _index(plan: RowPlan, rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(source row per new row, mask of the rows that are new tokens) for a tensor of `rows`
    rows: the plan, then the rows the old model had beyond its tokenizer."""
    extra = list(range(plan.old_size, rows))
    source = torch.tensor(list(plan.source) + extra, dtype=torch.long)
    fresh = torch.tensor([kind != "old" for kind in plan.kind] + [False] * len(extra))
    return source, fresh


def _check_rows(name: str, tensor: torch.Tensor, plan: RowPlan) -> None:
    if tensor.dim() != 2 or tensor.shape[0] < plan.old_size:
        raise VocabularyExtensionError(
            f"{name} has shape {tuple(tensor.shape)}, fewer rows than the old tokenizer's "
            f"{plan.old_size} ids: the old tokenizer is not the checkpoint's (give the run's with "
            "--tokenizer-model)")


def extended_tensors(tensors: Iterable[Tuple[str, torch.Tensor]], plan: RowPlan,
                     zero_new_rows: bool = False) -> Iterator[Tuple[str, torch.Tensor]]:
    """`tensors` with the vocabulary tensors grown to the plan's vocabulary; with
    `zero_new_rows` (optimizer states) the new tokens' rows are zero instead of copies."""
    for name, tensor in tensors:
        if name in VOCAB_PARAMETERS:
            _check_rows(name, tensor, plan)
            source, fresh = _index(plan, tensor.shape[0])
            tensor = tensor.index_select(0, source)
            if zero_new_rows:
                tensor[fresh] = 0
        yield name, tensor


def extended_config(config: Dict, plan: RowPlan) -> Dict:
    """The model config (a dict) for the extended vocabulary: vocab_size grown by the rows
    added, the special token ids moved with their tokens.

    Raises:
        VocabularyExtensionError: the config has fewer ids than the old tokenizer, or a special
            id that is not an old token.
    """
    old_rows = int(config["vocab_size"])
    if old_rows < plan.old_size:
        raise VocabularyExtensionError(
            f"the checkpoint's vocab_size {old_rows} is smaller than the old tokenizer's "
            f"{plan.old_size} ids: the old tokenizer is not the checkpoint's")
    moved = plan.new_id()
    out = dict(config, vocab_size=plan.new_size + old_rows - plan.old_size)
    for field in SPECIAL_ID_FIELDS:
        value = config.get(field)
        if value is None:
            continue
        if value >= plan.old_size:  # beyond the tokenizer: one of the rows kept at the end
            out[field] = value - plan.old_size + plan.new_size
        elif value in moved:
            out[field] = moved[value]
    return out


def adds_nothing(plan: RowPlan, new_name: str = "", old_name: str = "") -> Optional[str]:
    """Why extending with `plan` is refused: the new vocabulary adds no piece (row_sources has
    checked that every old piece is in it, so one of the same size is the same set), as a
    message naming both tokenizers; None when it adds pieces. Refused rather than warned:
    growing the vocabulary is --extend-vocab's only purpose, so this is the wrong file (most
    often the old tokenizer itself), and a checkpoint marked as extended that adds nothing
    would hide that until the next stage's loss."""
    if plan.new_size != plan.old_size:
        return None
    return (f"--extend-vocab {new_name} adds no piece to the checkpoint's tokenizer {old_name} "
            f"(both have the same {plan.old_size} pieces): give the extended vocabulary "
            f"(data_tools/train_tokenizer.py --extend), or leave --extend-vocab out to convert "
            f"the checkpoint as it is")


def summary(plan: RowPlan) -> Dict[str, int]:
    """How many rows of each kind (old, prefix, random) the plan has."""
    counts = {"old": 0, "prefix": 0, "random": 0}
    for kind in plan.kind:
        counts[kind] += 1
    return counts

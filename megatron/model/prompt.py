"""Prompt tuning (CPM-2-Finetune's `--prompt-tune`): trainable vectors in the encoder's input.

A `PromptEncoder` holds `length` vectors of d_model in an embedding of its own, replicated on the
tensor-parallel ranks (like a layer norm: every rank sees the whole encoder input). The encoder
input gets them at the slots of a `PromptLayout`: CPM-2-Finetune's `ratio_list`, the share of the
prompt at each slot, the slots spread evenly over the text (one: front; two: front, back; three:
front, middle, back). As there, a prompt position carries the placeholder id -(k + 1) for vector
k, and the embedding puts vector k where the id is negative, the word embedding elsewhere.

Everything else of the model is frozen (`freeze_all_but_prompt`); the checkpoint keeps the prompt
and the identity of the base model it was trained on (`base_identity`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

PROMPT_PARAMETER = "prompt.weight"
"""The prompt's name in the model's state dict (T5Model.prompt)."""


@dataclass(frozen=True)
class PromptLayout:
    """How many prompt vectors go to which slot.

    length: prompt vectors in all.
    ratios: the share of `length` at each slot, in order (CPM-2-Finetune's ratio_list, e.g.
        (0.33, 0.34, 0.33)); slot boundaries are int(cumulative share x length), the last slot
        takes what is left, as there.
    """

    length: int
    ratios: Tuple[float, ...] = (1.0,)

    def counts(self) -> List[int]:
        """Prompt vectors per slot."""
        bounds, total = [0], 0.0
        for ratio in self.ratios[:-1]:
            total += ratio
            bounds.append(min(int(total * self.length), self.length))
        bounds.append(self.length)
        return [b - a for a, b in zip(bounds, bounds[1:])]

    def slot_of_each(self) -> List[int]:
        """[length]: the slot of each prompt vector."""
        return [slot for slot, count in enumerate(self.counts()) for _ in range(count)]


def layout_problems(length: int, ratios: Sequence[float]) -> List[str]:
    """What is wrong with a prompt length and its slot shares (flag names in the messages)."""
    problems = []
    if length < 1:
        problems.append(f"--prompt-length {length}: must be at least 1")
    if not ratios:
        problems.append("--prompt-positions: give at least one share")
    elif any(r < 0 for r in ratios) or abs(sum(ratios) - 1.0) > 1e-6:
        problems.append(f"--prompt-positions {','.join(f'{r:g}' for r in ratios)}: the shares of "
                        f"the prompt at each slot (front ... back) must be 0 or more and add up "
                        f"to 1, e.g. 1 (all in front) or 0.33,0.34,0.33 (front, middle, back)")
    return problems


def place_prompt(ids: torch.Tensor, keep: torch.Tensor, layout: PromptLayout
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reserve the prompt's positions in a right-padded encoder input.

    ids: [batch, len] token ids; keep: [batch, len] bool, True on the text (not padding).
    Slot s of S sits before token s * n // (S - 1) of a text of n tokens (after the last one
    for the back slot); the prompt vectors of a slot keep their order.
    Returns (ids [batch, len + length] with -(k + 1) at prompt vector k's position, keep
    [batch, len + length], True on the text and on the prompt).
    """
    batch, seq = ids.shape
    device, slots = ids.device, len(layout.ratios)
    n = keep.sum(dim=1)  # [batch]
    slot = torch.tensor(layout.slot_of_each(), dtype=torch.long, device=device)  # [P]
    before = (slot[None, :] * n[:, None]) // max(slots - 1, 1)  # [batch, P]
    k = torch.arange(layout.length, device=device)
    prompt_at = before + k[None, :]  # [batch, P]
    t = torch.arange(seq, device=device)
    token_at = t[None, :] + (before[:, None, :] <= t[None, :, None]).sum(-1)  # [batch, len]
    out_ids = ids.new_zeros(batch, seq + layout.length)
    out_ids.scatter_(1, token_at, ids)
    out_ids.scatter_(1, prompt_at, (-(k + 1)).expand(batch, -1).to(ids.dtype))
    out_keep = keep.new_zeros(batch, seq + layout.length)
    out_keep.scatter_(1, token_at, keep)
    out_keep.scatter_(1, prompt_at, torch.ones_like(prompt_at, dtype=keep.dtype))
    return out_ids, out_keep


class PromptEncoder(nn.Module):
    """The prompt's vectors ([length, d_model], replicated on tensor-parallel ranks) and where
    they go (`layout`).

    forward(ids, words): [batch, len, d_model], the prompt vector -(id + 1) where an id is
    negative, `words(id)` (the shared, vocabulary-parallel embedding) elsewhere, bit for bit.
    """

    def __init__(self, layout: PromptLayout, d_model: int, device=None, dtype=None) -> None:
        super().__init__()
        self.layout = layout
        self.weight = nn.Parameter(torch.empty(layout.length, d_model, device=device,
                                               dtype=dtype))
        if self.weight.device.type != "meta":  # drawn on the CPU, as tensor_parallel's layers
            with torch.no_grad():
                self.weight.copy_(torch.randn(self.weight.shape).to(self.weight.dtype))

        # a base model's checkpoint has no prompt: loading it keeps this one
        self.register_load_state_dict_pre_hook(_keep_when_absent)

    def forward(self, ids: torch.Tensor, words: nn.Module) -> torch.Tensor:
        is_prompt = ids < 0
        embedded = words(ids.clamp(min=0))
        vectors = self.weight[(-ids - 1).clamp(min=0)].to(embedded.dtype)
        return torch.where(is_prompt[..., None], vectors, embedded)

    @torch.no_grad()
    def init_from_token(self, token_id: int, words: nn.Module) -> None:
        """Every vector set to the embedding of `token_id` (collective over tensor-parallel
        ranks: the vocabulary-parallel embedding sums its shards)."""
        ids = torch.full((1, self.layout.length), token_id, dtype=torch.long,
                         device=self.weight.device)
        self.weight.copy_(words(ids)[0].to(self.weight.dtype))

    @torch.no_grad()
    def init_random(self, generator: Optional[torch.Generator] = None, std: float = 1.0) -> None:
        """Every vector drawn from N(0, std^2) (the same on every rank for the same generator)."""
        values = torch.randn(self.weight.shape, generator=generator) * std
        self.weight.copy_(values.to(self.weight.device, self.weight.dtype))


def _keep_when_absent(module, state_dict, prefix, *args) -> None:
    state_dict.setdefault(prefix + "weight", module.weight.detach())


def attach_prompt(model: nn.Module, layout: PromptLayout) -> PromptEncoder:
    """Give a T5Model a prompt (as `model.prompt`); its encoder input gets the vectors."""
    first = next(model.parameters())
    model.prompt = PromptEncoder(layout, model.config.d_model, device=first.device,
                                 dtype=first.dtype)
    return model.prompt


def freeze_all_but_prompt(model: nn.Module) -> List[str]:
    """requires_grad False on every parameter but the prompt's (so the optimizer, ZeRO's
    partitions and the gradients leave them out); returns the frozen names."""
    frozen = []
    for name, param in model.named_parameters():
        if name != PROMPT_PARAMETER:
            param.requires_grad_(False)
            frozen.append(name)
    return frozen


def tensors_digest(tensors: Iterable[Tuple[str, torch.Tensor]]) -> str:
    """The digest that names a prompt's base model: SHA-256 over each tensor's name, shape,
    dtype and bytes, in any order (one tensor at a time: each is hashed on its own, then the
    sorted per-tensor digests), the prompt left out. The same function for a model in memory
    (`base_identity`) and for a checkpoint's full tensors (megatron/checkpoint/io/prompt.py's
    `checkpoint_digest`)."""
    each = {}
    for name, tensor in tensors:
        if name == PROMPT_PARAMETER:
            continue
        one = hashlib.sha256(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        one.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
                   .tobytes())
        each[name] = one.hexdigest()
    whole = hashlib.sha256()
    for name in sorted(each):
        whole.update(f"{name}={each[name]};".encode())
    return whole.hexdigest()


def base_identity(model: nn.Module, load: Optional[str], iteration: Optional[int]) -> Dict:
    """What identifies the frozen model a prompt is trained on: where it was loaded from, its
    iteration, and `tensors_digest` of its state (this rank's shards: for a model not loaded
    from a checkpoint; a loaded one is identified by its checkpoint's full tensors,
    megatron/training/prompt_tuning.py's `loaded_base_identity`)."""
    return {"load": load, "iteration": iteration,
            "digest": tensors_digest(model.state_dict().items())}


def base_mismatch(saved: Dict, now: Dict, prompt_path: str) -> Optional[str]:
    """The refusal, naming both bases, when a prompt saved on base `saved` is loaded onto
    `now` (None: the same base)."""
    if saved.get("digest") == now.get("digest") and saved.get("of") == now.get("of"):
        return None
    older = "" if saved.get("of") == now.get("of") else \
        " (its digest is of another kind, saved before digests covered the whole checkpoint: " \
        "train it again to use it)"
    return (f"{prompt_path}: this prompt was trained on the model of {saved.get('load')} "
            f"iteration {saved.get('iteration')} (digest {str(saved.get('digest'))[:12]}), "
            f"not on {now.get('load')} iteration {now.get('iteration')} (digest "
            f"{str(now.get('digest'))[:12]}){older}: load the prompt onto its own base model")

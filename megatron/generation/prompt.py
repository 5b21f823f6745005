"""Decoding with a tuned prompt (megatron/generate.py): the prompt of a prompt-tuning run's
--save on its base model (`--load BASE --prompt-load P`, refused on another base), or the
prompt a second stage (--prompt-train-model) saved with its model (`--load M`). Its layout
(length, slots) comes from the checkpoint that holds it (what meta.json records it is:
megatron/checkpoint/formats/meta.py's `kind_of`); the prompt and its base's digest are read by
megatron/checkpoint/io/prompt.py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

import torch

from megatron.checkpoint.formats.meta import kind_of
from megatron.model.prompt import PromptLayout, base_mismatch


class PromptLoadError(ValueError):
    """A prompt that cannot decode with this --load; the message names the flags."""


@dataclass(frozen=True)
class GenerationPrompt:
    """layout: where the vectors go. weight: [length, d_model] from --prompt-load; None where
    the checkpoint of --load holds the prompt with the model."""

    layout: PromptLayout
    weight: Optional[torch.Tensor] = None


def generation_prompt(load: str, folder: Path, meta: Dict,
                      prompt_load: Optional[str]) -> Optional[GenerationPrompt]:
    """The prompt to decode with (None: none).

    load, folder, meta: --load as given, its iteration folder and meta.json.
    prompt_load: --prompt-load, a prompt-tuning run's --save (its latest checkpoint).
    Raises:
        PromptLoadError: --load holds a prompt alone, or a prompt of its own and --prompt-load
            gives another; --prompt-load holds no prompt, or one trained on another base (the
            message names both)."""
    from megatron.checkpoint.formats.deepspeed import CheckpointReadError, find_iteration, \
        read_meta
    from megatron.checkpoint.io.checkpointing import CheckpointError
    from megatron.checkpoint.io.prompt import DIGEST_OF, checkpoint_digest, read_prompt

    kind = kind_of(meta, folder / "meta.json")
    if kind.prompt_alone:
        base = kind.prompt_base
        raise PromptLoadError(f"--load {load} holds a prompt alone (a --prompt-tune run's "
                              f"checkpoint): decode with its base model and the prompt: "
                              f"--load {base.get('load')} --prompt-load {load}")
    own = kind.prompt_layout
    if prompt_load is None:
        return None if own is None else GenerationPrompt(own)
    if own is not None:
        raise PromptLoadError(f"--prompt-load {prompt_load}: --load {load} holds a prompt of "
                              f"its own (a --prompt-train-model checkpoint): decode with it "
                              f"alone (no --prompt-load)")
    try:
        weight, saved = read_prompt(Path(prompt_load))
        layout = kind_of(read_meta(find_iteration(Path(prompt_load)))).prompt_layout
        now = {"load": load, "iteration": meta.get("iteration"),
               "digest": checkpoint_digest(folder), "of": DIGEST_OF}
    except (CheckpointError, CheckpointReadError) as e:
        raise PromptLoadError(str(e)) from None
    problem = base_mismatch(saved, now, f"--prompt-load {prompt_load}")
    if problem is not None:
        raise PromptLoadError(problem)
    return GenerationPrompt(layout, weight)


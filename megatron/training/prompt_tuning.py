"""Prompt tuning in a training run: the prompt attached and the model frozen before the engine
sees them (so the optimizer, its states and ZeRO's partitions hold the prompt alone), the
prompt started from a token's embedding once the base model is loaded, a saved prompt read back
onto the base it was trained on and no other."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional

import torch
import torch.distributed as dist

from megatron.checkpoint.io.checkpointing import CheckpointError
from megatron.config.prompt_args import DEFAULT_TOKENS, RANDOM, PromptSettings
from megatron.model.prompt import (PROMPT_PARAMETER, attach_prompt, base_identity,
                                   base_mismatch, freeze_all_but_prompt)
from megatron.tensor_parallel.random import init_rng
from megatron.training import deepspeed_internals

META_KEY = "prompt_base"
"""meta.json's record of the base model a saved prompt was trained on."""


def prepare_model(model: torch.nn.Module, settings: PromptSettings) -> None:
    """Attach the prompt (random, the same on every rank) and, unless the model is trained too,
    freeze everything else."""
    with init_rng("prompt"):
        attach_prompt(model, settings.layout)
    if not settings.train_model:
        freeze_all_but_prompt(model)


def init_token_id(settings: PromptSettings, tokenizer) -> Optional[int]:
    """The id whose embedding starts the prompt (None: random).

    Raises:
        ValueError: the piece is not in the vocabulary."""
    if settings.init_token == RANDOM:
        return None
    vocab = tokenizer.vocab
    pieces = DEFAULT_TOKENS if settings.init_token is None else (settings.init_token,)
    for piece in pieces:
        if piece in vocab:
            return vocab[piece]
    raise ValueError(f"--prompt-init-token {pieces[0]}: not in the tokenizer's vocabulary; "
                     f"give one of its pieces, or 'random'")


def start_prompt(engine, settings: PromptSettings, token_id: Optional[int],
                 load: Optional[str], iteration: Optional[int],
                 loaded_prompt: bool = False) -> Dict:
    """After the base model is loaded: the prompt from `prompt_load` (a prompt-tuning run's
    --save), kept as loaded (`loaded_prompt`: --load held the model and a prompt, a second
    stage's checkpoint) or from the token's embedding; returns the base's identity (for
    meta.json).

    Raises:
        CheckpointError: `prompt_load` holds no prompt, or one trained on another base."""
    module = engine.module
    identity = base_identity(module, load, iteration)
    prompt_load = settings.load
    if prompt_load is not None:
        weight, saved = read_prompt(Path(prompt_load))
        problem = [base_mismatch(saved, identity, prompt_load) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(problem, src=0)
        if problem[0] is not None:
            raise CheckpointError(problem[0])
        with torch.no_grad():
            module.prompt.weight.copy_(weight.to(module.prompt.weight))
    elif token_id is not None and not loaded_prompt:
        module.prompt.init_from_token(token_id, module.shared)
    deepspeed_internals.refresh_masters(engine.optimizer)
    return identity


def read_prompt(root: Path):
    """(the prompt [length, d_model], the identity of its base) of a prompt-tuning checkpoint,
    read as every checkpoint of ours is (megatron/checkpoint/formats: the tracker's iteration,
    meta.json, the model file with its allowed globals only).

    Raises:
        CheckpointError: no checkpoint, or one without a prompt."""
    from megatron.checkpoint.formats.deepspeed import (CheckpointReadError, find_iteration,
                                                       read_meta)
    from megatron.checkpoint.formats.deepspeed_files import load_file

    try:
        folder = find_iteration(root)
        saved = read_meta(folder).get("model", {}).get(META_KEY)
        if saved is None:
            raise CheckpointError(f"--prompt-load {folder}: not a prompt-tuning checkpoint (no "
                                  f"model.{META_KEY} in meta.json)")
        module = load_file(folder / "mp_rank_00_model_states.pt")["module"]
    except CheckpointReadError as e:
        raise CheckpointError(f"--prompt-load {root}: {e}") from None
    return module[PROMPT_PARAMETER], saved

"""Prompt tuning in a training run: the prompt attached and the model frozen before the engine
sees them (so the optimizer, its states and ZeRO's partitions hold the prompt alone), the
prompt started from a token's embedding once the base model is loaded, a saved prompt read back
onto the base it was trained on and no other (the base known by the digest of its checkpoint's
full tensors, whatever the layout: megatron/checkpoint/io/prompt.py reads the prompt and the
digest), a requeued run's prompt left to the resume from --save."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional

import torch
import torch.distributed as dist

from megatron import deepspeed_internals
from megatron.checkpoint.io.checkpointing import CheckpointError
from megatron.checkpoint.io.prompt import DIGEST_OF, checkpoint_digest, read_prompt
from megatron.checkpoint.io.remote_tools import Staged, download_checkpoint
from megatron.config.training import CheckpointStorage
from megatron.data.storage.object_storage import is_remote
from megatron.config.prompt_args import DEFAULT_TOKENS, RANDOM, PromptSettings
from megatron.model.prompt import (attach_prompt, base_identity, base_mismatch,
                                   freeze_all_but_prompt)
from megatron.tensor_parallel.random import init_rng


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
                 loaded_prompt: bool = False, resume: Optional[tuple] = None,
                 storage: CheckpointStorage = CheckpointStorage()) -> Dict:
    """After the base model is loaded: the prompt from `prompt_load` (a prompt-tuning run's
    --save), kept as loaded (`loaded_prompt`: --load held the model and a prompt, a second
    stage's checkpoint) or from the token's embedding; returns the base's identity (for
    meta.json).

    resume: (--save, the base identity its checkpoint records) when the run resumes from
        --save's checkpoint next: the prompt is left to that load, the bases must agree.
    storage: how an s3:// --load or --prompt-load is read (downloaded: remote_tools.py).
    Raises:
        CheckpointError: `prompt_load` holds no prompt, or one trained on another base; the
            checkpoint to resume from was trained on another base."""
    module = engine.module
    identity = loaded_base_identity(module, load, iteration, storage)
    if resume is not None:
        save, saved = resume
        _refuse_unless_same_base(saved, identity, f"--save {save}")
        return identity
    prompt_load = settings.load
    if prompt_load is not None:
        weight, saved = _read_prompt(prompt_load, storage)
        _refuse_unless_same_base(saved, identity, prompt_load)
        with torch.no_grad():
            module.prompt.weight.copy_(weight.to(module.prompt.weight))
    elif token_id is not None and not loaded_prompt:
        module.prompt.init_from_token(token_id, module.shared)
    deepspeed_internals.refresh_masters(engine.optimizer)
    return identity


def _read_prompt(prompt_load: str, storage: CheckpointStorage):
    """read_prompt of --prompt-load; an s3:// one downloaded first (its model file and
    meta.json), into a staging folder removed after.

    Raises:
        CheckpointError: as read_prompt; the download failed (naming the key)."""
    if not is_remote(prompt_load):
        return read_prompt(Path(prompt_load))
    from megatron.checkpoint.io.completeness import needed

    try:
        with Staged() as staged:
            return read_prompt(download_checkpoint(
                prompt_load, storage, root=staged.folder(storage, prompt_load, "download"),
                needed=lambda name: needed(name, False, False)))
    except OSError as e:
        raise CheckpointError(f"--prompt-load {prompt_load}: {e}") from None


def _refuse_unless_same_base(saved: Dict, identity: Dict, prompt_path: str) -> None:
    """Rank 0's verdict, on every rank (a model from scratch is digested shard by shard)."""
    problem = [base_mismatch(saved, identity, prompt_path) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        raise CheckpointError(problem[0])


def loaded_base_identity(module: torch.nn.Module, load: Optional[str],
                         iteration: Optional[int],
                         storage: CheckpointStorage = CheckpointStorage()) -> Dict:
    """The identity of the base model just loaded from --load (base_identity's keys): the digest
    of its checkpoint's full tensors (`checkpoint_digest`, on rank 0, sent to every rank); of the
    model in memory (this rank's shards: a model from scratch) where --load holds none. An
    s3:// --load's model files are downloaded for it on rank 0 (`storage`), then removed.

    Raises:
        CheckpointError: --load's files cannot be read."""
    from megatron.checkpoint.formats.deepspeed import CheckpointReadError, find_iteration

    from megatron.checkpoint.io.completeness import needed

    if load is None or iteration is None:
        return base_identity(module, load, iteration)
    found = [None]  # (digest, None) or (None, the problem)
    if dist.get_rank() == 0:
        try:
            with Staged() as staged:
                root = Path(load) if not is_remote(load) else download_checkpoint(
                    load, storage, iteration, staged.folder(storage, load, "download"),
                    lambda name: needed(name, True, False))
                found[0] = (checkpoint_digest(find_iteration(root, iteration)), None)
        except (CheckpointReadError, OSError) as e:
            found[0] = (None, f"--load {load}: {e}")
    dist.broadcast_object_list(found, src=0)
    digest, problem = found[0]
    if problem is not None:
        raise CheckpointError(problem)
    return {"load": load, "iteration": iteration, "digest": digest, "of": DIGEST_OF}

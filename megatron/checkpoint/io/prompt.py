"""A tuned prompt in our checkpoints: meta.json's record of the base model a prompt was trained
on, the digest that names that base (its checkpoint's full tensors, whatever the layout), the
prompt read back (--prompt-load), and the checks of the prompt flags against the checkpoints a
run reads (--load, --prompt-load, a requeued job's --save), found before anything starts.

The readers of the training run (megatron/training/prompt_tuning.py), of generation
(megatron/generation/prompt.py) and of validation (megatron/arguments.py) share this module;
megatron/config/prompt_args.py keeps the flags themselves and reads no file."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Mapping, Optional, Set, Tuple

from megatron.checkpoint.formats.deepspeed_files import CheckpointReadError
from megatron.checkpoint.formats.meta import CheckpointKind, kind_of, read_meta
from megatron.checkpoint.io.checkpointing import CheckpointError, read_tracker, tag_for
from megatron.config.prompt_args import parse_shares
from megatron.model.prompt import PROMPT_PARAMETER, PromptLayout, tensors_digest

DIGEST_OF = "checkpoint full tensors"
"""The `of` of a base identity whose digest is `checkpoint_digest`'s (without it: the digest of
rank 0's shard in memory, as saved before; such a prompt is refused on its base)."""


def checkpoint_digest(folder: Path) -> str:
    """SHA-256 of the model in a checkpoint's iteration folder, as full tensors (names, shapes,
    dtypes, values; a prompt saved with the model left out) read from its files, one at a time
    (megatron/checkpoint/formats): the same at whatever tensor-parallel size or ZeRO stage the
    checkpoint was saved, or the model is loaded. The fp32 masters where the checkpoint has
    named ones, as generation loads them.

    Raises:
        CheckpointReadError: the files cannot be read."""
    from megatron.checkpoint.formats.deepspeed import iter_full_tensors, model_source

    return tensors_digest(iter_full_tensors(folder, model_source(read_meta(folder))))


def read_prompt(root: Path):
    """(the prompt [length, d_model], the identity of its base) of a prompt-tuning checkpoint,
    read as every checkpoint of ours is (megatron/checkpoint/formats: the tracker's iteration,
    meta.json, the model file with its allowed globals only).

    Raises:
        CheckpointError: no checkpoint, or one without a prompt."""
    from megatron.checkpoint.formats.deepspeed import find_iteration
    from megatron.checkpoint.formats.deepspeed_files import load_file

    try:
        folder = find_iteration(root)
        saved = kind_of(read_meta(folder), folder / "meta.json").prompt_base
        if saved is None:
            raise CheckpointError(f"--prompt-load {folder}: not a prompt-tuning checkpoint (no "
                                  f"model.prompt_base in meta.json)")
        module = load_file(folder / "mp_rank_00_model_states.pt")["module"]
    except CheckpointReadError as e:
        raise CheckpointError(f"--prompt-load {root}: {e}") from None
    return module[PROMPT_PARAMETER], saved


def prompt_checkpoint(folder: Optional[str]) -> Optional[CheckpointKind]:
    """What `folder`'s latest checkpoint is when it is a prompt-tuning run's (a prompt, alone
    or with the model), else None (no folder, no checkpoint, another kind)."""
    root = Path(folder) if folder else None
    try:
        iteration = read_tracker(root) if root is not None and root.is_dir() else None
        if iteration is None:
            return None
        kind = kind_of(read_meta(root / tag_for(iteration)))
    # a damaged checkpoint is reported by the load's checks: a tracker naming no iteration
    # (CheckpointError), a meta.json missing or unreadable (CheckpointReadError, a ValueError),
    # a folder that cannot be read (OSError)
    except (CheckpointError, OSError, ValueError):
        return None
    return kind if kind.prompt is not None else None


def remote_prompt_checkpoint(values: Mapping[str, object], url: str
                             ) -> Optional[CheckpointKind]:
    """prompt_checkpoint of an s3:// folder (its tracker and meta.json read there, with the
    --object-storage-* settings of `values`).

    Raises:
        ObjectStorageError: refused credentials, no such bucket (naming the key)."""
    import json

    from megatron.checkpoint.io.remote import RemoteFolder
    from megatron.config.checkpoint_storage import checkpoint_storage_from_args

    folder = RemoteFolder(url, checkpoint_storage_from_args(values)[0])
    try:
        iteration = folder.read_tracker()
        text = None if iteration is None else folder.get_text(f"{tag_for(iteration)}/meta.json")
        kind = None if text is None else kind_of(json.loads(text))
    except ValueError:  # a garbled tracker or meta.json: not a prompt checkpoint to read
        return None
    return kind if kind is not None and kind.prompt is not None else None


def holds_prompt_alone(folder) -> bool:
    """Whether an iteration folder holds a prompt alone (False where its meta.json cannot be
    read)."""
    try:
        return kind_of(read_meta(folder)).prompt_alone
    except (OSError, ValueError):
        return False


def prompt_only_checkpoint(load: Optional[str]) -> Optional[dict]:
    """The base identity (meta.json's prompt base) when --load's latest checkpoint holds a
    prompt alone (a run with --prompt-tune and a frozen model), else None."""
    kind = prompt_checkpoint(load)
    return kind.prompt_base if kind is not None and kind.prompt_alone else None


def resumes_prompt_run(values: Mapping[str, object]) -> Optional[CheckpointKind]:
    """What --save's latest checkpoint is when this --prompt-tune run resumes from it (a
    requeued job: --save holds a prompt-tuning checkpoint and is not --load, which a normal
    resume reads), else None."""
    save, load = values.get("save"), values.get("load")
    if not values.get("prompt_tune") or save is None:
        return None
    if load is not None and Path(load).resolve() == Path(save).resolve():
        return None
    return prompt_checkpoint(save)


def prompt_checkpoint_problems(values: Mapping[str, object]) -> List[str]:
    """What the checkpoints a run reads refuse in its prompt flags (`vars(namespace)`): a --load
    that holds a prompt alone; a --save to resume from that holds the other stage's checkpoint.
    At most one problem: the flags' own (config/prompt_args.py's prompt_problems) are checked
    only where this finds none."""
    base = prompt_only_checkpoint(values.get("load"))
    if base is not None:
        return [f"--load {values['load']} holds a prompt alone (a --prompt-tune run's "
                f"checkpoint): load its base model and the prompt with --load {base['load']} "
                f"--finetune --prompt-tune --prompt-load {values['load']}"]
    resumed = resumes_prompt_run(values)
    if resumed is not None and (not resumed.prompt_alone) != bool(values["prompt_train_model"]):
        kind = {True: "the model and a prompt (--prompt-train-model)",
                False: "a prompt alone"}
        return [f"--save {values['save']} holds a checkpoint of "
                f"{kind[not values['prompt_train_model']]}; this run trains "
                f"{kind[bool(values['prompt_train_model'])]} and would resume from it: give "
                f"another --save"]
    return []


def _shown(ratios: Tuple[float, ...]) -> str:
    return ",".join(f"{r:g}" for r in ratios)


def prompt_layout_from_checkpoints(values: Mapping[str, object], given: Set[str]
                                   ) -> Tuple[Dict[str, object], List[str]]:
    """The prompt's layout where a checkpoint decides it, before start: (the flags' values it
    sets, the problems). With --prompt-load, the loaded prompt's length (and, not given, its
    positions) come from that checkpoint, as megatron.generate takes them; a --prompt-length
    given otherwise is refused. A resume (a requeued job's --save, or a --load without
    --finetune holding a prompt with its model) must go on with the saved length and positions:
    not given, they are taken; given otherwise, refused, each naming the flag and the saved
    value."""
    if not values.get("prompt_tune"):
        return {}, []
    taken: Dict[str, object] = {}
    problems: List[str] = []
    source = values.get("prompt_load")
    if source is not None and "://" in str(source) and not str(source).startswith("s3://"):
        source = None  # refused by its scheme
    if source is not None:
        try:
            kind = remote_prompt_checkpoint(values, str(source)) if \
                str(source).startswith("s3://") else prompt_checkpoint(str(source))
        except OSError as e:  # the server's refusal, naming the key
            return {}, [f"--prompt-load {source}: {e}"]
        if kind is None:
            return {}, [f"--prompt-load {source} holds no prompt-tuning checkpoint: give the "
                        f"--save of a --prompt-tune run"]
        _take(kind.prompt_layout, values, given, f"--prompt-load {source} holds a "
              f"prompt tuned with", taken, problems, positions_fixed=False)
    resumed, where = resumes_prompt_run(values), f"--save {values.get('save')}, requeued"
    if resumed is None and values.get("load") is not None and not values.get("finetune"):
        resumed, where = prompt_checkpoint(str(values["load"])), f"--load {values['load']}"
        if resumed is not None and resumed.prompt_alone:
            resumed = None  # refused as such by prompt_checkpoint_problems
    if resumed is not None:
        _take(resumed.prompt_layout, values, given, f"the checkpoint this run resumes "
              f"({where}) was tuned with", taken, problems, positions_fixed=True)
    return taken, problems


def _take(saved: PromptLayout, values: Mapping[str, object], given: Set[str], said: str,
          taken: Dict[str, object], problems: List[str], positions_fixed: bool) -> None:
    """Fill `taken` with the saved layout's values not given; a problem for each given value
    that contradicts it (the positions only when `positions_fixed`)."""
    if "prompt_length" not in given:
        taken["prompt_length"] = saved.length
    elif int(values["prompt_length"]) != saved.length:
        problems.append(f"--prompt-length {values['prompt_length']}: {said} --prompt-length "
                        f"{saved.length}: give {saved.length} (or leave the flag out)")
    shares, _ = parse_shares(str(values["prompt_positions"]))
    if "prompt_positions" not in given:
        taken["prompt_positions"] = _shown(saved.ratios)
    elif positions_fixed and shares and tuple(shares) != tuple(saved.ratios):
        problems.append(f"--prompt-positions {values['prompt_positions']}: {said} "
                        f"--prompt-positions {_shown(saved.ratios)}: give "
                        f"{_shown(saved.ratios)} (or leave the flag out)")

"""Prompt tuning's flags (megatron/model/prompt.py has the prompt): their definitions, their
problems, and the typed `PromptSettings` they give. CPM-2-Finetune's `--prompt-tune
--prompt-config FILE` JSON (enc.prompt_len, enc.ratio_list, enc.default_init_token, fix_model)
becomes flags here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Set, Tuple

from megatron.model.prompt import PromptLayout, layout_problems

RANDOM = "random"
DEFAULT_TOKENS = ("<mask>", "<extra_id_0>")
"""Without --prompt-init-token: CPM-2's `<mask>` (their default_init_token) where the vocabulary
has it, else T5's first sentinel, the piece SentencePiece T5 vocabularies mask spans with."""


@dataclass(frozen=True)
class PromptSettings:
    """layout: the prompt's length and its share at each slot (front ... back).
    init_token: the piece whose embedding every vector starts from (None: the defaults above,
        in order), or 'random'.
    train_model: also train the model (CPM-2-Finetune's fix_model false: the second stage, from
        a prompt-tuned checkpoint)."""

    layout: PromptLayout
    init_token: Optional[str] = None
    train_model: bool = False
    load: Optional[str] = None
    """--prompt-load: a prompt-tuning run's --save to start the prompt from."""


def add_prompt_args(parser) -> None:
    """The flags, in a group of their own."""
    g = parser.add_argument_group("prompt tuning")
    g.add_argument("--prompt-tune", action="store_true",
                   help="train a prompt only: --prompt-length vectors in the encoder input, "
                        "every model parameter frozen (no gradients, no optimizer states); "
                        "load the base model with --load BASE --finetune")
    g.add_argument("--prompt-length", type=int, default=100, metavar="N",
                   help="prompt vectors (default 100, CPM-2-Finetune's prompt_len; with "
                        "--prompt-load or on a resume, the checkpoint's)")
    g.add_argument("--prompt-positions", default="1", metavar="SHARES",
                   help="the share of the prompt at each slot, comma-separated, slots spread "
                        "evenly from the text's front to its back (CPM-2-Finetune's "
                        "ratio_list): 1 (default: all in front), 0.5,0.5 (front, back), "
                        "0.33,0.34,0.33 (front, middle, back); with --prompt-load or on a "
                        "resume, default: the checkpoint's")
    g.add_argument("--prompt-init-token", default=None, metavar="PIECE",
                   help="start every vector at this piece's embedding in the loaded model, or "
                        "'random' (default: <mask> where the vocabulary has it, as CPM-2, "
                        "else <extra_id_0>)")
    g.add_argument("--prompt-load", default=None, metavar="DIR",
                   help="start from the prompt of a prompt-tuning run's --save (its latest "
                        "checkpoint), refused unless --load is the base it was trained on")
    g.add_argument("--prompt-train-model", action="store_true",
                   help="with --prompt-tune: train the model too, the prompt with it (the "
                        "second stage of CPM-2-Finetune's two-stage tuning: --load BASE "
                        "--finetune --prompt-load the first stage's --save)")


def _shares(text: str) -> Tuple[Tuple[float, ...], List[str]]:
    try:
        return tuple(float(x) for x in text.split(",")), []
    except ValueError:
        return (), [f"--prompt-positions {text}: give comma-separated numbers, e.g. "
                    f"0.33,0.34,0.33"]


def prompt_checkpoint(folder: Optional[str]) -> Optional[dict]:
    """meta.json of `folder`'s latest checkpoint when it is a prompt-tuning run's (its
    model.prompt_base set), else None (no folder, no checkpoint, another kind)."""
    from pathlib import Path

    from megatron.checkpoint.io.checkpointing import read_meta, read_tracker

    root = Path(folder) if folder else None
    try:
        iteration = read_tracker(root) if root is not None and root.is_dir() else None
        if iteration is None:
            return None
        meta = read_meta(root, iteration)
    except Exception:  # noqa: BLE001 - a damaged checkpoint is reported by the load's checks
        return None
    return meta if meta.get("model", {}).get("prompt_base") is not None else None


def prompt_alone(meta: Mapping) -> bool:
    """Whether the checkpoint of this meta.json holds a prompt alone (a --prompt-tune run's,
    the model frozen), not the model (with or without a prompt)."""
    flags = meta.get("flags", {})
    return meta.get("model", {}).get("prompt_base") is not None \
        and bool(flags.get("prompt_tune")) and not flags.get("prompt_train_model")


def saved_prompt_layout(meta: Mapping) -> Optional[PromptLayout]:
    """The layout of the prompt a prompt-tuning checkpoint was trained with (meta.json's
    model.prompt_layout, or, saved before that was recorded, its flags); None for a checkpoint
    of no prompt-tuning run."""
    model = meta.get("model", {})
    if model.get("prompt_base") is None:
        return None
    saved = model.get("prompt_layout")
    if saved is not None:
        return PromptLayout(int(saved["length"]), tuple(float(r) for r in saved["ratios"]))
    flags = meta.get("flags", {})
    shares, _ = _shares(str(flags.get("prompt_positions", "1")))
    return PromptLayout(int(flags.get("prompt_length", 100)), shares)


def holds_prompt_alone(folder) -> bool:
    """prompt_alone for an iteration folder (False where its meta.json cannot be read)."""
    import json
    from pathlib import Path

    try:
        return prompt_alone(json.loads((Path(folder) / "meta.json").read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return False


def prompt_only_checkpoint(load: Optional[str]) -> Optional[dict]:
    """The base identity (meta.json's model.prompt_base) when --load's latest checkpoint holds
    a prompt alone (a run with --prompt-tune and a frozen model), else None."""
    meta = prompt_checkpoint(load)
    return meta["model"]["prompt_base"] if meta is not None and prompt_alone(meta) else None


def resumes_prompt_run(values: Mapping[str, object]) -> Optional[dict]:
    """meta.json of --save's latest checkpoint when this --prompt-tune run resumes from it (a
    requeued job: --save holds a prompt-tuning checkpoint and is not --load, which a normal
    resume reads), else None."""
    from pathlib import Path

    save, load = values.get("save"), values.get("load")
    if not values.get("prompt_tune") or save is None:
        return None
    if load is not None and Path(load).resolve() == Path(save).resolve():
        return None
    return prompt_checkpoint(save)


def prompt_problems(values: Mapping[str, object],
                    given: Optional[Set[str]] = None) -> List[str]:
    """The prompt flags (`vars(namespace)`): ranges and combinations; a --load that holds a
    prompt alone; a --save to resume from that holds the other stage's checkpoint. `given`:
    the flags the command line set (None: those that differ from their defaults)."""
    base = prompt_only_checkpoint(values.get("load"))
    if base is not None:
        return [f"--load {values['load']} holds a prompt alone (a --prompt-tune run's "
                f"checkpoint): load its base model and the prompt with --load {base['load']} "
                f"--finetune --prompt-tune --prompt-load {values['load']}"]
    resumed = resumes_prompt_run(values)
    if resumed is not None and bool(resumed.get("flags", {}).get("prompt_train_model")) != \
            bool(values["prompt_train_model"]):
        kind = {True: "the model and a prompt (--prompt-train-model)",
                False: "a prompt alone"}
        return [f"--save {values['save']} holds a checkpoint of "
                f"{kind[not values['prompt_train_model']]}; this run trains "
                f"{kind[bool(values['prompt_train_model'])]} and would resume from it: give "
                f"another --save"]
    if not values["prompt_tune"]:
        flags = (("prompt_length", 100), ("prompt_positions", "1"), ("prompt_init_token", None),
                 ("prompt_load", None), ("prompt_train_model", False))
        return [f"--{f.replace('_', '-')} has effect only with --prompt-tune" for f, default
                in flags if (f in given if given is not None else values[f] != default)]
    shares, problems = _shares(str(values["prompt_positions"]))
    if not problems:
        problems += layout_problems(int(values["prompt_length"]), shares)
    if values.get("pipeline_model_parallel_size", 1) not in (None, 1):
        problems.append("--prompt-tune needs --pipeline-model-parallel-size 1")
    if values.get("zero_stage") == 3:
        problems.append("--prompt-tune does not work with ZeRO stage 3 (the frozen model needs "
                        "no partitioning: use stage 1 or 2, which partition the prompt's "
                        "optimizer states)")
    return problems


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
    if source is not None and "://" not in str(source):  # (a URL: refused by its scheme)
        meta = prompt_checkpoint(str(source))
        if meta is None:
            return {}, [f"--prompt-load {source} holds no prompt-tuning checkpoint: give the "
                        f"--save of a --prompt-tune run"]
        _take(saved_prompt_layout(meta), values, given, f"--prompt-load {source} holds a "
              f"prompt tuned with", taken, problems, positions_fixed=False)
    resumed, where = resumes_prompt_run(values), f"--save {values.get('save')}, requeued"
    if resumed is None and values.get("load") is not None and not values.get("finetune"):
        resumed, where = prompt_checkpoint(str(values["load"])), f"--load {values['load']}"
        if resumed is not None and prompt_alone(resumed):
            resumed = None  # refused as such by prompt_problems
    if resumed is not None and saved_prompt_layout(resumed) is not None:
        _take(saved_prompt_layout(resumed), values, given, f"the checkpoint this run resumes "
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
    shares, _ = _shares(str(values["prompt_positions"]))
    if "prompt_positions" not in given:
        taken["prompt_positions"] = _shown(saved.ratios)
    elif positions_fixed and shares and tuple(shares) != tuple(saved.ratios):
        problems.append(f"--prompt-positions {values['prompt_positions']}: {said} "
                        f"--prompt-positions {_shown(saved.ratios)}: give "
                        f"{_shown(saved.ratios)} (or leave the flag out)")


def prompt_settings(values: Mapping[str, object]) -> Optional[PromptSettings]:
    """The settings from validated flags (None without --prompt-tune)."""
    if not values.get("prompt_tune"):
        return None
    shares, _ = _shares(str(values["prompt_positions"]))
    return PromptSettings(PromptLayout(int(values["prompt_length"]), shares),
                          values["prompt_init_token"], bool(values["prompt_train_model"]),
                          values["prompt_load"])

"""Prompt tuning's flags (megatron/model/prompt.py has the prompt): their definitions, their
problems, and the typed `PromptSettings` they give. CPM-2-Finetune's `--prompt-tune
--prompt-config FILE` JSON (enc.prompt_len, enc.ratio_list, enc.default_init_token, fix_model)
becomes flags here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Mapping, Optional, Tuple

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
                   help="prompt vectors (default 100, CPM-2-Finetune's prompt_len)")
    g.add_argument("--prompt-positions", default="1", metavar="SHARES",
                   help="the share of the prompt at each slot, comma-separated, slots spread "
                        "evenly from the text's front to its back (CPM-2-Finetune's "
                        "ratio_list): 1 (default: all in front), 0.5,0.5 (front, back), "
                        "0.33,0.34,0.33 (front, middle, back)")
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


def prompt_only_checkpoint(load: Optional[str]) -> Optional[dict]:
    """The base identity (meta.json's model.prompt_base) when --load's latest checkpoint holds
    a prompt alone (a run with --prompt-tune and a frozen model), else None."""
    from pathlib import Path

    from megatron.checkpoint.io.checkpointing import read_meta, read_tracker

    root = Path(load) if load else None
    iteration = read_tracker(root) if root is not None and root.is_dir() else None
    if iteration is None:
        return None
    try:
        meta = read_meta(root, iteration)
    except Exception:  # noqa: BLE001 - a damaged checkpoint is reported by the load's checks
        return None
    flags = meta.get("flags", {})
    base = meta.get("model", {}).get("prompt_base")
    if base is None or not flags.get("prompt_tune") or flags.get("prompt_train_model"):
        return None
    return base


def prompt_problems(values: Mapping[str, object]) -> List[str]:
    """The prompt flags (`vars(namespace)`): ranges and combinations; a --load that holds a
    prompt alone."""
    base = prompt_only_checkpoint(values.get("load"))
    if base is not None:
        return [f"--load {values['load']} holds a prompt alone (a --prompt-tune run's "
                f"checkpoint): load its base model and the prompt with --load {base['load']} "
                f"--finetune --prompt-tune --prompt-load {values['load']}"]
    if not values["prompt_tune"]:
        given = [f for f, default in (("prompt_length", 100), ("prompt_positions", "1"),
                                      ("prompt_init_token", None), ("prompt_load", None),
                                      ("prompt_train_model", False))
                 if values[f] != default]
        return [f"--{f.replace('_', '-')} has effect only with --prompt-tune" for f in given]
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


def prompt_settings(values: Mapping[str, object]) -> Optional[PromptSettings]:
    """The settings from validated flags (None without --prompt-tune)."""
    if not values.get("prompt_tune"):
        return None
    shares, _ = _shares(str(values["prompt_positions"]))
    return PromptSettings(PromptLayout(int(values["prompt_length"]), shares),
                          values["prompt_init_token"], bool(values["prompt_train_model"]),
                          values["prompt_load"])

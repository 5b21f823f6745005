"""Prompt tuning's flags (megatron/model/prompt.py has the prompt): their definitions, their
problems, and the typed `PromptSettings` they give. CPM-2-Finetune's `--prompt-tune
--prompt-config FILE` JSON (enc.prompt_len, enc.ratio_list, enc.default_init_token, fix_model)
becomes flags here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Mapping, Optional, Set, Tuple

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
                        "checkpoint; a folder or s3://BUCKET/PREFIX), refused unless --load is "
                        "the base it was trained on")
    g.add_argument("--prompt-train-model", action="store_true",
                   help="with --prompt-tune: train the model too, the prompt with it (the "
                        "second stage of CPM-2-Finetune's two-stage tuning: --load BASE "
                        "--finetune --prompt-load the first stage's --save)")


def parse_shares(text: str) -> Tuple[Tuple[float, ...], List[str]]:
    """(the shares of a --prompt-positions value, its problem: none, or one naming the flag)."""
    try:
        return tuple(float(x) for x in text.split(",")), []
    except ValueError:
        return (), [f"--prompt-positions {text}: give comma-separated numbers, e.g. "
                    f"0.33,0.34,0.33"]


def prompt_problems(values: Mapping[str, object],
                    given: Optional[Set[str]] = None) -> List[str]:
    """The prompt flags (`vars(namespace)`): ranges and combinations. `given`: the flags the
    command line set (None: those that differ from their defaults). What the checkpoints a run
    reads refuse in them is megatron/checkpoint/io/prompt.py's (`prompt_checkpoint_problems`):
    this module reads no file."""
    if not values["prompt_tune"]:
        flags = (("prompt_length", 100), ("prompt_positions", "1"), ("prompt_init_token", None),
                 ("prompt_load", None), ("prompt_train_model", False))
        return [f"--{f.replace('_', '-')} has effect only with --prompt-tune" for f, default
                in flags if (f in given if given is not None else values[f] != default)]
    shares, problems = parse_shares(str(values["prompt_positions"]))
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
    shares, _ = parse_shares(str(values["prompt_positions"]))
    return PromptSettings(PromptLayout(int(values["prompt_length"]), shares),
                          values["prompt_init_token"], bool(values["prompt_train_model"]),
                          values["prompt_load"])

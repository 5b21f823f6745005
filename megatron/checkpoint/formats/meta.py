"""meta.json, the record of an iteration folder of ours (written by the trainer's saver,
megatron/checkpoint/io/saver.py, and by the weights writer, formats/weights.py): its one reader
(`read_meta`), its one writer (`write_meta`) and one error type (CheckpointReadError).

What a checkpoint is, as typed fields (`CheckpointKind`, meta.json's "checkpoint" section): a
tuned prompt alone or with the model, the prompt's layout, the base model the prompt was
trained on, the router type. Checkpoints saved before that section was written are read by
`kind_of` from what they recorded then (the run's flags and model.prompt_base /
model.prompt_layout): the one place that reads a checkpoint's flags to learn what it is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Union

from megatron.checkpoint.formats.deepspeed_files import CheckpointReadError
from megatron.checkpoint.layout import DEEPSPEED_LATEST
from megatron.config.prompt_args import parse_shares
from megatron.model.config import ConfigError, T5Config
from megatron.model.prompt import PromptLayout

META = "meta.json"
KIND_KEY = "checkpoint"
"""meta.json's section with the typed record of what the checkpoint is (`CheckpointKind`)."""
PROMPT_ALONE, PROMPT_WITH_MODEL = "alone", "with_model"
"""CheckpointKind.prompt: a prompt alone (a --prompt-tune run's, the model frozen: its files
hold no model), or a prompt trained with the model (--prompt-train-model)."""

PathLike = Union[str, Path]


@dataclass(frozen=True)
class CheckpointKind:
    """What a checkpoint holds (meta.json's "checkpoint" section).

    prompt: None (no tuned prompt), PROMPT_ALONE or PROMPT_WITH_MODEL.
    prompt_layout: the prompt's length and slots (set with `prompt`).
    prompt_base: the identity of the base model the prompt was trained on ({"load",
        "iteration", "digest", "of"}: megatron/checkpoint/io/prompt.py; set with `prompt`).
    router_type: the Mixture-of-Experts router of the model (None: a dense model).
    """

    prompt: Optional[str] = None
    prompt_layout: Optional[PromptLayout] = None
    prompt_base: Optional[Dict[str, Any]] = None
    router_type: Optional[str] = None

    @property
    def prompt_alone(self) -> bool:
        """The checkpoint holds a prompt alone, not the model (its files hold no model)."""
        return self.prompt == PROMPT_ALONE

    def to_dict(self) -> Dict[str, Any]:
        layout = None if self.prompt_layout is None else \
            {"length": self.prompt_layout.length, "ratios": list(self.prompt_layout.ratios)}
        return {"prompt": self.prompt, "prompt_layout": layout, "prompt_base": self.prompt_base,
                "router_type": self.router_type}

    @classmethod
    def from_dict(cls, record: Any, where: PathLike = META) -> "CheckpointKind":
        """The kind meta.json's "checkpoint" section records.

        Raises:
            CheckpointReadError: naming the file and the field that is malformed."""
        def bad(field: str, why: str) -> CheckpointReadError:
            return CheckpointReadError(f"{where} ({KIND_KEY}.{field}): {why}; the checkpoint's "
                                       f"record is damaged")

        if not isinstance(record, dict):
            raise CheckpointReadError(f"{where} ({KIND_KEY}): expected a JSON object")
        unknown = sorted(set(record) - set(cls().to_dict()))
        if unknown:
            raise bad(unknown[0], "an unknown field (written by a newer version?)")
        prompt = record.get("prompt")
        if prompt not in (None, PROMPT_ALONE, PROMPT_WITH_MODEL):
            raise bad("prompt", f"{prompt!r} is not null, {PROMPT_ALONE!r} or "
                                f"{PROMPT_WITH_MODEL!r}")
        layout = record.get("prompt_layout")
        try:
            layout = None if layout is None else PromptLayout(
                int(layout["length"]), tuple(float(r) for r in layout["ratios"]))
        except (TypeError, KeyError, ValueError):
            raise bad("prompt_layout", f"{layout!r} is not {{\"length\": N, \"ratios\": "
                                       f"[...]}}") from None
        base = record.get("prompt_base")
        if base is not None and not isinstance(base, dict):
            raise bad("prompt_base", f"{base!r} is not a JSON object")
        if (prompt is None) != (layout is None) or (prompt is None) != (base is None):
            raise bad("prompt", "prompt, prompt_layout and prompt_base are set together")
        router = record.get("router_type")
        if router is not None and not isinstance(router, str):
            raise bad("router_type", f"{router!r} is not a string")
        return cls(prompt, layout, base, router)


def kind_of(meta: Mapping[str, Any], where: PathLike = META) -> CheckpointKind:
    """What the checkpoint of this meta.json holds: its "checkpoint" section, or, for a
    checkpoint saved before that was written, what it recorded then (the base in
    model.prompt_base; the layout in model.prompt_layout or, saved before that, the
    --prompt-length / --prompt-positions flags; a prompt alone where its run had --prompt-tune
    without --prompt-train-model).

    Raises:
        CheckpointReadError: a malformed "checkpoint" section."""
    if KIND_KEY in meta:
        return CheckpointKind.from_dict(meta[KIND_KEY], where)
    model = meta.get("model") or {}
    flags = meta.get("flags") or {}
    config = model.get("config") if isinstance(model.get("config"), dict) else {}
    router = config.get("router_type", T5Config.router_type) \
        if config.get("num_experts") else None
    base = model.get("prompt_base")
    if base is None:
        return CheckpointKind(router_type=router)
    saved = model.get("prompt_layout")
    try:
        if saved is not None:
            layout = PromptLayout(int(saved["length"]), tuple(float(r) for r in saved["ratios"]))
        else:
            shares, _ = parse_shares(str(flags.get("prompt_positions", "1")))
            layout = PromptLayout(int(flags.get("prompt_length", 100)), shares)
    except (TypeError, KeyError, ValueError):
        raise CheckpointReadError(f"{where} (model.prompt_layout): {saved!r} is not "
                                  f"{{\"length\": N, \"ratios\": [...]}}; the checkpoint's "
                                  f"record is damaged") from None
    alone = bool(flags.get("prompt_tune")) and not flags.get("prompt_train_model")
    return CheckpointKind(PROMPT_ALONE if alone else PROMPT_WITH_MODEL, layout, base, router)


def foreign_hint(folder: Path) -> str:
    """What another tool's folder looks like, as a hint ('' when nothing is recognised)."""
    if (folder / "config.json").is_file() and any(
            (folder / n).is_file() for n in ("model.safetensors", "model.safetensors.index.json",
                                             "pytorch_model.bin")):
        return "; it looks like a Hugging Face model folder (convert it with --from hf)"
    if (folder / DEEPSPEED_LATEST).is_file():
        return ("; it has DeepSpeed's 'latest' file only: saved by DeepSpeed directly, not by "
                "this trainer")
    if any(folder.glob("*/model_optim_rng.pt")) or any(folder.glob("*/*/model_optim_rng.pt")):
        return "; it looks like a Megatron-LM checkpoint (model_optim_rng.pt), not this trainer's"
    return ""


def read_meta(iter_dir: PathLike) -> Dict[str, Any]:
    """The iteration folder's meta.json (its "checkpoint" section checked: read it with
    `kind_of`).

    Raises:
        CheckpointReadError: missing, not JSON, not written by our trainer (no layout), or a
            malformed "checkpoint" section.
    """
    folder = Path(iter_dir)
    path = folder / META
    if not path.is_file():
        raise CheckpointReadError(f"{path}: missing, so {folder} is not an iteration folder "
                                  f"written by our trainer{foreign_hint(folder)}")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointReadError(f"{path}: unreadable ({e}); the checkpoint is damaged") \
            from None
    if not is_weights_format(meta):
        layout = meta.get("layout") if isinstance(meta, dict) else None
        keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                "data_parallel_size", "zero_stage")
        if not isinstance(layout, dict) or not all(isinstance(layout.get(k), int) for k in keys):
            raise CheckpointReadError(f"{path}: no 'layout' with {', '.join(keys)}: not the "
                                      f"meta.json of a checkpoint written by our trainer")
    kind_of(meta, path)
    return meta


def _write_text(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")


def write_meta(iter_dir: PathLike, meta: Mapping[str, Any],
               kind: Optional[CheckpointKind] = None,
               write: Callable[[Path, str], None] = _write_text) -> None:
    """Write the iteration folder's meta.json: `meta` with `kind` as its "checkpoint" section
    (and, for the readers of earlier versions, a prompt's base and layout as
    model.prompt_base / model.prompt_layout). `write(path, text)`: how (an atomic, fsynced
    write for the trainer's saves)."""
    record = dict(meta)
    if kind is not None:
        record[KIND_KEY] = kind.to_dict()
        if kind.prompt is not None:
            record["model"] = {**(record.get("model") or {}), "prompt_base": kind.prompt_base,
                               "prompt_layout": kind.to_dict()["prompt_layout"]}
    write(Path(iter_dir) / META, json.dumps(record, indent=1, sort_keys=True))


def model_config(meta: Mapping[str, Any], where: PathLike = META) -> T5Config:
    """The architecture meta.json records ('model.config'); `where` names the file in errors.

    Raises:
        CheckpointReadError: no 'model' section (a checkpoint written before meta.json recorded
            the model), or a config that is not a T5 architecture.
    """
    model = meta.get("model")
    if not isinstance(model, dict) or "config" not in model:
        flags = meta.get("flags") or {}
        raise CheckpointReadError(
            f"{where}: no 'model' section: this checkpoint was written before meta.json "
            f"recorded the model, so its architecture is unknown here. Its run used "
            f"--model-config {flags.get('model_config')} and --make-vocab-size-divisible-by "
            f"{flags.get('make_vocab_size_divisible_by')}; add to meta.json "
            f"\"model\": {{\"config\": <that file's JSON>, \"make_vocab_size_divisible_by\": "
            f"<that number>, \"precision\": \"{flags.get('precision', 'fp32')}\"}}")
    kind = model["config"].get("model_type", "t5") if isinstance(model["config"], dict) else None
    if kind not in ("t5", "mt5"):
        raise CheckpointReadError(f"{where} (model.config): model_type {kind!r} is not a T5 "
                                  f"model; this reader reads T5 encoder-decoders only")
    try:
        return T5Config.from_dict(model["config"], source=f"{where} (model.config)")
    except ConfigError as e:
        raise CheckpointReadError(f"{e}; this reader reads T5 encoder-decoders only") from None


def is_weights_format(meta) -> bool:
    """Whether meta.json describes a weights checkpoint (formats/weights.py), not DeepSpeed's."""
    return isinstance(meta, dict) and meta.get("format") == "weights"


def precision_of(meta: Mapping[str, Any]) -> str:
    """The training precision meta.json records ('fp32' when it records none)."""
    return (meta.get("model") or {}).get("precision") \
        or (meta.get("flags") or {}).get("precision") or "fp32"

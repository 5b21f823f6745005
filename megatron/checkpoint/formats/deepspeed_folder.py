"""The folder of a checkpoint our trainer writes: the tracker, the iteration folders (their
names: megatron/checkpoint/layout.py) and meta.json (the layout, the flags, the model), and
hints when the folder is another tool's.
The reader built on it: megatron/checkpoint/formats/deepspeed.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from megatron.checkpoint.formats.deepspeed_experts import expert_files, expert_size
from megatron.checkpoint.formats.deepspeed_files import CheckpointReadError, Files
from megatron.checkpoint.layout import (
    DEEPSPEED_LATEST,
    ITERATION_PREFIX,
    TRACKER,
    TrackerError,
    iteration_folder_name,
    read_tracker,
)
from megatron.model.config import ConfigError, T5Config

META = "meta.json"
LAYERS_FILE = "pipeline_layers.json"

PathLike = Union[str, Path]


def find_iteration(ckpt_dir: PathLike, iteration: Optional[int] = None) -> Path:
    """The iteration folder to read: `iteration`'s, else the tracker's. An iteration folder
    itself (one holding meta.json) is returned as it is.

    Raises:
        CheckpointReadError: no such folder, a missing or garbled tracker, a missing iteration.
    """
    root = Path(ckpt_dir)
    if not root.is_dir():
        raise CheckpointReadError(f"{root}: no such checkpoint folder")
    if iteration is None and (root / META).is_file():
        return root
    tracker = root / TRACKER
    from_tracker = iteration is None
    if from_tracker:
        if not tracker.is_file():
            found = _iteration_folders(root)
            hint = (f"; it has {', '.join(found[-3:])}: pass the iteration to read one"
                    if found else "")
            raise CheckpointReadError(f"{tracker}: missing, so {root} holds no complete "
                                      f"checkpoint of our trainer{hint}{_foreign(root)}")
        try:
            iteration = read_tracker(root, hint="pass the iteration to read")
        except TrackerError as e:
            raise CheckpointReadError(str(e)) from None
    folder = root / iteration_folder_name(iteration)
    if not folder.is_dir():
        found = _iteration_folders(root)
        said = f" ({tracker.name} names it)" if from_tracker else ""
        raise CheckpointReadError(f"{folder}: missing{said}; iterations in {root}: "
                                  f"{', '.join(found) or 'none'}")
    return folder


def _iteration_folders(root: Path) -> List[str]:
    return sorted(p.name for p in root.glob(ITERATION_PREFIX + "*") if p.is_dir())


def _foreign(folder: Path) -> str:
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
    """The iteration folder's meta.json.

    Raises:
        CheckpointReadError: missing, not JSON, or not written by our trainer (no layout).
    """
    folder = Path(iter_dir)
    path = folder / META
    if not path.is_file():
        raise CheckpointReadError(f"{path}: missing, so {folder} is not an iteration folder "
                                  f"written by our trainer{_foreign(folder)}")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointReadError(f"{path}: unreadable ({e}); the checkpoint is damaged") \
            from None
    if is_weights_format(meta):
        return meta
    layout = meta.get("layout") if isinstance(meta, dict) else None
    keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size",
            "zero_stage")
    if not isinstance(layout, dict) or not all(isinstance(layout.get(k), int) for k in keys):
        raise CheckpointReadError(f"{path}: no 'layout' with {', '.join(keys)}: not the "
                                  f"meta.json of a checkpoint written by our trainer")
    return meta


def model_config(meta: Dict[str, Any], where: PathLike = META) -> T5Config:
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


def precision_of(meta: Dict[str, Any]) -> str:
    """The training precision meta.json records ('fp32' when it records none)."""
    return (meta.get("model") or {}).get("precision") \
        or (meta.get("flags") or {}).get("precision") or "fp32"


def expected_files(folder: Path, layout: Dict[str, int], precision: str) -> List[str]:
    """DeepSpeed's model and optimizer files (and the pipeline's tied files) for the layout."""
    tp, pp, dp = (layout["tensor_model_parallel_size"], layout["pipeline_model_parallel_size"],
                  layout["data_parallel_size"])
    zero, files = layout["zero_stage"], Files(folder)
    names = []
    for m in range(tp * pp):
        names += ([f"zero_pp_rank_{d}_mp_rank_{m:02d}_model_states.pt" for d in range(dp)]
                  if zero == 3 else [f"mp_rank_{m:02d}_model_states.pt"])
        if zero > 0:
            names += [files.zero_name(d, m, precision == "bf16") for d in range(dp)]
    if pp > 1:
        names.append(LAYERS_FILE)
    if pp > 1 and expert_size(layout) == 1:  # with experts over ranks DeepSpeed's MoE layout:
        try:  # no tied files
            keys = list(json.loads((folder / LAYERS_FILE).read_text())["tied"])
        except (OSError, ValueError, KeyError):
            keys = []
        names += [f"tied_{k}-model_{t:02d}-model_states.pt" for k in keys for t in range(tp)]
    return names + expert_files(layout)

"""What an iteration folder holds (`convert_checkpoint.py --inspect`): layout, precision, the
model, where the masters are, whether the optimizer states can be carried, the files, problems.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict

from megatron.checkpoint.formats.deepspeed_experts import describe_experts, expert_size
from megatron.checkpoint.formats.deepspeed_files import CheckpointReadError, Files, model_file
from megatron.checkpoint.formats.deepspeed_folder import LAYERS_FILE, PathLike, expected_files
from megatron.checkpoint.formats.meta import (
    META,
    is_weights_format,
    model_config,
    precision_of,
    read_meta,
)
from megatron.checkpoint.formats.deepspeed_tensors import check_optimizer_states
from megatron.model.config import ConfigError, T5Config
from megatron.model.meta import parameter_splits


def describe(iter_dir: PathLike) -> Dict[str, Any]:
    """What an iteration folder holds, for `convert_checkpoint.py --inspect`: iteration,
    consumed samples, layout, precision and dtypes, the model and its parameter count (full,
    unpadded), where the masters are, whether optimizer states are present (and whether the
    conversion tool can carry them to another layout: Adam's step), the files and
    their sizes, and `problems` (missing or unreadable files, an unknown model) rather than an
    exception where a file is damaged. A Mixture-of-Experts model adds `experts`: the number,
    the expert-parallel size (a weights checkpoint's: the target it was converted for), routing
    and the sparse blocks.

    Raises:
        CheckpointReadError: no readable meta.json.
    """
    folder = Path(iter_dir)
    meta = read_meta(folder)
    listing = [{"name": str(p.relative_to(folder)), "bytes": p.stat().st_size}
               for p in sorted(folder.rglob("*")) if p.is_file()]
    out: Dict[str, Any] = {
        "path": str(folder), "iteration": meta.get("iteration"),
        "consumed_samples": meta.get("consumed_samples"), "saved_at": meta.get("saved_at"),
        "layout": meta.get("layout"), "files": listing,
        "total_bytes": sum(f["bytes"] for f in listing), "problems": []}
    if is_weights_format(meta):
        optimizer = meta.get("optimizer")
        out.update(format="weights", model=meta.get("model"), parameters=meta.get("parameters"),
                   optimizer_states=optimizer is not None,
                   optimizer_step=(optimizer or {}).get("step"),
                   masters="the weights (fp32, full)" if optimizer else "none (weights only)")
        try:
            config = T5Config.from_dict((meta.get("model") or {}).get("config"))
            if config.is_moe:
                out["experts"] = describe_experts(config, expert_size(meta.get("layout") or {}))
        except ConfigError as e:
            out["problems"].append(f"{folder / META}: {e}")
        return out
    layout, precision = meta["layout"], precision_of(meta)
    out.update(format="deepspeed", precision=precision, model=None, parameters=None)
    try:
        config = model_config(meta, folder / META)
        params = parameter_splits(config)
        out["model"] = meta["model"]
        out["parameters"] = sum(math.prod(shape) for shape, _ in params.values())
        if config.is_moe:
            out["experts"] = describe_experts(config, expert_size(layout))
    except CheckpointReadError as e:
        out["problems"].append(str(e))
    present = {f["name"] for f in listing}
    missing = [n for n in expected_files(folder, layout, precision) if n not in present]
    if missing:
        out["problems"].append(f"missing files: {', '.join(missing)}")
    zero, files = layout["zero_stage"], Files(folder)
    try:
        first = files.get(model_file(0, layout))
        out["deepspeed_version"] = first.get("ds_version")
        out["dtypes"] = {"weights": _weights_dtype(files, layout, first),
                         "master": "float32" if zero > 0 or precision == "fp32" else None}
        out["optimizer_states"] = zero > 0 or first.get("optimizer") is not None
    except CheckpointReadError as e:
        out["problems"].append(str(e))
    out["optimizer_step"] = out["optimizer_states_convertible"] = None
    if out.get("optimizer_states"):
        try:
            out["optimizer_step"] = check_optimizer_states(folder)
            out["optimizer_states_convertible"] = True
        except CheckpointReadError as e:  # not damage: the tool then writes weights only
            out["optimizer_states_convertible"] = f"no: {e}"
    out["masters"] = (
        f"ZeRO-{zero} optimizer files (fp32, partitioned over "
        f"{layout['data_parallel_size']} data-parallel ranks)" if zero > 0 else
        "the weights themselves (fp32 with ZeRO-0)" if precision == "fp32" else
        "inside DeepSpeed's fp16 optimizer state (not read: use source='weights')")
    if layout["pipeline_model_parallel_size"] > 1 and (folder / LAYERS_FILE).is_file():
        try:
            out["pipeline_layers"] = json.loads((folder / LAYERS_FILE).read_text())
        except ValueError as e:
            out["problems"].append(f"{folder / LAYERS_FILE}: unreadable ({e})")
    return out


def _weights_dtype(files: Files, layout: Dict[str, int], first: Dict[str, Any]) -> str:
    if layout["pipeline_model_parallel_size"] > 1:
        layer = next(iter(sorted(files.folder.glob("layer_*-model_states.pt"))), None)
        state = files.get(layer.name) if layer is not None else first.get("module") or {}
    else:
        state = first.get("module") or {}
    tensor = next(iter(state.values()), None)
    return str(tensor.dtype).replace("torch.", "") if tensor is not None else "unknown"

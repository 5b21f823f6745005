"""A pipeline's files under our names: the layer and tied-module files of each stage (or, with
experts split over ranks, DeepSpeed's MoE layout: each stage's whole state dict in its model
file), mapped to single-process names by the pipeline module's own record (pipeline_layers.json).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Tuple

import torch

from megatron.checkpoint.formats.deepspeed_experts import expert_size, expert_weights
from megatron.checkpoint.formats.deepspeed_files import (
    CheckpointReadError,
    Files,
    Shard,
    model_file,
)
from megatron.checkpoint.formats.deepspeed_folder import LAYERS_FILE
from megatron.pipeline.module import single_process_names, tied_names


def owned(state: Dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """A copy of `state[name]`, so the caller owns it apart from the memory-mapped file."""
    return state[name].clone()


def pipeline_weights(files: Files, layout: Dict[str, Any], tensor_rank: int,
                      experts) -> Dict[str, Shard]:
    """A tensor rank's module weights from the pipeline's layer and tied-module files; with
    experts split over ranks, from each stage's model file and expert files instead."""
    layers, tied = pipeline_layers(files.folder)
    if expert_size(layout) > 1:
        return _pipeline_expert_weights(files, layout, tensor_rank, experts, layers, tied)
    local: Dict[str, Shard] = {}
    suffix = f"-model_{tensor_rank:02d}-model_states.pt"
    for path in sorted(files.folder.glob(f"layer_*{suffix}")):
        state = files.get(path.name)
        index = int(path.name[len("layer_"):-len(suffix)])
        local.update({f"{index}.{k}": partial(owned, state, k) for k in state})
    for path in sorted(files.folder.glob(f"tied_*{suffix}")):
        state = files.get(path.name)
        key = path.name[len("tied_"):-len(suffix)]
        local.update({f"tied_modules.{key}.{k}": partial(owned, state, k) for k in state})
    return to_single_process(local, layers, tied, files.folder)


def _pipeline_expert_weights(files: Files, layout: Dict[str, Any], tensor_rank: int, experts,
                             layers: List[str], tied: Dict[str, str]) -> Dict[str, Shard]:
    """DeepSpeed's MoE checkpoint of a pipeline: stage s's whole state dict (its layers'
    numbered names) in model file M = s * TP + T, its experts in our expert files (the
    single-process names); a tied parameter from its first stage."""
    out: Dict[str, Shard] = {}
    experts = set(experts)
    for stage in range(layout["pipeline_model_parallel_size"]):
        rank = stage * layout["tensor_model_parallel_size"] + tensor_rank
        module = files.field(model_file(rank, layout), "module")
        local = to_single_process({n: partial(owned, module, n) for n in module}, layers, tied,
                                files.folder)
        local = expert_weights(files, layout, rank, local, sorted(experts & set(local)))
        for name, shard in local.items():
            out.setdefault(name, shard)
    return out


def pipeline_layers(folder: Path) -> Tuple[List[str], Dict[str, str]]:
    """pipeline_layers.json: each layer's single-process name and the tied modules."""
    path = folder / LAYERS_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return list(data["layers"]), dict(data["tied"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointReadError(f"{path}: missing or unreadable ({e}); a pipeline checkpoint "
                                  f"cannot be read without it") from None


def to_single_process(local: Dict[str, Shard], layers: List[str], tied: Dict[str, str],
                    folder: Path) -> Dict[str, Shard]:
    """Stage parameter names ('3.block.layer.0...', 'tied_modules.shared.embedding.weight') to
    ours, by the pipeline module's own mapping."""
    if tied != tied_names():
        raise CheckpointReadError(f"{folder / LAYERS_FILE}: tied modules {tied} differ from this "
                                  f"version's {tied_names()}")
    stage = SimpleNamespace(layer_names=layers,
                            named_parameters=lambda: [(n, None) for n in local])
    try:
        names = single_process_names(stage)
    except (IndexError, ValueError, KeyError) as e:
        raise CheckpointReadError(f"{folder}: parameter names that {LAYERS_FILE} does not "
                                  f"explain ({e!r})") from None
    return {names[n]: shard for n, shard in local.items()}

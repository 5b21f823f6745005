"""The optimizer's tensors by parameter name: the fp32 masters and Adam's moments from the ZeRO
1-3 files' flat partitions, or, under ZeRO-0, from torch's optimizer state_dict in the model
files; and Adam's step count.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Dict, Optional

import torch

from megatron.checkpoint.formats.deepspeed_experts import zero0_expert_moments
from megatron.checkpoint.formats.deepspeed_files import (
    OPTIMIZER_PARAMETERS,
    CheckpointReadError,
    Files,
    Shard,
    model_file,
    zero_masters,
)
from megatron.checkpoint.formats.deepspeed_folder import PathLike
from megatron.checkpoint.formats.meta import META, is_weights_format, precision_of, read_meta
from megatron.checkpoint.formats.deepspeed_pipeline import (
    owned,
    pipeline_layers,
    to_single_process,
)


def optimizer_shards(files: Files, layout: Dict[str, int], precision: str, key: str,
                      tensor_rank: int, experts=()) -> Dict[str, Shard]:
    """{our name: the optimizer's `key` ('fp32': the masters, or one of MOMENTS) on
    `tensor_rank`}, from every pipeline stage (a tied parameter from its first): the ZeRO files'
    flat partitions, or under ZeRO-0 (moments only: its masters are the weights) torch's
    optimizer state_dict in the model-states file, named by the trainer's OPTIMIZER_PARAMETERS
    record (and, for the `experts` with EP > 1, in each expert rank's DeepSpeed file)."""
    zero, bf16 = layout["zero_stage"], precision == "bf16"
    if zero == 0 and precision == "fp16":
        raise CheckpointReadError(f"{files.folder}: fp16 with ZeRO-0 keeps its optimizer inside "
                                  f"DeepSpeed's fp16 optimizer state, without parameter names")
    stages = layout["pipeline_model_parallel_size"]
    tensor_size = layout["tensor_model_parallel_size"]
    layers, tied = pipeline_layers(files.folder) if stages > 1 else ([], {})
    out: Dict[str, Shard] = {}
    for stage in range(stages):
        rank = stage * tensor_size + tensor_rank
        def ours(shards: Dict[str, Shard]) -> Dict[str, Shard]:
            if stages == 1:
                return shards
            return to_single_process(shards, layers, tied, files.folder)

        if zero > 0:
            local = ours(zero_masters(files, layout, rank, bf16, key))
        else:
            order = model_file(rank, layout)
            local = ours(_zero0_moments(files, order, key))
            local = zero0_expert_moments(
                files, layout, rank, local, [e for e in experts if e in local],
                lambda name, order=order: ours(_zero0_moments(files, order, key, name)))
        for name, shard in local.items():
            out.setdefault(name, shard)
    return out


def _zero0_moments(files: Files, name: str, key: str,
                   state_file: Optional[str] = None) -> Dict[str, Shard]:
    """The moment `key` by parameter name from torch's optimizer state_dict in model file `name`
    (or in `state_file`, an expert rank's, with the same parameters in the same order)."""
    state = files.field(state_file or name, "optimizer")
    order = files.get(name).get(OPTIMIZER_PARAMETERS)
    where = files.folder / (state_file or name)
    if not order:
        raise CheckpointReadError(f"{where}: no {OPTIMIZER_PARAMETERS!r} record, so the "
                                  f"parameters of its optimizer state are unknown (saved by an "
                                  f"earlier version of the trainer)")
    groups, per = state.get("param_groups") or [], state.get("state") or {}
    if len(groups) != len(order) or any(len(g["params"]) != len(names)
                                        for g, names in zip(groups, order)):
        raise CheckpointReadError(f"{where}: the optimizer's groups hold "
                                  f"{[len(g['params']) for g in groups]} parameters; its "
                                  f"{OPTIMIZER_PARAMETERS!r} names {[len(n) for n in order]}")
    out = {}
    for group, names in zip(groups, order):
        for index, param in zip(group["params"], names):
            entry = per.get(index)
            if not isinstance(entry, dict) or not torch.is_tensor(entry.get(key)):
                raise CheckpointReadError(f"{where}: no optimizer state {key!r} for {param} (an "
                                          f"optimizer other than Adam, or saved before its "
                                          f"first step)")
            out[param] = partial(owned, entry, key)
    return out



def optimizer_step(iter_dir: PathLike) -> int:
    """Adam's step count in a checkpoint (the same in every group and on every rank).

    Raises:
        CheckpointReadError: a checkpoint without optimizer states."""
    folder = Path(iter_dir)
    meta = read_meta(folder)
    if is_weights_format(meta):
        step = (meta.get("optimizer") or {}).get("step")
        if not isinstance(step, int):
            raise CheckpointReadError(f"{folder / META}: a weights checkpoint without optimizer "
                                      f"states")
        return step
    layout, files = meta["layout"], Files(folder)
    if layout["zero_stage"] > 0:
        name = files.zero_name(0, 0, precision_of(meta) == "bf16")
        state = files.field(name, "optimizer_state_dict")
        base = state.get("optimizer_state_dict" if layout["zero_stage"] == 3
                         else "base_optimizer_state") or {}
    else:
        name = model_file(0, layout)
        base = files.field(name, "optimizer")
    try:
        step = next(iter(base["state"].values()))["step"]
        return int(step.item() if torch.is_tensor(step) else step)
    except (KeyError, TypeError, StopIteration, AttributeError, ValueError):
        raise CheckpointReadError(f"{files.folder / name}: no Adam step count in its optimizer "
                                  f"state") from None

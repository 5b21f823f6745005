"""Adam's states from full tensors into whatever optimizer DeepSpeed built for this rank.

A converted checkpoint (megatron/checkpoint/formats/weights.py) holds the fp32 masters and Adam's two
moments as full tensors under our names, and the step count. A run of any layout takes its part:
each rank slices its tensor-parallel shard of every parameter its stage holds (the same slice as
the weights), and the optimizer takes the elements it owns:

- ZeRO-0 (torch's AdamW on the parameters themselves, which are the fp32 masters the weights
  loader has set): the state of each parameter, whole.
- ZeRO-1/2 (`DeepSpeedZeroOptimizer`) and the BF16 optimizer: each parameter is linked to its
  fragment of this data-parallel rank's flat fp32 partition (for an expert weight, of its
  expert group's partition over the expert-data-parallel ranks) (`_hp_mapping`, DeepSpeed's own
  link, which its universal-checkpoint loader fills the same way). Adam's state is created lazily
  at the first step, so we create it: zeroed flat moments per group, our fragments copied in,
  then DeepSpeed re-links its fragments to them.
- ZeRO-3: the flat fp32 partition of each sub-group, written through the optimizer's
  `set_full_hp_param`; not with optimizer states swapped to NVMe (refused with a message).

What is read of DeepSpeed's optimizers beyond their public methods goes through
megatron/deepspeed_internals.py. Adam's step is set as each optimizer keeps it: a
tensor for torch's AdamW (on the parameter's device when fused or capturable), an int for
DeepSpeedCPUAdam.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, List, Tuple

import torch

from megatron import deepspeed_internals as ds
from megatron.checkpoint.formats.weights import MOMENTS, WeightsError, WeightsReader, local_tensor

Values = Callable[..., Dict[str, torch.Tensor]]
"""values(param, keys): a parameter's local values, by key ('fp32', the master, and each of
MOMENTS; all by default), in its full local shape."""


def load_optimizer_state(engine, names: Dict[str, str], folder: Path, step: int,
                         vocab_size: int, tensor_rank: int, tensor_size: int,
                         experts: Tuple[int, int] = (0, 1), open_reader=WeightsReader
                         ) -> None:
    """Put the masters and moments of weights checkpoint `folder` into `engine`'s optimizer.

    names: {this rank's parameter name: our full name}.
    experts: (expert rank, expert-parallel size): which experts of an expert weight are this
        rank's (ZeRO-1/2 keeps them in DeepSpeed's expert groups, reached by the same links).
    Raises:
        WeightsError: missing tensors or files, or an optimizer that cannot take them.
    """
    readers = {"fp32": open_reader(folder), **{k: open_reader(folder, k) for k in MOMENTS}}
    full = {id(p): names[n] for n, p in engine.module.named_parameters()}
    for key, reader in readers.items():
        absent = sorted(set(full.values()) - set(reader.names()))
        if absent:
            raise WeightsError(f"{folder}: {reader.single} lacks {', '.join(absent[:4])}"
                               f"{' ...' if len(absent) > 4 else ''}")

    def values(param, keys=tuple(readers)) -> Dict[str, torch.Tensor]:
        return {key: local_tensor(param, full[id(param)], readers[key], vocab_size,
                                   tensor_rank, tensor_size, *experts).to(torch.float32)
                for key in keys}

    optimizer = engine.optimizer
    linked = ds.linked_partitions(optimizer)
    with torch.no_grad():
        if engine.zero_optimization_stage() == 3:
            _zero3(optimizer, engine.module, values, step)
        elif linked is not None:
            _linked(optimizer, *linked, values, step)
        elif isinstance(optimizer, torch.optim.Optimizer) and _owns(optimizer, engine.module):
            _plain(optimizer, values, step)
        else:
            raise WeightsError(f"{folder}: optimizer states cannot be loaded into "
                               f"{type(optimizer).__name__} (fp16 without ZeRO keeps its own "
                               f"masters); pass --no-load-optim to load the weights only")


def _step_value(optimizer, group: dict, param: torch.Tensor, step: int):
    if type(optimizer).__name__ == "DeepSpeedCPUAdam":
        return int(step)
    on_device = group.get("fused") or group.get("capturable")
    return torch.tensor(float(step), dtype=torch.float32,
                        device=param.device if on_device else "cpu")


def _owns(optimizer, module) -> bool:
    ours = {id(p) for p in module.parameters()}
    return all(id(p) in ours for g in optimizer.param_groups for p in g["params"])


def _plain(optimizer: torch.optim.Optimizer, values: Values, step: int) -> None:
    for group in optimizer.param_groups:
        for param in group["params"]:
            got = values(param, MOMENTS)  # the master is the parameter, loaded already
            optimizer.state[param] = {"step": _step_value(optimizer, group, param, step),
                                      **{k: got[k].to(param.device).view_as(param).clone()
                                         for k in MOMENTS}}


def _linked(optimizer, lp_groups: List[List[torch.nn.Parameter]],
            hp_flats: List[torch.Tensor], values: Values, step: int) -> None:
    """ZeRO-1/2 and the BF16 optimizer: each parameter's fragment of this rank's partition."""
    base = optimizer.optimizer
    for lps, flat, group in zip(lp_groups, hp_flats, base.param_groups):
        state = {"step": _step_value(base, group, flat, step),
                 **{k: torch.zeros_like(flat) for k in MOMENTS}}
        for lp in lps:
            mapping = ds.fragment_mapping(lp)
            if mapping is None:  # no element of this parameter in this rank's partition
                continue
            got = values(lp)
            lo, hi = mapping.lp_fragment_address, mapping.hp_fragment_address
            mapping.hp_fragment.copy_(got["fp32"].reshape(-1).narrow(0, lo.start, lo.numel))
            for key in MOMENTS:
                state[key].narrow(0, hi.start, hi.numel).copy_(
                    got[key].reshape(-1).narrow(0, lo.start, lo.numel))
        base.state[flat] = state
    # DeepSpeed links its fragments to Adam's state once, after the first step: now instead.
    ds.relink_optimizer_states(optimizer)
    update = getattr(optimizer, "update_lp_params", None)
    if update is not None:  # the BF16 optimizer: the bf16 weights from the masters just set
        update()


def _zero3(optimizer, module, values: Values, step: int) -> None:
    if ds.zero3_swaps_optimizer(optimizer):
        raise WeightsError("optimizer states cannot be loaded into ZeRO-3 with the optimizer "
                           "swapped to NVMe; pass --no-load-optim to load the weights only")
    base = optimizer.optimizer
    groups = {id(p): g for g in base.param_groups for p in g["params"]}
    for flat in ds.zero3_flat_partitions(optimizer):
        base.state[flat] = {"step": _step_value(base, groups.get(id(flat), {}), flat, step),
                            **{k: torch.zeros_like(flat) for k in MOMENTS}}
    for param in module.parameters():
        if not param.requires_grad:
            continue
        got = values(param)
        optimizer.set_full_hp_param(got["fp32"], param)
        for key in MOMENTS:
            optimizer.set_full_hp_param(got[key], param, key)

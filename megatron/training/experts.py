"""Expert parallelism on DeepSpeed's conventions (DeepSpeed 0.19.8, read in its code; what
we touch of its internals is in megatron/deepspeed_internals.py).

DeepSpeed's engine treats a parameter as an expert's when `param.allreduce is False`, reduces its
gradient over the expert-data-parallel group named by `param.group_name` (`ep_size_<EP>`; the
sum over the ranks holding the same experts, divided by the whole data-parallel size, as a
single process averages), and ZeRO-1/2 partitions the optimizer states of the parameter groups
marked `moe` (`split_params_into_different_moe_groups_for_optimizer`) over that group. It turns
this on only when the module holds an instance of its own `deepspeed.moe.layer.MoE` (its
`has_moe_layers`). Its MoE layer itself is not used: it has no z-loss, no BASE routing, no
grouped experts under tensor parallelism, and refuses ZeRO-3 (so do we, before the start).

So, for EP > 1:
- `prepare`: our expert parameters (`expert_parallel`) get `allreduce = False` and the group
  name; DeepSpeed's group tables get our expert and expert-data-parallel groups under that
  name (its own layout, `groups._get_expert_parallel_ranks`, is the same one: runs of EP
  consecutive data ranks; tests/distributed/test_expert_parallel.py checks it); a marker module
  (`deepspeed_internals.expert_marker`, a `MoE` without layers, parameters or state) tells the
  engine that the model has experts. It holds no expert of its own, so DeepSpeed's MoE
  checkpoint code writes no per-expert files: `expert_files` and `load_expert_files` save and
  read this rank's experts.
- the optimizer's parameter groups are split into dense and expert groups.
- the gradient norm: ZeRO-1/2 sums the squared norms of every rank's partitions over the whole
  data-parallel group, each expert counted once (right). The engine's own ZeRO-0 clipping
  (`runtime.utils.clip_grad_norm_`) averages the ranks' norms, and the ranks hold different
  experts: that norm is neither the model's nor the same on every rank, so under ZeRO-0 the step
  takes `global_grad_norm` and clips itself (DeepSpeed's clipping set to 0).
- a pipeline (DeepSpeed's PipelineEngine): with the marker its checkpoint takes the MoE path
  too. `_save_moe_checkpoint` writes the stage's whole state dict through the base engine's
  `module_state_dict` into the model file of the stage's model-parallel rank (mp_rank_MM,
  M = stage x TP + tensor rank), not into the layer files, and `PipelineEngine.
  load_module_state_dict` hands a model with experts the whole checkpoint for the base loader:
  the two agree, so a pipeline resumes from that file (pipeline_step.py adds the layer map,
  pipeline_layers.json, for the conversion tool). Expert gradients are reduced by the engine's
  `_reduce_expert_gradients` as without a pipeline.
With EP = 1 the experts are ordinary parameters, replicated over the data-parallel ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List

import torch
import torch.distributed as dist
from torch import nn

from megatron import deepspeed_internals, parallel_state
from megatron.checkpoint.formats.deepspeed_experts import EXPERT_FILE
from megatron.tensor_parallel.layers import counts_in_norm


def group_name(expert_parallel_size: int) -> str:
    """DeepSpeed's name of the expert groups of this size."""
    return deepspeed_internals.expert_group_name(expert_parallel_size)


def uses_deepspeed_experts(model: nn.Module) -> bool:
    """Whether the model's experts are split over ranks (EP > 1)."""
    ep = getattr(model, "expert_parallel", None)
    return ep is not None and ep.size > 1


def prepare(model: nn.Module) -> None:
    """Mark the expert parameters, register our groups with DeepSpeed and add the marker
    (module docstring); nothing with EP = 1."""
    if not uses_deepspeed_experts(model):
        return
    size = model.expert_parallel.size
    name = group_name(size)
    deepspeed_internals.register_expert_groups(
        name, parallel_state.get_expert_model_parallel_group(),
        parallel_state.get_expert_model_parallel_ranks(),
        parallel_state.get_expert_data_parallel_group(),
        parallel_state.get_expert_data_parallel_ranks())
    for param in model.parameters():
        if getattr(param, "expert_parallel", False):
            deepspeed_internals.mark_expert_parameter(param, name)
    model.add_module("deepspeed_experts",
                     deepspeed_internals.expert_marker(model.config.num_experts, size, name))


def split_param_groups(model: nn.Module, groups: List[Dict]) -> List[Dict]:
    """The optimizer's groups with the expert parameters in their own groups (DeepSpeed's
    `moe` groups); unchanged with EP = 1."""
    if not uses_deepspeed_experts(model):
        return groups
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    return split_params_into_different_moe_groups_for_optimizer(groups)


def global_grad_norm(model: nn.Module) -> float:
    """The norm of the whole model's gradients (reduced, before clipping): tensor shards and
    experts counted once, replicated weights once (collective over the model-parallel and the
    expert-parallel groups)."""
    tensor_rank = parallel_state.get_tensor_model_parallel_rank()
    dense, experts = [], []
    for param in model.parameters():
        if param.grad is None or not counts_in_norm(param, tensor_rank):
            continue
        (experts if getattr(param, "expert_parallel", False) else dense).append(param.grad)
    device = next(model.parameters()).device
    squares = torch.zeros(2, dtype=torch.float64, device=device)
    for i, grads in enumerate((dense, experts)):
        if grads:
            squares[i] = torch.stack([g.detach().double().norm() for g in grads]).square().sum()
    if dist.is_initialized() and parallel_state.model_parallel_is_initialized():
        dist.all_reduce(squares, group=parallel_state.get_model_parallel_group())
        if parallel_state.get_expert_model_parallel_world_size() > 1:
            expert = squares[1:].clone()
            dist.all_reduce(expert, group=parallel_state.get_expert_model_parallel_group())
            squares[1] = expert[0]
    return float(squares.sum().sqrt())


def clip_gradients(model: nn.Module, norm: float, max_norm: float) -> None:
    """Scale the gradients as torch's clip_grad_norm_ does (coefficient max / (norm + 1e-6))."""
    if max_norm <= 0:
        return
    coefficient = max_norm / (norm + 1e-6)
    if coefficient < 1:
        for param in model.parameters():
            if param.grad is not None:
                param.grad.mul_(coefficient)


def expert_state(model: nn.Module) -> Dict[str, torch.Tensor]:
    """This rank's experts, by the single-process model's names (a pipeline stage's are mapped
    from its numbered layers); the expert biases are the same on every rank: they are in
    DeepSpeed's model file."""
    names = getattr(model, "single_process_names", None)
    names = names() if names is not None else {}
    return {names.get(name, name): p.detach() for name, p in model.named_parameters()
            if getattr(p, "expert_parallel", False)}


def expert_files(model: nn.Module, folder: Path) -> Dict[Path, Dict[str, torch.Tensor]]:
    """The file this rank writes beside DeepSpeed's (the first expert-data-parallel rank of
    each expert-parallel rank), or nothing."""
    if not uses_deepspeed_experts(model):
        return {}
    if parallel_state.get_expert_data_parallel_rank() != 0:
        return {}
    path = folder / EXPERT_FILE.format(ep=parallel_state.get_expert_model_parallel_rank(),
                                       mp=parallel_state.get_model_parallel_rank())
    return {path: {name: t.clone() for name, t in expert_state(model).items()}}


def load_expert_files(model: nn.Module, folder: Path) -> None:
    """Read this rank's experts back (`expert_files`)."""
    if not uses_deepspeed_experts(model):
        return
    path = folder / EXPERT_FILE.format(ep=parallel_state.get_expert_model_parallel_rank(),
                                       mp=parallel_state.get_model_parallel_rank())
    saved = torch.load(path, map_location="cpu", weights_only=True)
    state = expert_state(model)
    missing = sorted(set(state) - set(saved))
    if missing:
        raise RuntimeError(f"{path} lacks {', '.join(missing[:4])}")
    with torch.no_grad():
        for name, tensor in state.items():
            tensor.copy_(saved[name])

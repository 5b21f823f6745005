"""Autograd collectives for tensor parallelism; each backward mirrors its forward.

    copy_to_tensor_model_parallel_region      forward: identity      backward: all-reduce
    reduce_from_tensor_model_parallel_region  forward: all-reduce    backward: identity
    scatter_to_tensor_model_parallel_region   forward: split last    backward: gather last
    gather_from_tensor_model_parallel_region  forward: gather last   backward: split last

Each takes the `TensorParallel` (tensor_parallel/group.py) of the layer that calls it: its size,
its rank and the group the collective runs on. With one rank every one of them is the identity,
so TP=1 runs the same classes as plain math.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.tensor_parallel.group import TensorParallel


def all_reduce_tensor_parallel(tensor: torch.Tensor, tp: TensorParallel,
                               op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce over `tp`'s group, in place on a contiguous tensor (no autograd); the identity
    with one tensor rank."""
    if tp.size == 1:
        return tensor
    tensor = tensor.contiguous()
    dist.all_reduce(tensor, op=op, group=tp.group)
    return tensor


def _split_last_dim(tensor: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    if tp.size == 1:
        return tensor
    if tensor.shape[-1] % tp.size:
        raise ValueError(f"last dimension {tensor.shape[-1]} is not divisible by the "
                         f"tensor-model-parallel size {tp.size}")
    chunk = tensor.shape[-1] // tp.size
    return tensor[..., tp.rank * chunk:(tp.rank + 1) * chunk].contiguous()


def _gather_last_dim(tensor: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    if tp.size == 1:
        return tensor
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(tp.size)]
    dist.all_gather(parts, tensor, group=tp.group)
    return torch.cat(parts, dim=-1)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, tp):
        ctx.tp = tp
        return tensor

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_tensor_parallel(grad.clone(), ctx.tp), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, tp):
        return all_reduce_tensor_parallel(tensor.clone(), tp)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, tp):
        ctx.tp = tp
        return _split_last_dim(tensor, tp)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.tp), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, tp):
        ctx.tp = tp
        return _gather_last_dim(tensor, tp)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad, ctx.tp), None


def copy_to_tensor_model_parallel_region(tensor: torch.Tensor,
                                         tp: TensorParallel) -> torch.Tensor:
    return tensor if tp.size == 1 else _CopyToRegion.apply(tensor, tp)


def reduce_from_tensor_model_parallel_region(tensor: torch.Tensor,
                                             tp: TensorParallel) -> torch.Tensor:
    return tensor if tp.size == 1 else _ReduceFromRegion.apply(tensor, tp)


def scatter_to_tensor_model_parallel_region(tensor: torch.Tensor,
                                            tp: TensorParallel) -> torch.Tensor:
    return tensor if tp.size == 1 else _ScatterToRegion.apply(tensor, tp)


def gather_from_tensor_model_parallel_region(tensor: torch.Tensor,
                                             tp: TensorParallel) -> torch.Tensor:
    return tensor if tp.size == 1 else _GatherFromRegion.apply(tensor, tp)

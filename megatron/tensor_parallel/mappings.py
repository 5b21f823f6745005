"""Autograd collectives for tensor parallelism; each backward mirrors its forward.

    copy_to_tensor_model_parallel_region      forward: identity      backward: all-reduce
    reduce_from_tensor_model_parallel_region  forward: all-reduce    backward: identity
    scatter_to_tensor_model_parallel_region   forward: split last    backward: gather last
    gather_from_tensor_model_parallel_region  forward: gather last   backward: split last

With one tensor-parallel rank every one of them is the identity, so TP=1 runs the same classes as
plain math. The group is the tensor-parallel group of megatron.parallel_state.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron import parallel_state


def all_reduce_tensor_parallel(tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce over the tensor-parallel group, in place on a contiguous tensor (no autograd);
    the identity with one tensor rank."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return tensor
    tensor = tensor.contiguous()
    dist.all_reduce(tensor, op=op, group=parallel_state.get_tensor_model_parallel_group())
    return tensor


def _split_last_dim(tensor: torch.Tensor) -> torch.Tensor:
    size = parallel_state.get_tensor_model_parallel_world_size()
    if size == 1:
        return tensor
    if tensor.shape[-1] % size:
        raise ValueError(f"last dimension {tensor.shape[-1]} is not divisible by the "
                         f"tensor-model-parallel size {size}")
    chunk = tensor.shape[-1] // size
    rank = parallel_state.get_tensor_model_parallel_rank()
    return tensor[..., rank * chunk:(rank + 1) * chunk].contiguous()


def _gather_last_dim(tensor: torch.Tensor) -> torch.Tensor:
    size = parallel_state.get_tensor_model_parallel_world_size()
    if size == 1:
        return tensor
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor, group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor):
        return tensor

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_tensor_parallel(grad.clone())


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor):
        return all_reduce_tensor_parallel(tensor.clone())

    @staticmethod
    def backward(ctx, grad):
        return grad


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor):
        return _split_last_dim(tensor)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad)


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor):
        return _gather_last_dim(tensor)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad)


def _single() -> bool:
    return parallel_state.get_tensor_model_parallel_world_size() == 1


def copy_to_tensor_model_parallel_region(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if _single() else _CopyToRegion.apply(tensor)


def reduce_from_tensor_model_parallel_region(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if _single() else _ReduceFromRegion.apply(tensor)


def scatter_to_tensor_model_parallel_region(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if _single() else _ScatterToRegion.apply(tensor)


def gather_from_tensor_model_parallel_region(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if _single() else _GatherFromRegion.apply(tensor)

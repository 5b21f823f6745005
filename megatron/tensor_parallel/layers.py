"""Tensor-parallel layers: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding.

Weights are initialized as one full ("master") tensor drawn from the default generator, which is
seeded alike on every rank, and each rank keeps its slice. So a model has the same full weights
whatever the tensor-parallel size, and TP=1 is plain math with the same classes. Each layer
initializes its own weights in `reset_parameters` (DeepSpeed's zero.Init partitions a module's
parameters right after its constructor, so a parent that writes them later would be ignored).

Each layer takes its `TensorParallel` (tensor_parallel/group.py) as an argument: its size and
rank fix the shard a layer holds, its group the collectives it runs.

Every sharded parameter carries `tensor_model_parallel=True`, `partition_dim` and
`partition_stride`; DeepSpeed's gradient norm and clipping count a parameter without that flag
only on tensor rank 0, which is right for replicated weights and wrong for shards.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron.tensor_parallel.group import TensorParallel
from megatron.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
)

InitMethod = Callable[[torch.Tensor], None]


def normal_init(std: float) -> InitMethod:
    def init(tensor: torch.Tensor) -> None:
        nn.init.normal_(tensor, mean=0.0, std=std)
    return init


def counts_in_norm(param, tensor_rank: int) -> bool:
    """Whether this rank's copy of `param` counts in a norm summed over the model-parallel
    ranks: a tensor shard on every tensor rank, a replicated weight (layer norms) on tensor rank
    0 only, a tied pipeline copy (DeepSpeed marks those beyond the first `ds_pipe_replicated`)
    never."""
    if getattr(param, "ds_pipe_replicated", False):
        return False
    return getattr(param, "tensor_model_parallel", False) or tensor_rank == 0


def set_tensor_model_parallel_attributes(param: torch.Tensor, is_parallel: bool, dim: int,
                                         stride: int = 1) -> None:
    param.tensor_model_parallel = is_parallel
    param.partition_dim = dim
    param.partition_stride = stride


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-model-parallel "
                         f"size {denominator}")
    return numerator // denominator


def shard(full: torch.Tensor, dim: int, stride: int, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s slice of a full tensor along `dim` split over `size` ranks; with stride s
    the dimension is cut into size * s blocks and rank r keeps blocks r, r + size, ... (for
    fused weights)."""
    if size == 1:
        return full
    blocks = torch.chunk(full, size * stride, dim=dim)
    return torch.cat(blocks[rank::size], dim=dim)


def unshard(parts, dim: int, stride: int) -> torch.Tensor:
    """The full tensor from every rank's `shard` of it (in rank order)."""
    if stride == 1:
        return torch.cat(parts, dim=dim)
    blocks = [torch.chunk(p, stride, dim=dim) for p in parts]
    return torch.cat([blocks[r][s] for s in range(stride) for r in range(len(parts))], dim=dim)


def host_fp32(shape) -> torch.Tensor:
    """An uninitialised fp32 tensor on the CPU, where the full weights are drawn, also inside
    DeepSpeed's zero.Init: it turns what torch.empty makes into the model's dtype on the
    device, which would draw ZeRO-3's weights in bf16 or from the CUDA generator."""
    return torch.empty(shape, dtype=torch.float32, device="cpu").to(torch.float32)


def initialize_shard(weight: torch.Tensor, full_shape, dim: int, stride: int,
                      init_method: InitMethod, tp: TensorParallel,
                      init_size: Optional[int] = None) -> None:
    """Draw the full weight, then keep this rank's slice (the same model at any TP).

    init_size: draw only the first init_size entries along `dim`; the rest (vocabulary padding,
    whose size depends on the TP size) start at zero, so the draws do not depend on the TP size.
    """
    if weight.device.type == "meta":
        return
    master = host_fp32(full_shape).zero_()
    if init_size is None or init_size >= full_shape[dim]:
        init_method(master)
    else:
        drawn = host_fp32((*full_shape[:dim], init_size, *full_shape[dim + 1:]))
        init_method(drawn)
        master.narrow(dim, 0, init_size).copy_(drawn)
    with torch.no_grad():
        weight.copy_(shard(master, dim, stride, tp.rank, tp.size))


class ColumnParallelLinear(nn.Module):
    """Y = X A^T (+ b) with A split by rows (the output features) across tensor ranks.

    Args:
        input_size, output_size: full sizes; output_size must divide by the TP size.
        bias: add a bias (sharded like the output).
        gather_output: all-gather the output so every rank holds all features; else each rank
            returns its own slice, ready for a RowParallelLinear with input_is_parallel.
        init_method: fills the full weight.
        init_size: draw only this many output rows; the rest (vocabulary padding) are zero.
        tp: the ranks that split the output features.
    """

    def __init__(self, input_size: int, output_size: int, *, tp: TensorParallel,
                 bias: bool = False, gather_output: bool = False,
                 init_method: InitMethod = normal_init(0.02), stride: int = 1,
                 init_size: Optional[int] = None, device=None, dtype=None) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.init_size = init_size
        self.gather_output = gather_output
        self.init_method, self.stride, self.tp = init_method, stride, tp
        self.output_size_per_partition = divide(output_size, tp.size, "output size")
        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, input_size,
                                               device=device, dtype=dtype))
        set_tensor_model_parallel_attributes(self.weight, True, 0, stride)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size_per_partition, device=device,
                                                 dtype=dtype))
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        initialize_shard(self.weight, (self.output_size, self.input_size), 0, self.stride,
                          self.init_method, self.tp, self.init_size)
        if self.bias is not None and self.bias.device.type != "meta":
            with torch.no_grad():
                self.bias.zero_()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = copy_to_tensor_model_parallel_region(hidden, self.tp)
        out = F.linear(hidden, self.weight, self.bias)
        return gather_from_tensor_model_parallel_region(out, self.tp) if self.gather_output \
            else out

    def forward_flops(self, tokens: int) -> int:
        """Multiply-adds x 2 of the full layer (all tensor ranks) over `tokens` input rows."""
        return 2 * self.input_size * self.output_size * tokens

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size} "
                f"(per rank {self.output_size_per_partition}), bias={self.bias is not None}")


class RowParallelLinear(nn.Module):
    """Y = X A^T (+ b) with A split by columns (the input features); the partial products are
    summed over tensor ranks. The bias is replicated and added after the sum.

    Args:
        input_is_parallel: the input is already this rank's slice (from a ColumnParallelLinear);
            else the full input is split here.
        tp: the ranks that split the input features.
    """

    def __init__(self, input_size: int, output_size: int, *, tp: TensorParallel,
                 bias: bool = False, input_is_parallel: bool = True,
                 init_method: InitMethod = normal_init(0.02), stride: int = 1, device=None,
                 dtype=None) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.input_is_parallel = input_is_parallel
        self.init_method, self.stride, self.tp = init_method, stride, tp
        self.input_size_per_partition = divide(input_size, tp.size, "input size")
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_partition,
                                               device=device, dtype=dtype))
        set_tensor_model_parallel_attributes(self.weight, True, 1, stride)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        initialize_shard(self.weight, (self.output_size, self.input_size), 1, self.stride,
                          self.init_method, self.tp)
        if self.bias is not None and self.bias.device.type != "meta":
            with torch.no_grad():
                self.bias.zero_()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            hidden = scatter_to_tensor_model_parallel_region(hidden, self.tp)
        out = reduce_from_tensor_model_parallel_region(F.linear(hidden, self.weight), self.tp)
        return out if self.bias is None else out + self.bias

    def forward_flops(self, tokens: int) -> int:
        """Multiply-adds x 2 of the full layer (all tensor ranks) over `tokens` input rows."""
        return 2 * self.input_size * self.output_size * tokens

    def extra_repr(self) -> str:
        return (f"in={self.input_size} (per rank {self.input_size_per_partition}), "
                f"out={self.output_size}, bias={self.bias is not None}")


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by vocabulary rows; each rank looks up the ids it owns and the
    rows are summed over tensor ranks (`tp`). `num_embeddings` must divide by the TP size (pad
    it)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp: TensorParallel,
                 init_method: InitMethod = normal_init(1.0), init_size: Optional[int] = None,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.init_size = init_size
        self.init_method, self.tp = init_method, tp
        per_rank = divide(num_embeddings, tp.size, "vocabulary size")
        self.vocab_start_index = tp.rank * per_rank
        self.vocab_end_index = self.vocab_start_index + per_rank
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim, device=device,
                                               dtype=dtype))
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        initialize_shard(self.weight, (self.num_embeddings, self.embedding_dim), 0, 1,
                          self.init_method, self.tp, self.init_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
        local = (ids - self.vocab_start_index).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(out, self.tp)

    def logits_flops(self, tokens: int) -> int:
        """FLOPs of `parallel_lm_logits` against this table (a lookup itself costs none)."""
        return 2 * self.embedding_dim * self.num_embeddings * tokens

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} "
                f"(rows {self.vocab_start_index}-{self.vocab_end_index - 1} here)")


def parallel_lm_logits(hidden: torch.Tensor, embedding: VocabParallelEmbedding) -> torch.Tensor:
    """Logits of this rank's vocabulary slice against a (tied) vocab-parallel embedding."""
    return F.linear(copy_to_tensor_model_parallel_region(hidden, embedding.tp), embedding.weight)

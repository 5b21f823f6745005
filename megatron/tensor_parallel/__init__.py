"""Tensor parallelism: sharded layers, autograd collectives, vocab-parallel loss, RNG tracker."""

from megatron.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.tensor_parallel.group import SINGLE, TensorParallel
from megatron.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    parallel_lm_logits,
    set_tensor_model_parallel_attributes,
    shard,
)
from megatron.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.tensor_parallel.random import (
    checkpoint,
    get_cuda_rng_tracker,
    model_parallel_seed,
)

__all__ = [
    "SINGLE", "TensorParallel",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "parallel_lm_logits",
    "set_tensor_model_parallel_attributes", "shard", "vocab_parallel_cross_entropy",
    "copy_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region", "scatter_to_tensor_model_parallel_region",
    "checkpoint", "get_cuda_rng_tracker", "model_parallel_seed",
]

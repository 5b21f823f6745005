"""The model of a layout, built on the meta device: the one source of parameter shapes and counts.

`meta_model(config, divisor, tp_size, tp_rank, ep_size, ep_rank)` is the T5Model that tensor rank
`tp_rank` (expert-parallel rank `ep_rank`) of a run with `tp_size` tensor-parallel ranks (and its
experts over `ep_size` ranks) builds, without memory, initialization or process
groups, cached per layout. Everything that counts or shapes parameters reads it: --dry-run's
counts and memory, the planner, the conversion tool's expected shapes, the checkpoint readers'
split rules. A new layer kind is therefore counted the moment the model builds it.
"""

from __future__ import annotations

import functools
import json
from typing import Dict, Tuple

from megatron.model.config import T5Config
from megatron.model.t5 import T5Model
from megatron.tensor_parallel.group import ExpertParallel, TensorParallel


def meta_model(config: T5Config, make_vocab_size_divisible_by: int = 128,
               tensor_parallel_size: int = 1, tensor_parallel_rank: int = 0,
               expert_parallel_size: int = 1, expert_parallel_rank: int = 0) -> T5Model:
    """Tensor rank `tensor_parallel_rank`'s model on the meta device (cached: do not modify it).

    Raises:
        ConfigError: the config cannot be split over `tensor_parallel_size` ranks (or its
            experts over `expert_parallel_size`).
    """
    return _built(_key(config), make_vocab_size_divisible_by, tensor_parallel_size,
                  tensor_parallel_rank, expert_parallel_size, expert_parallel_rank)


def _key(config: T5Config) -> str:
    return json.dumps(config.to_dict(), sort_keys=True)


@functools.lru_cache(maxsize=16)
def _built(config_json: str, divisor: int, size: int, rank: int, ep_size: int = 1,
           ep_rank: int = 0) -> T5Model:
    return T5Model(T5Config.from_dict(json.loads(config_json)), divisor, device="meta",
                   tensor_parallel=TensorParallel(size, rank),
                   expert_parallel=ExpertParallel(ep_size, ep_rank))


def parameter_numels(config: T5Config, tensor_parallel_size: int = 1,
                     make_vocab_size_divisible_by: int = 128,
                     expert_parallel_size: int = 1) -> Dict[str, int]:
    """Elements of each parameter on one tensor rank (every rank holds as many), in the model's
    order and by its names.

    Raises:
        ConfigError: heads or d_ff do not divide by tensor_parallel_size.
    """
    return dict(_numels(_key(config), make_vocab_size_divisible_by, tensor_parallel_size,
                        expert_parallel_size))


@functools.lru_cache(maxsize=64)
def _numels(config_json: str, divisor: int, size: int, ep_size: int = 1
            ) -> Tuple[Tuple[str, int], ...]:
    # cached apart from the model: the planner asks for thousands of layouts' counts
    return tuple((name, p.numel()) for name, p in
                 _built(config_json, divisor, size, 0, ep_size).named_parameters())


def count_parameters(config: T5Config, tensor_parallel_size: int = 1,
                     make_vocab_size_divisible_by: int = 128,
                     expert_parallel_size: int = 1) -> int:
    """Parameters held by one tensor rank (layer norms are whole on every rank)."""
    return sum(parameter_numels(config, tensor_parallel_size, make_vocab_size_divisible_by,
                                expert_parallel_size).values())


def is_expert_parameter(name: str) -> bool:
    """A parameter of the experts (split over expert-parallel ranks), by its name."""
    return ".mlp.experts." in name


def active_parameters(config: T5Config, divisible_by: int = 1,
                      tensor_parallel_size: int = 1) -> int:
    """The parameters one token runs through: all but the experts it is not routed to (k of
    each sparse layer's experts count)."""
    total = 0
    for name, n in parameter_numels(config, 1, divisible_by * tensor_parallel_size).items():
        total += n * config.router_k // config.num_experts if is_expert_parameter(name) else n
    return total


def num_parameters(config: T5Config, divisible_by: int = 1, tensor_parallel_size: int = 1
                   ) -> int:
    """All parameters of the unsharded model, its embedding padded as a run of
    `tensor_parallel_size` tensor ranks pads it (to a multiple of divisible_by x TP)."""
    return count_parameters(config, 1, divisible_by * tensor_parallel_size)


def parameter_splits(config: T5Config) -> Dict[str, Tuple[Tuple[int, ...],
                                                          Tuple[int, int] | None]]:
    """{name: (full unpadded shape, (dim, stride) of its tensor-parallel split, or None for a
    weight every tensor rank holds whole)} in the model's order: the layers' own split rules
    (tensor_parallel/layers.py)."""
    out = {}
    for name, param in meta_model(config, 1).named_parameters():
        split = (param.partition_dim, param.partition_stride) \
            if getattr(param, "tensor_model_parallel", False) else None
        out[name] = (tuple(param.shape), split)
    return out


def expert_parameters(config: T5Config) -> Tuple[str, ...]:
    """The names of the experts' stacked weights ([experts, ...], split over expert-parallel
    ranks along dim 0), in the model's order; empty for a dense model."""
    return tuple(name for name, param in meta_model(config, 1).named_parameters()
                 if getattr(param, "expert_parallel", False))


def buffer_shapes(config: T5Config) -> Dict[str, Tuple[int, ...]]:
    """Name -> shape of the persistent buffers (state that is not a parameter: the experts'
    routing biases of `moe_expert_bias`), whole on every rank; empty for most models."""
    model = meta_model(config, 1)
    params = dict(model.named_parameters())
    return {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=True).items()
            if name not in params}


def full_parameter_shapes(config: T5Config) -> Dict[str, Tuple[int, ...]]:
    """Name -> shape of every parameter of the full, unpadded model (our names, which are
    Hugging Face's without the tied copies), in the order the model lists them."""
    return {name: shape for name, (shape, _) in parameter_splits(config).items()}

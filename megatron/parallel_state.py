"""Tensor, pipeline and data-parallel process groups, and the rank arithmetic behind them.

Ranks are laid out as in Megatron-LM: tensor-parallel ranks vary fastest, then data-parallel,
then pipeline stages, so

    global_rank = pipeline_rank * (data_size * tensor_size) + data_rank * tensor_size + tensor_rank

and a tensor-parallel group is a run of consecutive ranks (one node's GPUs for TP <= 8). With
expert parallelism (`expert_model_parallel_size` EP, which divides the data-parallel size), each
data-parallel group is cut into runs of EP consecutive data ranks, the expert-parallel groups
(their all-to-all sends tokens to the ranks holding their experts), and the ranks holding the
same experts, data ranks equal modulo EP, form the expert-data-parallel groups (expert gradients
are averaged over those only). The
module itself can be handed to DeepSpeed as its `mpu`: it has the `get_model_parallel_*` and
`get_data_parallel_*` functions DeepSpeed calls, where the "model-parallel" group is tensor x
pipeline (DeepSpeed sums gradient norms over it) and the tensor-parallel getters name TP alone.

The groups are the only module-level state in the project; `destroy_model_parallel` clears them.
Works with any torch.distributed backend (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch.distributed as dist


@dataclass(frozen=True)
class Layout:
    """Sizes of the three parallel dimensions and where one global rank sits in them."""

    tensor_size: int
    pipeline_size: int
    data_size: int
    rank: int
    expert_size: int = 1

    @property
    def tensor_rank(self) -> int:
        return self.rank % self.tensor_size

    @property
    def data_rank(self) -> int:
        return (self.rank // self.tensor_size) % self.data_size

    @property
    def pipeline_rank(self) -> int:
        return self.rank // (self.tensor_size * self.data_size)

    def global_rank(self, tensor_rank: int, data_rank: int, pipeline_rank: int) -> int:
        return (pipeline_rank * self.data_size + data_rank) * self.tensor_size + tensor_rank

    def tensor_group_ranks(self) -> List[List[int]]:
        return [[self.global_rank(t, d, p) for t in range(self.tensor_size)]
                for p in range(self.pipeline_size) for d in range(self.data_size)]

    def data_group_ranks(self) -> List[List[int]]:
        return [[self.global_rank(t, d, p) for d in range(self.data_size)]
                for p in range(self.pipeline_size) for t in range(self.tensor_size)]

    @property
    def expert_rank(self) -> int:
        return self.data_rank % self.expert_size

    @property
    def expert_data_rank(self) -> int:
        return self.data_rank // self.expert_size

    def expert_group_ranks(self) -> List[List[int]]:
        return [[self.global_rank(t, d, p) for d in range(start, start + self.expert_size)]
                for p in range(self.pipeline_size) for t in range(self.tensor_size)
                for start in range(0, self.data_size, self.expert_size)]

    def expert_data_group_ranks(self) -> List[List[int]]:
        return [[self.global_rank(t, d, p)
                 for d in range(offset, self.data_size, self.expert_size)]
                for p in range(self.pipeline_size) for t in range(self.tensor_size)
                for offset in range(self.expert_size)]

    def pipeline_group_ranks(self) -> List[List[int]]:
        return [[self.global_rank(t, d, p) for p in range(self.pipeline_size)]
                for d in range(self.data_size) for t in range(self.tensor_size)]

    def model_group_ranks(self) -> List[List[int]]:
        return [[self.global_rank(t, d, p) for p in range(self.pipeline_size)
                 for t in range(self.tensor_size)] for d in range(self.data_size)]


def make_layout(world_size: int, rank: int, tensor_size: int, pipeline_size: int,
                expert_size: int = 1) -> Layout:
    """The layout of `world_size` ranks; raises ValueError when the sizes do not divide it."""
    if tensor_size < 1 or pipeline_size < 1:
        raise ValueError(f"tensor ({tensor_size}) and pipeline ({pipeline_size}) model-parallel "
                         "sizes must be at least 1")
    if world_size % (tensor_size * pipeline_size):
        raise ValueError(f"world size {world_size} is not divisible by tensor-model-parallel size "
                         f"{tensor_size} x pipeline-model-parallel size {pipeline_size}")
    data_size = world_size // (tensor_size * pipeline_size)
    if expert_size < 1 or data_size % expert_size:
        raise ValueError(f"expert-model-parallel size {expert_size} does not divide the "
                         f"data-parallel size {data_size}")
    return Layout(tensor_size, pipeline_size, data_size, rank, expert_size)


class _Groups:
    """This process's groups; one instance lives in `_STATE` while model parallelism is set up."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.tensor = self.data = self.pipeline = self.model = None
        self.expert = self.expert_data = None
        self.tensor_ranks = self.data_ranks = self.pipeline_ranks = self.model_ranks = []
        self.expert_ranks = self.expert_data_ranks = []
        kinds = ["tensor", "data", "pipeline", "model"]
        if layout.expert_size > 1:
            kinds += ["expert", "expert_data"]
        # Every rank must call new_group for every group, in the same order.
        for kind in kinds:
            for ranks in getattr(layout, f"{kind}_group_ranks")():
                group = dist.new_group(ranks)
                if layout.rank in ranks:
                    setattr(self, kind, group)
                    setattr(self, f"{kind}_ranks", ranks)


_STATE: Optional[_Groups] = None


def initialize_model_parallel(tensor_model_parallel_size: int = 1,
                              pipeline_model_parallel_size: int = 1,
                              expert_model_parallel_size: int = 1) -> None:
    """Create the groups for this process. torch.distributed must be initialized.

    Raises:
        RuntimeError: torch.distributed is not initialized or groups already exist.
        ValueError: the sizes do not divide the world size.
    """
    global _STATE
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call "
                           "torch.distributed.init_process_group first")
    if _STATE is not None:
        raise RuntimeError("model parallelism is already initialized; call "
                           "destroy_model_parallel() first")
    layout = make_layout(dist.get_world_size(), dist.get_rank(), tensor_model_parallel_size,
                         pipeline_model_parallel_size, expert_model_parallel_size)
    _STATE = _Groups(layout)


def model_parallel_is_initialized() -> bool:
    return _STATE is not None


def destroy_model_parallel() -> None:
    """Forget the groups (and destroy them, while the default group is still alive)."""
    global _STATE
    if _STATE is not None and dist.is_initialized():
        seen = set()
        for group in (_STATE.tensor, _STATE.data, _STATE.pipeline, _STATE.model, _STATE.expert,
                      _STATE.expert_data):
            if group is not None and id(group) not in seen:
                seen.add(id(group))
                dist.destroy_process_group(group)
    _STATE = None


def _state() -> _Groups:
    if _STATE is None:
        raise RuntimeError("model parallelism is not initialized: call "
                           "megatron.parallel_state.initialize_model_parallel first")
    return _STATE


def get_layout() -> Layout:
    return _state().layout


# Tensor model parallel.
def get_tensor_model_parallel_group():
    return _state().tensor


def get_tensor_model_parallel_world_size() -> int:
    """1 when model parallelism is not initialized, so single-process code needs no setup."""
    return _STATE.layout.tensor_size if _STATE is not None else 1


def get_tensor_model_parallel_rank() -> int:
    return _STATE.layout.tensor_rank if _STATE is not None else 0


def get_tensor_model_parallel_src_rank() -> int:
    """The global rank of tensor-parallel rank 0 in this rank's tensor group."""
    return _state().tensor_ranks[0]


# Pipeline model parallel.
def get_pipeline_model_parallel_group():
    return _state().pipeline


def get_pipeline_model_parallel_world_size() -> int:
    return _STATE.layout.pipeline_size if _STATE is not None else 1


def get_pipeline_model_parallel_rank() -> int:
    return _STATE.layout.pipeline_rank if _STATE is not None else 0


def get_pipeline_model_parallel_first_rank() -> int:
    return _state().pipeline_ranks[0]


def get_pipeline_model_parallel_last_rank() -> int:
    return _state().pipeline_ranks[-1]


def get_pipeline_model_parallel_next_rank() -> int:
    ranks = _state().pipeline_ranks
    return ranks[(get_pipeline_model_parallel_rank() + 1) % len(ranks)]


def get_pipeline_model_parallel_prev_rank() -> int:
    ranks = _state().pipeline_ranks
    return ranks[(get_pipeline_model_parallel_rank() - 1) % len(ranks)]


def is_pipeline_first_stage() -> bool:
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage() -> bool:
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


# Data parallel.
def get_data_parallel_group():
    return _state().data


def get_data_parallel_world_size() -> int:
    return _STATE.layout.data_size if _STATE is not None else 1


def get_data_parallel_rank() -> int:
    return _STATE.layout.data_rank if _STATE is not None else 0


def get_data_parallel_src_rank() -> int:
    """The global rank of data-parallel rank 0 in this rank's data group."""
    return _state().data_ranks[0]


# Expert parallel: a run of EP data ranks (the all-to-all), and the ranks holding the same experts.
def get_expert_model_parallel_world_size() -> int:
    return _STATE.layout.expert_size if _STATE is not None else 1


def get_expert_model_parallel_rank() -> int:
    return _STATE.layout.expert_rank if _STATE is not None else 0


def get_expert_model_parallel_group():
    """None with one expert-parallel rank (the all-to-all is then the identity)."""
    return _state().expert


def get_expert_model_parallel_ranks() -> List[int]:
    return _state().expert_ranks if _state().layout.expert_size > 1 else [_state().layout.rank]


def get_expert_data_parallel_world_size() -> int:
    return get_data_parallel_world_size() // get_expert_model_parallel_world_size()


def get_expert_data_parallel_rank() -> int:
    return _STATE.layout.expert_data_rank if _STATE is not None else 0


def get_expert_data_parallel_group():
    """The ranks holding this rank's experts (the data-parallel group itself without EP)."""
    state = _state()
    return state.expert_data if state.layout.expert_size > 1 else state.data


def get_expert_data_parallel_ranks() -> List[int]:
    state = _state()
    return state.expert_data_ranks if state.layout.expert_size > 1 else state.data_ranks


# Model parallel = tensor x pipeline: the group over which DeepSpeed sums gradient norms.
def get_model_parallel_group():
    return _state().model


def get_model_parallel_world_size() -> int:
    return get_tensor_model_parallel_world_size() * get_pipeline_model_parallel_world_size()


def get_model_parallel_rank() -> int:
    """This rank's index in the model-parallel group (pipeline-major, tensor fastest)."""
    return (get_pipeline_model_parallel_rank() * get_tensor_model_parallel_world_size()
            + get_tensor_model_parallel_rank())

"""A layer's share of tensor (and expert) parallelism, handed to it when it is built.

Layers, the model and the collectives between them take a `TensorParallel`: how many ranks split
the layer, which of them this one is, and the process group their collectives run on. Nothing
below the model's top-level constructor reads the global `megatron.parallel_state`, so any rank's
model of any layout can be built in a process without process groups (on the meta device: for
shapes, counts and memory; `group` is then None and the layers cannot run forward with
`size` > 1). With `size` 1 the same classes are plain math.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from megatron import parallel_state


@dataclass(frozen=True)
class _Share:
    """size: ranks that split something; rank: this one, in [0, size); group: their process
    group (None with one rank, or for a model built without processes)."""

    size: int = 1
    rank: int = 0
    group: Optional[Any] = None
    kind = "parallel"  # (not a field: the error's word)

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"{self.kind} rank {self.rank} of size {self.size}")


@dataclass(frozen=True)
class TensorParallel(_Share):
    """A layer split over `size` tensor-parallel ranks (`_Share`)."""

    kind = "tensor-parallel"

    @classmethod
    def of_this_process(cls) -> "TensorParallel":
        """This process's share from `megatron.parallel_state` (one rank when its groups are not
        initialized). For entry points and the default of top-level constructors only."""
        if not parallel_state.model_parallel_is_initialized():
            return cls()
        return cls(parallel_state.get_tensor_model_parallel_world_size(),
                   parallel_state.get_tensor_model_parallel_rank(),
                   parallel_state.get_tensor_model_parallel_group())


SINGLE = TensorParallel()
"""One rank: plain math."""


@dataclass(frozen=True)
class ExpertParallel(_Share):
    """The experts of a Mixture-of-Experts layer split over `size` ranks of the data-parallel
    group (rank `rank` holds experts [rank * E / size, (rank + 1) * E / size)); `group` runs the
    all-to-all that sends tokens to their experts."""

    kind = "expert-parallel"

    @classmethod
    def of_this_process(cls) -> "ExpertParallel":
        """This process's share from `megatron.parallel_state` (one rank when its groups are not
        initialized). For entry points and the default of top-level constructors only."""
        if not parallel_state.model_parallel_is_initialized():
            return cls()
        return cls(parallel_state.get_expert_model_parallel_world_size(),
                   parallel_state.get_expert_model_parallel_rank(),
                   parallel_state.get_expert_model_parallel_group())


NO_EXPERT_PARALLEL = ExpertParallel()
"""Every expert on this rank."""

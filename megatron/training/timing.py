"""Wall time of the training step's named ranges, for benchmarks and tools.

The ranges are the profiler's (megatron/training/profiling.py lists them: forward, backward,
optimizer-step, comm:grad-reduce, the pipeline engine's instructions, ...). A tool that wants
their times hands its listeners to the run it starts in its own process:

    from megatron.training import timing

    class Times(timing.RangeListener):
        def closed(self, name, seconds, nbytes):
            ...

    pretrain_t5.main(argv, listeners=[Times()])

The run's StepProfiler owns them (nothing here is kept for the process: a run started without
listeners has none) and times every range on every rank, inside or outside a --profile window: `attach(step)` is told the TrainStep once (its engine and model, e.g. to read
the MoE layers' statistics), `opened(name)` and `closed(name, seconds, nbytes)` each range as it
starts and ends (nbytes: what the call site says the range moved, e.g. the all-to-all's input;
0 elsewhere). Without listeners the ranges stay the shared null context: no cost.
"""

from __future__ import annotations

import time
from typing import Callable, ContextManager, Sequence


class RangeListener:
    """What a listener may override; every method does nothing by default."""

    def attach(self, step) -> None:
        """The run's TrainStep (megatron/training/step.py or pipeline_step.py), once, before
        the first step."""

    def opened(self, name: str) -> None:
        """The range `name` starts."""

    def closed(self, name: str, seconds: float, nbytes: int) -> None:
        """The range `name` ended after `seconds` of wall time."""


class _TimedRange:
    """One timed range: the inner context (the profiler's record_function, or none) inside a
    clock."""

    __slots__ = ("owner", "name", "nbytes", "inner", "began")

    def __init__(self, owner: "TimedRanges", name: str, nbytes: int) -> None:
        self.owner, self.name, self.nbytes = owner, name, nbytes
        self.inner = owner.inner(name)

    def __enter__(self):
        for listener in self.owner.listeners:
            listener.opened(self.name)
        self.inner.__enter__()
        self.began = time.perf_counter()
        return self

    def __exit__(self, *exc) -> bool:
        seconds = time.perf_counter() - self.began
        self.inner.__exit__(*exc)
        for listener in self.owner.listeners:
            listener.closed(self.name, seconds, self.nbytes)
        return False


class TimedRanges:
    """ranges(name, nbytes=0) that tells `listeners` the wall time of each range, around the
    ranges of `inner` (profiling.no_range, or the profiler's recorded ones)."""

    def __init__(self, listeners: Sequence[RangeListener],
                 inner: Callable[[str], ContextManager]) -> None:
        self.listeners, self.inner = tuple(listeners), inner

    def __call__(self, name: str, nbytes: int = 0) -> ContextManager:
        return _TimedRange(self, name, nbytes)

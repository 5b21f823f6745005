"""Range timing (megatron/training/timing.py): a listener handed to a run's profiler is told the
step, every range's wall time and bytes, on an unprofiled rank too; the model's modules that
declare `ranges` get the step's; without listeners the ranges stay the shared null context, and a
profiler built without listeners has none, whatever other runs of the process were given."""

import time

import torch

from megatron.training import timing
from megatron.training.profiling import GRAD_REDUCE, NO_RANGE, StepProfiler, no_range


class Record(timing.RangeListener):
    def __init__(self):
        self.events, self.steps = [], []

    def attach(self, step):
        self.steps.append(step)

    def opened(self, name):
        self.events.append(("open", name))

    def closed(self, name, seconds, nbytes):
        self.events.append(("close", name, seconds, nbytes))


class WithRanges(torch.nn.Module):
    ranges = staticmethod(no_range)


class Engine:
    def __init__(self):
        self.module = torch.nn.Sequential(WithRanges(), torch.nn.Linear(2, 2))
        self.reduced = 0

    def allreduce_gradients(self):
        self.reduced += 1
        return "reduced"


class Step:
    ranges = staticmethod(no_range)

    def __init__(self):
        self.engine = Engine()


def test_a_runs_listener_times_every_range_of_the_run():
    record = Record()
    profiler = StepProfiler(listeners=[record])  # --profile off: the listeners alone
    assert profiler.listeners == (record,) and StepProfiler().listeners == ()
    step = Step()
    profiler.instrument(step)
    assert record.steps == [step]
    with step.ranges("forward"):
        time.sleep(0.02)
    with step.engine.module[0].ranges("comm:all-to-all", 96):
        pass
    assert step.engine.allreduce_gradients() == "reduced" and step.engine.reduced == 1
    opened = [e[1] for e in record.events if e[0] == "open"]
    closed = [e[1:] for e in record.events if e[0] == "close"]
    assert opened == ["forward", "comm:all-to-all", GRAD_REDUCE]
    assert [c[0] for c in closed] == opened
    assert closed[0][1] >= 0.02 and closed[0][2] == 0
    assert closed[1][2] == 96
    assert not hasattr(step.engine.module[1], "ranges")


def test_without_listeners_an_unprofiled_step_is_untouched():
    StepProfiler(listeners=[Record()])  # another run's: not this one's
    profiler = StepProfiler()
    step = Step()
    profiler.instrument(step)
    assert profiler.ranges("forward") is NO_RANGE and profiler.ranges("a", 8) is NO_RANGE
    assert step.ranges is no_range and step.engine.module[0].ranges is no_range
    assert step.engine.allreduce_gradients.__func__ is Engine.allreduce_gradients

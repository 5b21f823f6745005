"""Profiler traces of chosen steps: `--profile --profile-step-start N --profile-step-end M
[--profile-ranks R ...]`.

On each chosen rank, torch.profiler records from the step boundary at iteration N to the one at
iteration M (the steps logged as iterations N+1 ... M, as in Megatron-LM: iterations are the
run's own counter, so a resumed run profiles the part of the window still ahead of it) and
writes one Chrome trace, `SAVE/profile/rank<R>.<time in ns>.pt.trace.json`: the name and format
of `torch.profiler.tensorboard_trace_handler`, so TensorBoard's profiler plugin reads the folder
(`tensorboard --logdir SAVE/profile`) and chrome://tracing or Perfetto open the file. CPU
activity always, CUDA kernels on CUDA; each step is a `ProfilerStep#<iteration>` span.

Named ranges (torch.profiler.record_function), cheap enough to stay in the code; with the
profiler off, or outside the window, `ranges(name)` is a shared null context:

    data-wait             the loop waits for the next micro-batch from the loader
    forward / backward    DeepSpeed's engine forward and backward (one per micro-batch)
    optimizer-step        the engine step at the accumulation boundary (the update)
    comm:grad-reduce      DeepSpeed's `allreduce_gradients` (the data-parallel gradient
                          reduction: all of it under ZeRO 0/1; under ZeRO 2/3 its end, the rest
                          runs in gradient hooks inside `backward`, visible as the collectives)
    comm:loss-all-reduce  the log boundary's all-reduce of the step losses
    comm:stop-all-reduce  the per-step all-reduce that agrees on stopping (and checks for NaN)
    checkpoint-save       a checkpoint save (an asynchronous one: its blocking part)
    evaluation            an evaluation inside the window
    pipeline-train-batch  (pipeline) DeepSpeed's train_batch: the whole 1F1B schedule; inside
                          it each instruction has its range: forward, backward, optimizer-step,
                          comm:grad-reduce, comm:tied-grad-reduce, comm:send-activations,
                          comm:recv-activations, comm:send-grads, comm:recv-grads,
                          pipeline:load-micro-batch (with data-wait inside on the first and
                          last stage)
    comm:pipeline-sums    (pipeline) the all-reduce of the step's loss and token counts
    train-step            (once megatron/training/loop.py opens it) one whole training step
    comm:all-to-all       (once megatron/model/moe.py opens it) an expert-parallel all-to-all:
                          the counts' exchange, the rows there and back, forward and backward

A call site may give a range its bytes, `ranges(name, nbytes)`: the profiler ignores them, the
timing listeners (megatron/training/timing.py) get them. Given listeners, every rank
times its ranges (the profiler's recording still only in the window of a profiled rank).

DeepSpeed is reached without patching its classes: the engine's `allreduce_gradients` and the
pipeline engine's instruction table are replaced on the one engine instance, and only on a
profiled or timed rank. The model's modules whose class declares `ranges` (the MoE layers) get
the step's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from pathlib import Path
from typing import Callable, ContextManager, List, Mapping, Optional, Sequence

from megatron import deepspeed_internals
from megatron.config.training import ProfileConfig
from megatron.training import timing

DATA_WAIT = "data-wait"
FORWARD = "forward"
BACKWARD = "backward"
OPTIMIZER_STEP = "optimizer-step"
GRAD_REDUCE = "comm:grad-reduce"
LOSS_ALL_REDUCE = "comm:loss-all-reduce"
STOP_ALL_REDUCE = "comm:stop-all-reduce"
CHECKPOINT_SAVE = "checkpoint-save"
EVALUATION = "evaluation"
PIPELINE_BATCH = "pipeline-train-batch"
PIPELINE_SUMS = "comm:pipeline-sums"
TRAIN_STEP = "train-step"
ALL_TO_ALL = "comm:all-to-all"

PIPELINE_INSTRUCTIONS = {
    "ForwardPass": FORWARD,
    "BackwardPass": BACKWARD,
    "OptimizerStep": OPTIMIZER_STEP,
    "ReduceGrads": GRAD_REDUCE,
    "ReduceTiedGrads": "comm:tied-grad-reduce",
    "SendActivation": "comm:send-activations",
    "RecvActivation": "comm:recv-activations",
    "SendGrad": "comm:send-grads",
    "RecvGrad": "comm:recv-grads",
    "LoadMicroBatch": "pipeline:load-micro-batch",
}
"""DeepSpeed's pipeline instructions (class names) -> our range names."""

NO_RANGE = contextlib.nullcontext()
"""What `ranges` gives when nothing is recorded (reusable: nullcontext keeps no state)."""

Ranges = Callable[..., ContextManager]
"""ranges(name) or ranges(name, nbytes): a context around the named part of a step."""


def no_range(name: str, nbytes: int = 0) -> ContextManager:
    """The ranges of an unprofiled, untimed step: nothing."""
    return NO_RANGE


def add_profile_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("profiling")
    g.add_argument("--profile", action="store_true",
                   help="write a torch profiler trace (Chrome trace JSON, read by TensorBoard's "
                        "profiler plugin) of the steps from --profile-step-start to "
                        "--profile-step-end into SAVE/profile/ on each of --profile-ranks")
    g.add_argument("--profile-step-start", type=int, default=None, metavar="N",
                   help="start recording after iteration N (default 10; 0: from the first "
                        "step)")
    g.add_argument("--profile-step-end", type=int, default=None, metavar="M",
                   help="stop after iteration M and write the trace (default 12): the trace "
                        "holds the steps logged as iterations N+1 ... M")
    g.add_argument("--profile-ranks", type=int, nargs="+", default=None, metavar="RANK",
                   help="global ranks that record a trace (default: 0)")


def profile_problems(values: Mapping[str, object], world_size: int) -> List[str]:
    """What is wrong with the profiling flags (`values`: the parsed flags, --train-iters
    resolved from --train-samples where that was given)."""
    start, end, ranks = (values["profile_step_start"], values["profile_step_end"],
                         values["profile_ranks"])
    if not values["profile"]:
        return [f"--{flag.replace('_', '-')} has effect only with --profile"
                for flag in ("profile_step_start", "profile_step_end", "profile_ranks")
                if values[flag] is not None]
    problems = []
    if values["save"] is None or "://" in str(values["save"]):
        problems.append("--profile writes its traces into SAVE/profile/: give a local --save")
    start_flag = f"--profile-step-start {start}" if start is not None else \
        f"--profile-step-start {ProfileConfig.step_start} (the default)"
    end_flag = f"--profile-step-end {end}" if end is not None else \
        f"--profile-step-end {ProfileConfig.step_end} (the default)"
    start = ProfileConfig.step_start if start is None else start
    end = ProfileConfig.step_end if end is None else end
    if start < 0:
        problems.append(f"{start_flag} must be 0 or more")
    if start >= end:
        problems.append(f"{start_flag} must be less than {end_flag} (the trace holds "
                        f"iterations start+1 ... end)")
    train_iters = values.get("train_iters")
    if isinstance(train_iters, int) and end > train_iters:
        problems.append(f"{end_flag} is past the run's last iteration (--train-iters "
                        f"{train_iters})")
    for rank in ranks or ():
        if not 0 <= rank < world_size:
            problems.append(f"--profile-ranks {rank} is not a rank of this job of {world_size} "
                            f"process{'es' if world_size > 1 else ''} (0 ... {world_size - 1})")
    return problems


def profile_config(values: Mapping[str, object]) -> ProfileConfig:
    """The validated flags as a ProfileConfig."""
    if not values["profile"]:
        return ProfileConfig()
    default = ProfileConfig()
    start, end, ranks = (values["profile_step_start"], values["profile_step_end"],
                         values["profile_ranks"])
    return ProfileConfig(True, default.step_start if start is None else start,
                         default.step_end if end is None else end,
                         default.ranks if ranks is None else tuple(sorted(set(ranks))),
                         str(Path(str(values["save"])) / "profile"))


class StepProfiler:
    """Records the profiled window on this rank; a no-op elsewhere.

    The loop calls `boundary(iteration)` before every step with the number of steps done, and
    `finish()` when it ends (also early: an exit condition, an error); the steps call `ranges`.

    Args:
        config: the profiling settings.
        rank: this process's global rank.
        device_type: 'cuda' adds CUDA activity to the CPU's.
        log: where a line about the trace goes (rank 0's writer; print elsewhere).
        listeners: the range timers (megatron/training/timing.py) of this run; none by
            default.
    """

    def __init__(self, config: Optional[ProfileConfig] = None, rank: int = 0,
                 device_type: str = "cpu", log: Callable[[str], None] = print,
                 listeners: Sequence[timing.RangeListener] = ()) -> None:
        config = config or ProfileConfig()
        self.config = config
        self.enabled = config.enabled and rank in config.ranks
        self.rank, self.device_type, self.log = rank, device_type, log
        self.listeners = tuple(listeners)
        self.path: Optional[Path] = None
        """The trace written (None until then)."""
        self._profiler = None
        self._first = 0
        self._done = not self.enabled
        self._range: Ranges = self._with_listeners(no_range)

    def ranges(self, name: str, nbytes: int = 0) -> ContextManager:
        """The named range `name`: recorded inside the window, a null context elsewhere;
        timed by the listeners, if any, everywhere."""
        return self._range(name, nbytes)

    def _with_listeners(self, ranges: Ranges) -> Ranges:
        return timing.TimedRanges(self.listeners, ranges) if self.listeners else ranges

    def _recorded_range(self, name: str, nbytes: int = 0) -> ContextManager:
        import torch

        return torch.profiler.record_function(name)

    def boundary(self, iteration: int) -> None:
        """The run has done `iteration` steps and is about to start the next."""
        if self._done:
            return
        start, end = self.config.step_start, self.config.step_end
        if self._profiler is None:
            if iteration >= end:
                self._done = True
                self.log(f"profile: the run starts at iteration {iteration}, past "
                         f"--profile-step-end {end}: no trace on rank {self.rank}")
            elif iteration >= start:
                self._start(iteration)
            return
        if iteration >= end:
            self.finish()
        else:
            self._profiler.step()

    def _start(self, iteration: int) -> None:
        import torch
        from torch.profiler import ProfilerAction, ProfilerActivity

        activities = [ProfilerActivity.CPU]
        if self.device_type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        # A schedule that always records: torch then marks each step as ProfilerStep#<n>
        # (TensorBoard's plugin splits the trace by them); no on_trace_ready, we export at stop.
        self._profiler = torch.profiler.profile(activities=activities,
                                                schedule=lambda _: ProfilerAction.RECORD,
                                                record_shapes=True)
        self._profiler.step_num = iteration + 1  # the iteration the next step is logged as
        self._first = iteration + 1
        self._profiler.start()
        self._range = self._with_listeners(self._recorded_range)

    def finish(self) -> Optional[Path]:
        """Stop recording (if recording) and write the trace; its path, or None."""
        if self._profiler is None:
            return self.path
        profiler, self._profiler = self._profiler, None
        self._range = self._with_listeners(no_range)
        self._done = True
        last = profiler.step_num
        profiler.stop()
        folder = Path(self.config.folder or ".")
        folder.mkdir(parents=True, exist_ok=True)
        # The name tensorboard_trace_handler gives: <worker>.<time in ns>.pt.trace.json
        path = folder / f"rank{self.rank}.{time.time_ns()}.pt.trace.json"
        partial = path.with_name(path.name + ".tmp")
        profiler.export_chrome_trace(str(partial))
        os.replace(partial, path)
        self.path = path
        self.log(f"profile: rank {self.rank} iterations {self._first}-{last} written to {path}")
        return path

    def instrument(self, step) -> None:
        """Give a TrainStep (megatron/training/step.py, megatron/training/pipeline_step.py) this
        profiler's ranges, and put ranges around DeepSpeed's gradient reduction (and, on a
        pipeline engine, around each instruction of its schedule), and to the model's modules
        whose class declares `ranges`. Only on a profiled or timed rank; the timing listeners
        are then told the step."""
        if not (self.enabled or self.listeners):
            return
        step.ranges = self.ranges
        for listener in self.listeners:
            listener.attach(step)
        engine = getattr(step, "engine", None)
        if engine is None:
            return
        model = getattr(engine, "module", None)
        for module in model.modules() if model is not None else ():
            if hasattr(type(module), "ranges"):  # e.g. the MoE layers' all-to-all
                module.ranges = self.ranges
        table = deepspeed_internals.pipeline_instructions(engine)
        if table is not None:  # DeepSpeed's PipelineEngine: its instructions, for this engine
            deepspeed_internals.set_pipeline_instructions(engine, {
                kind: _ranged(fn, PIPELINE_INSTRUCTIONS.get(kind.__name__, kind.__name__),
                              self.ranges)
                for kind, fn in table.items()})
        else:  # engine.backward / step call self.allreduce_gradients()
            reduce = engine.allreduce_gradients
            ranges = self.ranges

            def allreduce_gradients(*args, **kwargs):
                with ranges(GRAD_REDUCE):
                    return reduce(*args, **kwargs)

            engine.allreduce_gradients = allreduce_gradients


def _ranged(fn, name: str, ranges: Ranges):
    """fn(engine, **kwargs) inside the range `name`."""

    def run(engine, *args, **kwargs):
        with ranges(name):
            return fn(engine, *args, **kwargs)

    run.__name__ = getattr(fn, "__name__", name)
    return run

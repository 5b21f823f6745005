"""The training loop: steps, evaluation, logging, checkpoints and the exit conditions.

One step is one optimizer update over the global batch, run by a `TrainStep` (step.py) that
pulls this rank's micro-batches from the loader; the loop knows no engine. Step k uses
`schedule.lr(k)`, as Megatron's scheduler does. Losses stay on the device until a log boundary,
where one all-reduce over the data-parallel group turns them into the global per-step losses
(the loss of a step is the mean of its micro-batch losses, which is what the gradient is the
mean of).

Evaluation runs over the same first `eval_iters` global batches of the split each time, so the
numbers are comparable across evaluations and across a resume; its loss is the token-weighted
mean over all ranks.

After each step one all-reduce agrees on stopping: the exit conditions, the NaN guard (a loss or
gradient norm that is not finite) and the divergence guard's numbers (divergence.py). Either
guard stops the run with exit 1 before the step is saved; interval saves that the divergence
guard has not yet passed are held uncommitted and removed then (saver.py).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, Iterator, List, Optional

import torch
import torch.distributed as dist

from megatron import parallel_state
from megatron.config import RuntimeConfig
from megatron.failures import RunFailure
from megatron.training.layer_norms import write_layer_norms
from megatron.training.metrics import IntervalStats, MetricsWriter, Timer
from megatron.training.profiling import (CHECKPOINT_SAVE, DATA_WAIT, EVALUATION, LOSS_ALL_REDUCE,
                                         STOP_ALL_REDUCE, StepProfiler, no_range)
from megatron.config.training import BatchConfig, CheckpointConfig, LoggingConfig
from megatron.training.step import TrainStep
from megatron.training.watchdog import NoWatchdog


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0
    losses: Dict[int, float] = field(default_factory=dict)
    """iteration -> global loss of that step (filled at log boundaries)."""
    grad_norms: Dict[int, Optional[float]] = field(default_factory=dict)
    """iteration -> global gradient norm before clipping."""
    layer_grad_norms: Dict[int, Dict[str, float]] = field(default_factory=dict)
    """iteration -> {layer group: gradient norm before clipping} (--log-grad-norms-per-layer;
    logged iterations only)."""
    evaluations: List[tuple] = field(default_factory=list)
    """(iteration, split, loss)."""
    exit_reason: str = ""
    diverged: str = ""
    """Why the run stopped at a non-finite loss or gradient norm ('' while it has not)."""
    divergence: Optional[object] = None
    """The divergence guard's finding that stopped the run (divergence.Divergence)."""


@dataclass(frozen=True)
class StepCost:
    """What the metrics line needs to turn step times into throughput."""

    model_flops: float
    """Model FLOPs of one global batch (forward and backward)."""
    peak_tflops: Optional[float]
    """The device's peak, for MFU (None: not known)."""


def evaluate(step: TrainStep, batch_config: BatchConfig, runtime: RuntimeConfig,
             loader: Optional[Iterable], watchdog=None) -> Optional[float]:
    """Token-weighted mean loss over `eval_iters` global batches of `loader` (all ranks)."""
    if loader is None or batch_config.eval_iters == 0:
        return None
    watchdog = watchdog or NoWatchdog()
    collective_s = 60 * runtime.distributed_timeout_minutes
    data_s = 60 * runtime.data_timeout_minutes
    total = torch.zeros(2, dtype=torch.float64, device=runtime.torch_device())  # [loss sum, tokens]
    limit = batch_config.eval_iters * batch_config.gradient_accumulation_steps
    batches = iter(loader)
    step.train(False)
    for _ in range(limit):
        with watchdog.watch("data: the next evaluation batch from the data loader", data_s):
            batch = next(batches, None)
        if batch is None:
            break
        with watchdog.watch("an evaluation step (collectives with the other ranks)",
                            collective_s):
            result = step.eval_step(batch)
            total[0] += result.loss_sum
            total[1] += result.tokens
    step.train(True)
    with watchdog.watch("collective: the all-reduce of the evaluation loss", collective_s):
        dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
    return float(total[0] / total[1]) if total[1] > 0 else None


def _timed_batches(batches: Iterator, timer: Timer, watchdog, data_s: float,
                   ranges=no_range) -> Iterator:
    """The loader's batches, each fetch timed, watched and (when profiled) a range."""
    while True:
        timer.data_start()
        with watchdog.watch("data: the next training batch from the data loader", data_s), \
                ranges(DATA_WAIT):
            batch = next(batches)
        timer.data_end()
        yield batch


def train(step: TrainStep, batch_config: BatchConfig, logging: LoggingConfig,
          checkpoint: CheckpointConfig, runtime: RuntimeConfig, cost: StepCost, schedule,
          train_loader: Iterable, valid_loader, writer: MetricsWriter, state: TrainState,
          save: Callable[[TrainState, bool], None], signals=None, watchdog=None,
          saves=None, profiler: Optional[StepProfiler] = None) -> TrainState:
    """Run steps from state.iteration to batch_config.train_iters (or an exit condition).

    save: save(state, hold) writes a checkpoint of the state (called when checkpoint.save is
        set); hold: commit it only when `saves.confirm()` says so (the divergence guard judges
        a save's weights at the next step).
    saves: what else the checkpoint side needs from the loop (megatron/checkpoint/io/saver.py's
        Saver, or None): `poll()` at every step boundary without a save (an asynchronous save
        commits there, or warns that it failed), `confirm()` once the divergence guard passed
        the steps after the held saves, `discard()` when a guard stops the run, `finish()`
        before the loop returns (a final save that failed raises SaveFailed).

    Raises:
        NonFiniteError: the NaN guard stopped the run.
        DivergenceError: the divergence guard stopped the run (divergence.py).
    profiler: --profile's recorder (megatron/training/profiling.py): told each step boundary;
        its ranges mark data waits, the loop's collectives, evaluations and saves. Finished
        (its trace written) when the loop returns; when it raises, the caller finishes it."""
    from megatron.training.divergence import DivergenceGuard, WeightGrowth
    from megatron.checkpoint.io.saver import SaveFailed

    watchdog = watchdog or NoWatchdog()
    profiler = profiler or StepProfiler()
    ranges = profiler.ranges
    collective_s = 60 * runtime.distributed_timeout_minutes
    device = runtime.torch_device()
    train_iters = batch_config.train_iters
    dp_group = parallel_state.get_data_parallel_group()
    stats, timer = IntervalStats(), Timer()
    pending: List[tuple] = []  # (iteration, StepResult, step seconds, data-wait seconds)
    start_time = time.monotonic()
    batches = _timed_batches(iter(train_loader), timer, watchdog,
                             60 * runtime.data_timeout_minutes, ranges)
    loss_scale = 1.0
    divergence = checkpoint.divergence
    guard = DivergenceGuard(divergence)
    weights = WeightGrowth(step)
    if divergence.enabled and divergence.weight_growth > 0:
        weights.start()
    # a save's weights are judged by the next step's loss and gradient norm
    hold = saves is not None and divergence.judges_next_step

    def flush_logs():
        if not pending:
            return
        values = torch.stack([torch.stack([r.loss, r.input_tokens.double(),
                                           r.target_tokens.double()]) for _, r, _, _ in pending])
        with watchdog.watch("collective: the all-reduce of the step losses", collective_s), \
                ranges(LOSS_ALL_REDUCE):
            dist.all_reduce(values, group=dp_group)
        dp = parallel_state.get_data_parallel_world_size()
        for (iteration, result, step_s, wait_s), row in zip(pending, values.tolist()):
            loss = row[0] / dp
            state.losses[iteration] = loss
            state.grad_norms[iteration] = result.grad_norm
            stats.add_step(loss_sum=loss, loss_count=1, grad_norm=result.grad_norm,
                           skipped=result.skipped, input_tokens=int(row[1]),
                           target_tokens=int(row[2]), model_flops=cost.model_flops,
                           step_time_s=step_s, data_wait_s=wait_s)
        pending.clear()

    timer.reset()
    while state.iteration < train_iters:
        profiler.boundary(state.iteration)
        logged = (state.iteration + 1) % logging.log_interval == 0 \
            or state.iteration + 1 == train_iters
        if step.layer_grad_norms is not None and logged:
            step.layer_grad_norms.arm()
        with watchdog.watch("the training step (forward, backward, optimizer; collectives "
                            "with the other ranks)", collective_s):
            result = step.step(batches, schedule.lr(state.iteration))
        state.iteration += 1
        state.consumed_samples += batch_config.global_batch_size
        loss_scale = result.loss_scale
        step_s, wait_s = timer.step_end()
        pending.append((state.iteration, result, step_s, wait_s))

        last = state.iteration == train_iters
        if state.iteration % logging.log_interval == 0 or last:
            flush_logs()
            writer.write(stats.summary(state.iteration, state.consumed_samples,
                                       schedule.lr(state.iteration - 1), loss_scale,
                                       dist.get_world_size(), cost.peak_tflops))
            layer_norms = step.layer_grad_norms.take() \
                if step.layer_grad_norms is not None else None
            if layer_norms is not None:
                state.layer_grad_norms[state.iteration] = layer_norms
                write_layer_norms(writer, state.iteration, layer_norms)
        if batch_config.eval_interval and state.iteration % batch_config.eval_interval == 0 \
                and not last:
            with ranges(EVALUATION):
                loss = evaluate(step, batch_config, runtime, valid_loader, watchdog)
            if loss is not None:
                state.evaluations.append((state.iteration, "valid", loss))
                writer.write_eval(state.iteration, "valid", loss)
            timer.reset()
        signs = _divergence_signs(result, weights, divergence, device)
        with watchdog.watch("collective: the all-reduce that agrees on stopping",
                            collective_s), ranges(STOP_ALL_REDUCE):
            bad = _nonfinite(result, device) if checkpoint.check_for_nan else None
            exit_now = _exit_requested(runtime, train_iters, state, start_time, device, signals,
                                       bad, signs, guard)
        if state.diverged:
            flush_logs()
            from megatron.training.nan_locator import locate

            with watchdog.watch("the locator of non-finite values (the failing step again, "
                                "with collectives)", collective_s):
                where = locate(step, state.iteration, writer)
            message = (f"iteration {state.iteration}: {state.diverged}; {where}; "
                       + _stopping(checkpoint, saves, watchdog, state.iteration)
                       + " (lower the learning rate, or check the data; "
                       "--no-check-for-nan-in-loss-and-grad turns this check off)")
            raise NonFiniteError(message)  # reported once, for the job: megatron/failures.py
        if state.divergence is not None:
            flush_logs()
            from megatron.training.divergence import DivergenceError

            found = state.divergence
            if found.saves_before_passed and saves is not None:
                saves.confirm()  # this step's update blew up; the weights before it passed
            message = (f"iteration {state.iteration}: the run diverged ({found.check}): "
                       f"{found.seen} ({found.flag}); "
                       + _stopping(checkpoint, saves, watchdog, state.iteration)
                       + " (lower the learning rate or lengthen its warmup, and start "
                       "again: --load resumes from that checkpoint; if the run was healthy, "
                       "raise the threshold, or --no-check-for-divergence turns this guard "
                       "off)")
            raise DivergenceError(message)  # reported once, as above
        if saves is not None and not guard.unsure:
            saves.confirm()  # this step passed the checks that judge the saves before it
        saved = False
        if checkpoint.save and (last or exit_now or (checkpoint.save_interval and
                                                     state.iteration % checkpoint.save_interval
                                                     == 0)):
            flush_logs()
            final = last or exit_now  # no later step would judge (or commit) it
            with watchdog.watch(f"checkpoint I/O: saving iteration {state.iteration} to "
                                f"{checkpoint.save}", 60 * checkpoint.timeout_minutes), \
                    ranges(CHECKPOINT_SAVE):
                try:
                    save(state, hold and not final)
                    saved = True
                except SaveFailed as e:
                    if last or exit_now:  # nothing would try again
                        raise
                    writer.write_text(f"warning: {e}; trying again at the next save")
            timer.reset()
        elif saves is not None:
            saves.poll()
        if exit_now:
            flush_logs()
            if saves is not None:
                with watchdog.watch("checkpoint I/O: the last save's files", None):
                    saves.finish()
            writer.write_text(f" exiting at iteration {state.iteration}: {state.exit_reason}"
                              + (" (checkpoint saved)" if saved else ""))
            break
    flush_logs()
    if saves is not None:
        saves.confirm()
        saves.finish()
    profiler.finish()
    return state


class NonFiniteError(RunFailure):
    """A step's loss or gradient norm was NaN or infinite (the message names the iteration and
    the rank); raised on every rank, before anything is saved."""


def _nonfinite(result, device) -> torch.Tensor:
    """[world size - this rank if its loss is not finite else 0, the same for the gradient
    norm], on the device (no host sync: it joins the all-reduce that agrees on stopping, whose
    MAX then names the lowest such rank, the one whose line the locator reports first). An fp16
    step that overflowed was skipped by DeepSpeed and changed nothing: not counted."""
    rank = float(dist.get_world_size() - dist.get_rank())
    if result.skipped:
        return torch.zeros(2, device=device)
    loss_bad = (~torch.isfinite(result.loss.to(device))).double() * rank
    norm = result.grad_norm
    norm_bad = rank if norm is not None and not math.isfinite(norm) else 0.0
    return torch.stack([loss_bad, torch.tensor(norm_bad, dtype=torch.float64, device=device)])


def _divergence_signs(result, weights, divergence, device) -> Optional[torch.Tensor]:
    """This rank's entries of the stop all-reduce for the divergence guard (None: it is off)."""
    if not divergence.enabled:
        return None
    from megatron.training.divergence import local_signs

    growth = weights.update() if divergence.weight_growth > 0 else None
    return local_signs(result, growth, device)


def _stopping(checkpoint: CheckpointConfig, saves, watchdog, iteration: int) -> str:
    """What a guard's message says about checkpoints, after removing the held saves (every rank
    calls it: the removal is collective)."""
    if not checkpoint.save:
        return "stopping (no --save, so no checkpoint)"
    from pathlib import Path

    from megatron.checkpoint.io.checkpointing import read_tracker

    removed = []
    if saves is not None:
        with watchdog.watch("checkpoint I/O: removing the saves the guard had not passed", None):
            removed = saves.discard()
    tracked = read_tracker(Path(checkpoint.save))
    named = f"iteration {tracked}" if tracked is not None else "none yet"
    held = (f" (the held, uncommitted save{'s' if len(removed) > 1 else ''} of iteration"
            f"{'s' if len(removed) > 1 else ''} {', '.join(map(str, removed))} removed)"
            if removed else "")
    return (f"stopping without saving iteration {iteration}{held}, so the last checkpoint in "
            f"{checkpoint.save} stays the one its tracker names: {named}")


def _exit_requested(runtime: RuntimeConfig, train_iters: int, state: TrainState,
                    start_time: float, device, signals,
                    nonfinite: Optional[torch.Tensor] = None,
                    signs: Optional[torch.Tensor] = None, guard=None) -> bool:
    """Whether to stop after this step: --exit-interval, or (agreed by all ranks through one
    all-reduce, so that they save and leave together) --exit-duration-in-mins or a stop
    signal received by any rank. With `nonfinite` (see `_nonfinite`), the same all-reduce finds
    the lowest rank whose loss or gradient norm was not finite and sets state.diverged. With
    `signs` (divergence.local_signs), it agrees on the divergence guard's numbers, which
    `guard` then checks (every rank the same numbers: the same decision), setting
    state.divergence. The all-reduce runs at every step (also the last and --exit-interval's),
    so that every rank takes the same decision from the same flags."""
    from megatron.training.divergence import SIGNS, agreed_signs

    timed_out = runtime.exit_duration_in_mins is not None and \
        time.monotonic() - start_time > runtime.exit_duration_in_mins * 60
    signum = signals.received if signals is not None and signals.received is not None else 0
    flags = torch.zeros(4 + SIGNS, dtype=torch.float64, device=device)
    flags[0], flags[1] = float(timed_out), float(signum)
    if nonfinite is not None:
        flags[2:4] = nonfinite
    if signs is not None:
        flags[4:] = signs
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    values = flags.tolist()
    timed_out, signum, loss_rank, norm_rank = (int(v) for v in values[:4])
    if loss_rank or norm_rank:
        what = "the loss" if loss_rank else "the gradient norm"
        seen = dist.get_world_size() - (loss_rank or norm_rank)
        state.diverged = f"{what} is not finite (seen by rank {seen}" \
            + (", and the gradient norm too" if loss_rank and norm_rank else "") + ")"
        return True
    if signs is not None and guard is not None:
        state.divergence = guard.observe(state.iteration, agreed_signs(values[4:]))
        if state.divergence is not None:
            return True
    if state.iteration >= train_iters:
        return False
    if runtime.exit_interval and state.iteration % runtime.exit_interval == 0:
        state.exit_reason = f"--exit-interval {runtime.exit_interval}"
        return True
    if signum:
        import signal

        state.exit_reason = f"signal {signal.Signals(signum).name}"
        return True
    if timed_out:
        state.exit_reason = f"--exit-duration-in-mins {runtime.exit_duration_in_mins}"
        return True
    return False


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 20.0))

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
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron import parallel_state
from megatron.checkpoint.io.checkpointing import read_tracker
from megatron.checkpoint.io.saver import SaveFailed
from megatron.config import RuntimeConfig
from megatron.config.lr_schedule import LRSchedule
from megatron.config.training import BatchConfig, CheckpointConfig, LoggingConfig
from megatron.failures import RunFailure
from megatron.training import moe_metrics
from megatron.training.divergence import SIGNS, DivergenceError, DivergenceGuard, WeightGrowth, \
    agreed_signs, local_signs
from megatron.training.layer_norms import write_layer_norms
from megatron.training.metrics import IntervalStats, MetricsWriter, Timer
from megatron.training.nan_locator import locate
from megatron.training.profiling import (CHECKPOINT_SAVE, DATA_WAIT, EVALUATION, LOSS_ALL_REDUCE,
                                         STOP_ALL_REDUCE, StepProfiler, no_range)
from megatron.training.step import KIND_NAMES, TrainStep
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
    moe: Dict[int, Dict[str, Dict[str, float]]] = field(default_factory=dict)
    """Per logged iteration, each sparse layer's numbers (training/moe_metrics.py)."""
    denoiser_losses: Dict[int, Dict[str, Tuple[float, int]]] = field(default_factory=dict)
    """UL2: iteration -> {denoiser kind: (token-weighted loss, labelled tokens)} of that step,
    over all data-parallel ranks; kinds the step drew none of are absent."""
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


@dataclass
class LoopParts:
    """What the loop runs with, besides the state it advances.

    save: save(state, hold) writes a checkpoint of the state (called when checkpoint.save is
        set); hold: commit it only when `saves.confirm()` says so (the divergence guard judges
        a save's weights at the next step).
    saves: what else the checkpoint side needs from the loop (megatron/checkpoint/io/saver.py's
        Saver, or None): `poll()` at every step boundary without a save (an asynchronous save
        commits there, or warns that it failed), `confirm()` once the divergence guard passed
        the steps after the held saves, `discard()` when a guard stops the run, `finish()`
        before the loop returns (a final save that failed raises SaveFailed).
    profiler: --profile's recorder (megatron/training/profiling.py): told each step boundary;
        its ranges mark data waits, the loop's collectives, evaluations and saves. Finished
        (its trace written) when the loop returns; when it raises, the caller finishes it.
    """

    step: TrainStep
    batch: BatchConfig
    logging: LoggingConfig
    checkpoint: CheckpointConfig
    runtime: RuntimeConfig
    cost: StepCost
    schedule: LRSchedule
    train_loader: Iterable
    valid_loader: Optional[Iterable]
    writer: MetricsWriter
    save: Callable[[TrainState, bool], None]
    signals: Optional[object] = None
    watchdog: Optional[object] = None
    saves: Optional[object] = None
    profiler: Optional[StepProfiler] = None


def train(parts: LoopParts, state: TrainState) -> TrainState:
    """Run steps from state.iteration to the batch config's train_iters (or an exit condition).

    Raises:
        NonFiniteError: the NaN guard stopped the run.
        DivergenceError: the divergence guard stopped the run (divergence.py).
    """
    return _Loop(parts, state).run()


class _Loop:
    """One call of `train`: each step is the sequence of `run`'s named parts."""

    def __init__(self, parts: LoopParts, state: TrainState) -> None:
        self.p, self.state = parts, state
        self.watchdog = parts.watchdog or NoWatchdog()
        self.profiler = parts.profiler or StepProfiler()
        self.ranges = self.profiler.ranges
        self.collective_s = 60 * parts.runtime.distributed_timeout_minutes
        self.device = parts.runtime.torch_device()
        self.stats, self.timer = IntervalStats(), Timer()
        self.kind_interval = [[0.0, 0.0] for _ in KIND_NAMES]  # loss sum, tokens per kind
        self.pending: List[tuple] = []  # (iteration, StepResult, step seconds, data wait)
        self.start_time = time.monotonic()
        self.batches = _timed_batches(iter(parts.train_loader), self.timer, self.watchdog,
                                      60 * parts.runtime.data_timeout_minutes, self.ranges)
        self.loss_scale = 1.0
        divergence = parts.checkpoint.divergence
        self.guard = DivergenceGuard(divergence)
        self.weights = WeightGrowth(parts.step)
        if divergence.enabled and divergence.weight_growth > 0:
            self.weights.start()
        # a save's weights are judged by the next step's loss and gradient norm
        self.hold = parts.saves is not None and divergence.judges_next_step

    def run(self) -> TrainState:
        p, state = self.p, self.state
        self.timer.reset()
        while state.iteration < p.batch.train_iters:
            result = self._step()
            last = state.iteration == p.batch.train_iters
            if state.iteration % p.logging.log_interval == 0 or last:
                self._log()
            if p.batch.eval_interval and state.iteration % p.batch.eval_interval == 0 \
                    and not last:
                self._evaluate()
            exit_now = self._agree_on_stopping(result)
            self._stop_if_a_guard_fired()
            if p.saves is not None and not self.guard.unsure:
                p.saves.confirm()  # this step passed the checks that judge the saves before it
            saved = self._save_if_due(last, exit_now)
            if exit_now:
                self._flush_logs()
                if p.saves is not None:
                    with self.watchdog.watch("checkpoint I/O: the last save's files", None):
                        p.saves.finish()
                p.writer.write_text(f" exiting at iteration {state.iteration}: "
                                    f"{state.exit_reason}" + (" (checkpoint saved)" if saved
                                                              else ""))
                break
        self._flush_logs()
        if p.saves is not None:
            p.saves.confirm()
            p.saves.finish()
        self.profiler.finish()
        return state

    def _step(self):
        """One optimizer step, timed and watched; its result waits for the next log."""
        p, state = self.p, self.state
        self.profiler.boundary(state.iteration)
        logged = (state.iteration + 1) % p.logging.log_interval == 0 \
            or state.iteration + 1 == p.batch.train_iters
        if p.step.layer_grad_norms is not None and logged:
            p.step.layer_grad_norms.arm()
        with self.watchdog.watch("the training step (forward, backward, optimizer; "
                                 "collectives with the other ranks)", self.collective_s):
            result = p.step.step(self.batches, p.schedule.lr(state.iteration))
        state.iteration += 1
        state.consumed_samples += p.batch.global_batch_size
        self.loss_scale = result.loss_scale
        step_s, wait_s = self.timer.step_end()
        self.pending.append((state.iteration, result, step_s, wait_s))
        return result

    def _flush_logs(self) -> None:
        """The pending steps' global losses (one all-reduce) into the state and the stats."""
        if not self.pending:
            return
        kinds = len(KIND_NAMES)
        values = torch.stack([torch.cat([torch.stack([r.loss, r.input_tokens.double(),
                                                      r.target_tokens.double()]),
                                         (r.kind_sums if r.kind_sums is not None else
                                          torch.zeros(kinds, 2, dtype=torch.float64,
                                                      device=r.loss.device)).reshape(-1)])
                              for _, r, _, _ in self.pending])
        with self.watchdog.watch("collective: the all-reduce of the step losses",
                                 self.collective_s), self.ranges(LOSS_ALL_REDUCE):
            dist.all_reduce(values, group=parallel_state.get_data_parallel_group())
        dp = parallel_state.get_data_parallel_world_size()
        for (iteration, result, step_s, wait_s), row in zip(self.pending, values.tolist()):
            loss = row[0] / dp
            self.state.losses[iteration] = loss
            self.state.grad_norms[iteration] = result.grad_norm
            self.stats.add_step(loss_sum=loss, loss_count=1, grad_norm=result.grad_norm,
                                skipped=result.skipped, input_tokens=int(row[1]),
                                target_tokens=int(row[2]), model_flops=self.p.cost.model_flops,
                                step_time_s=step_s, data_wait_s=wait_s)
            per_kind = {name: (row[3 + 2 * k] / row[4 + 2 * k], int(row[4 + 2 * k]))
                        for k, name in enumerate(KIND_NAMES) if row[4 + 2 * k] > 0}
            if per_kind:
                self.state.denoiser_losses[iteration] = per_kind
                for k in range(kinds):
                    self.kind_interval[k][0] += row[3 + 2 * k]
                    self.kind_interval[k][1] += row[4 + 2 * k]
        self.pending.clear()

    def _log(self) -> None:
        """The metrics line (and the per-layer gradient norms) of the interval."""
        p, state = self.p, self.state
        self._flush_logs()
        summary = self.stats.summary(state.iteration, state.consumed_samples,
                                     p.schedule.lr(state.iteration - 1), self.loss_scale,
                                     dist.get_world_size(), p.cost.peak_tflops)
        # UL2: the interval's loss per denoiser kind, token-weighted (metrics.format_line)
        summary.update({f"loss_{name}": total / count for name, (total, count)
                        in zip(KIND_NAMES, self.kind_interval) if count > 0})
        self.kind_interval = [[0.0, 0.0] for _ in KIND_NAMES]
        model = p.step.reporting_module()
        experts = moe_metrics.gather(model, self.device) if model is not None else None
        if experts:
            summary.update(moe_metrics.summary_fields(experts))
            state.moe[state.iteration] = experts
        p.writer.write(summary)
        if experts:
            p.writer.write_text(moe_metrics.layer_line(state.iteration, experts))
            p.writer.write_scalars(moe_metrics.layer_scalars(experts), state.iteration)
        layer_norms = p.step.layer_grad_norms.take() \
            if p.step.layer_grad_norms is not None else None
        if layer_norms is not None:
            state.layer_grad_norms[state.iteration] = layer_norms
            write_layer_norms(p.writer, state.iteration, layer_norms)

    def _evaluate(self) -> None:
        p, state = self.p, self.state
        with self.ranges(EVALUATION):
            loss = evaluate(p.step, p.batch, p.runtime, p.valid_loader, self.watchdog)
        if loss is not None:
            state.evaluations.append((state.iteration, "valid", loss))
            p.writer.write_eval(state.iteration, "valid", loss)
        self.timer.reset()

    def _agree_on_stopping(self, result) -> bool:
        """The one all-reduce after a step: exit conditions, the NaN guard, the divergence
        guard's numbers."""
        p = self.p
        signs = _divergence_signs(result, self.weights, p.checkpoint.divergence, self.device)
        with self.watchdog.watch("collective: the all-reduce that agrees on stopping",
                                 self.collective_s), self.ranges(STOP_ALL_REDUCE):
            bad = _nonfinite(result, self.device) if p.checkpoint.check_for_nan else None
            return _exit_requested(p.runtime, p.batch.train_iters, self.state, self.start_time,
                                   self.device, p.signals, bad, signs, self.guard)

    def _stop_if_a_guard_fired(self) -> None:
        """Raise what the NaN guard or the divergence guard found, having removed the saves it
        had not passed (and, for the NaN guard, located where the values started)."""
        p, state = self.p, self.state
        if state.diverged:
            self._flush_logs()
            with self.watchdog.watch("the locator of non-finite values (the failing step "
                                     "again, with collectives)", self.collective_s):
                where = locate(p.step, state.iteration, p.writer)
            message = (f"iteration {state.iteration}: {state.diverged}; {where}; "
                       + _stopping(p.checkpoint, p.saves, self.watchdog, state.iteration)
                       + " (lower the learning rate, or check the data; "
                       "--no-check-for-nan-in-loss-and-grad turns this check off)")
            raise NonFiniteError(message)  # reported once, for the job: megatron/failures.py
        if state.divergence is not None:
            self._flush_logs()
            found = state.divergence
            if found.saves_before_passed and p.saves is not None:
                p.saves.confirm()  # this step's update blew up; the weights before it passed
            message = (f"iteration {state.iteration}: the run diverged ({found.check}): "
                       f"{found.seen} ({found.flag}); "
                       + _stopping(p.checkpoint, p.saves, self.watchdog, state.iteration)
                       + " (lower the learning rate or lengthen its warmup, and start "
                       "again: --load resumes from that checkpoint; if the run was healthy, "
                       "raise the threshold, or --no-check-for-divergence turns this guard "
                       "off)")
            raise DivergenceError(message)  # reported once, as above

    def _save_if_due(self, last: bool, exit_now: bool) -> bool:
        """Save at an interval, the last step or an exit; else let an async save commit.
        Returns whether this step was saved."""
        p, state, ckpt = self.p, self.state, self.p.checkpoint
        due = ckpt.save and (last or exit_now or (
            ckpt.save_interval and state.iteration % ckpt.save_interval == 0))
        if not due:
            if p.saves is not None:
                p.saves.poll()
            return False
        self._flush_logs()
        final = last or exit_now  # no later step would judge (or commit) it
        saved = False
        with self.watchdog.watch(f"checkpoint I/O: saving iteration {state.iteration} to "
                                 f"{ckpt.save}", 60 * ckpt.timeout_minutes), \
                self.ranges(CHECKPOINT_SAVE):
            try:
                p.save(state, self.hold and not final)
                saved = True
            except SaveFailed as e:
                if final:  # nothing would try again
                    raise
                p.writer.write_text(f"warning: {e}; trying again at the next save")
        self.timer.reset()
        return saved


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
    growth = weights.update() if divergence.weight_growth > 0 else None
    return local_signs(result, growth, device)


def _stopping(checkpoint: CheckpointConfig, saves, watchdog, iteration: int) -> str:
    """What a guard's message says about checkpoints, after removing the held saves (every rank
    calls it: the removal is collective)."""
    if not checkpoint.save:
        return "stopping (no --save, so no checkpoint)"
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
        state.exit_reason = f"signal {signal.Signals(signum).name}"
        return True
    if timed_out:
        state.exit_reason = f"--exit-duration-in-mins {runtime.exit_duration_in_mins}"
        return True
    return False


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 20.0))

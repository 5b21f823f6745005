"""The training loop: steps, evaluation, logging, checkpoints and the exit conditions.

One step is one optimizer update over the global batch, run by a `TrainStep` (step.py) that
pulls this rank's micro-batches from the loader; the loop knows no engine. Step k uses
`schedule.lr(k)`, as Megatron's scheduler does. Losses stay on the device until a log boundary,
where one all-reduce over the data-parallel group turns them into the global per-step losses
(the loss of a step is the mean of its micro-batch losses, which is what the gradient is the
mean of).

Evaluation runs over the same first `eval_iters` global batches of the split each time, so the
numbers are comparable across evaluations and across a resume; its loss is the token-weighted
mean over all ranks, and its span-filling accuracy the share of labelled target tokens whose
teacher-forced greedy prediction is right (step.span_accuracy_counts), reduced by name in the
same all-reduce. With --eval-log-samples N, rank 0 also logs N decoded examples of the first
evaluation batch (input, target, the model's fill).

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
from typing import Callable, Dict, Iterable, Iterator, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from megatron import parallel_state
from megatron.checkpoint.io.checkpointing import read_tracker
from megatron.checkpoint.io.saver import SaveFailed
from megatron.config import RunConfig, RuntimeConfig
from megatron.config.lr_schedule import LRSchedule
from megatron.config.training import BatchConfig, CheckpointConfig, LoggingConfig
from megatron.data.tokenizers.tokenizer import build_tokenizer
from megatron.failures import RunFailure
from megatron.training import (denoiser_metrics, divergence, moe_metrics, nan_locator, producers,
                               step_metrics)
from megatron.training.divergence import DivergenceError, DivergenceGuard, WeightGrowth
from megatron.training.finetune_metrics import (accuracy_name, generation_line, generation_scalars,
                                               validation_generation)
from megatron.training.layer_norms import write_layer_norms
from megatron.training.metrics import IntervalStats, MetricsWriter, Timer
from megatron.training.nan_locator import locate
from megatron.training.profiling import (CHECKPOINT_SAVE, DATA_WAIT, EVALUATION, LOSS_ALL_REDUCE,
                                         STOP_ALL_REDUCE, TRAIN_STEP, StepProfiler,
                                         no_range)
from megatron.training.step import (INPUT_TOKENS, LOSS, SPAN_CORRECT, SPAN_TOKENS, TARGET_TOKENS,
                                    Batch, TrainStep)
from megatron.training.step_metrics import MAX, SUM, Metrics
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
    """(iteration, split, loss, span_accuracy): plain tuples (they travel through torch.save
    with weights_only); span_accuracy is None where the step reports none."""
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


class Evaluation(NamedTuple):
    """What `run_evaluation` found, on every rank."""

    loss: float
    """Token-weighted mean loss over all ranks."""
    span_accuracy: Optional[float]
    """Labelled target tokens predicted right over all of them (None: the step reports no
    counts)."""
    first_batch: Optional[Batch] = None
    """This rank's first evaluation batch (as the loader gave it), with `predictions`."""
    predictions: Optional[torch.Tensor] = None
    """[batch, dec_len] the greedy prediction of `first_batch` where asked for and read on this
    rank (the first pipeline stage; every rank without a pipeline), else None."""


_EVAL_LOSS_SUM, _EVAL_TOKENS = "eval/loss_sum", "eval/tokens"


def run_evaluation(step: TrainStep, batch_config: BatchConfig, runtime: RuntimeConfig,
                   loader: Optional[Iterable], watchdog=None,
                   predictions: bool = False) -> Optional[Evaluation]:
    """The loss and span-filling accuracy over `eval_iters` global batches of `loader` (all
    ranks; one all-reduce over the data-parallel group reduces every number by name).
    predictions: keep the first batch and its greedy prediction (the samples that
    --eval-log-samples logs; the same on every rank: a pipeline sends it between stages).
    None where there is nothing to evaluate."""
    if loader is None or batch_config.eval_iters == 0:
        return None
    watchdog = watchdog or NoWatchdog()
    collective_s = 60 * runtime.distributed_timeout_minutes
    data_s = 60 * runtime.data_timeout_minutes
    device = runtime.torch_device()
    # every name on every rank, even one that reads no batch (the names must agree)
    totals = {name: torch.zeros((), dtype=torch.float64, device=device)
              for name in (_EVAL_LOSS_SUM, _EVAL_TOKENS, SPAN_CORRECT, SPAN_TOKENS)}
    first_batch = first_predictions = None
    limit = batch_config.eval_iters * batch_config.gradient_accumulation_steps
    batches = iter(loader)
    step.train(False)
    for index in range(limit):
        with watchdog.watch("data: the next evaluation batch from the data loader", data_s):
            batch = next(batches, None)
        if batch is None:
            break
        with watchdog.watch("an evaluation step (collectives with the other ranks)",
                            collective_s):
            if predictions and index == 0:
                result = step.eval_step(batch, predictions=True)
                first_batch, first_predictions = batch, result.predictions
            else:
                result = step.eval_step(batch)
            totals[_EVAL_LOSS_SUM] += result.loss_sum
            totals[_EVAL_TOKENS] += result.tokens
            for name, value in step_metrics.select(result.metrics or {}, SUM).items():
                if name in totals:
                    totals[name] += value
                else:
                    totals[name] = value.clone()
    step.train(True)
    reducer = step_metrics.Reducer(SUM, parallel_state.get_data_parallel_group(), device,
                                   to_host=True)
    with watchdog.watch("collective: the all-reduce of the evaluation loss", collective_s):
        sums, = reducer([totals])
    if not sums[_EVAL_TOKENS] > 0:
        return None
    accuracy = float(sums[SPAN_CORRECT] / sums[SPAN_TOKENS]) if sums[SPAN_TOKENS] > 0 else None
    return Evaluation(float(sums[_EVAL_LOSS_SUM] / sums[_EVAL_TOKENS]), accuracy, first_batch,
                      first_predictions)


def evaluate_and_log(step: TrainStep, batch_config: BatchConfig, runtime: RuntimeConfig,
                     loader: Optional[Iterable], split: str, state: TrainState,
                     writer: MetricsWriter, tokenizer: Callable[[], object],
                     watchdog=None, accuracy: str = "span accuracy") -> Optional[Evaluation]:
    """One evaluation of `split` ('valid' or 'test') at `state.iteration`, recorded in `state`
    and logged (its teacher-forced accuracy under the name `accuracy`, finetune_metrics'
    accuracy_name), with the --eval-log-samples examples decoded by `tokenizer()` (called only
    when they are logged): the loop's evaluations and the final ones alike. None where there is
    nothing to evaluate."""
    samples = batch_config.eval_log_samples
    evaluation = run_evaluation(step, batch_config, runtime, loader, watchdog,
                                predictions=samples > 0)
    if evaluation is None:
        return None
    state.evaluations.append((state.iteration, split, evaluation.loss,
                              evaluation.span_accuracy))
    writer.write_eval(state.iteration, split, evaluation.loss, evaluation.span_accuracy,
                      accuracy)
    if samples > 0 and writer.enabled and evaluation.predictions is not None:
        writer.write_eval_samples(state.iteration, split,
                                  decode_samples(evaluation.first_batch, evaluation.predictions,
                                                 tokenizer(), samples))
    return evaluation


def run_tokenizer(config: RunConfig):
    """The run's tokenizer, as the data was made with it (for decoding logged samples)."""
    return build_tokenizer(config.data.tokenizer, extra_ids=config.data.vocab_extra_ids)


def decode_samples(batch: Batch, predictions: torch.Tensor, tokenizer,
                   count: int) -> List[Tuple[str, str, str]]:
    """The first `count` examples of `batch` as text, (input, target, fill) each: the encoder
    input without padding (sentinels as the tokenizer writes them), the labelled target tokens,
    and the greedy prediction at those positions. An id the tokenizer does not have (a model
    vocabulary larger than the tokenizer's) is written <id N>."""
    out = []
    predictions = predictions.cpu()
    for i in range(min(count, predictions.shape[0])):
        labels = batch["labels"][i].cpu()
        labelled = labels != -100
        inputs = batch["encoder_input_ids"][i].cpu()[batch["encoder_attention_mask"][i].cpu()
                                                     .bool()]
        out.append(tuple(_decode(tokenizer, ids.tolist())
                         for ids in (inputs, labels[labelled], predictions[i][labelled])))
    return out


def _decode(tokenizer, ids: List[int]) -> str:
    size, parts, run = len(tokenizer), [], []
    for i in ids:
        if 0 <= i < size:
            run.append(i)
            continue
        if run:
            parts.append(tokenizer.decode(run))
            run = []
        parts.append(f"<id {i}>")
    if run:
        parts.append(tokenizer.decode(run))
    return "".join(parts)


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

    config: RunConfig
    """The run's settings (the loop reads its batch, logging, checkpoint and runtime parts)."""
    step: TrainStep
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

    @property
    def batch(self) -> BatchConfig:
        return self.config.batch

    @property
    def logging(self) -> LoggingConfig:
        return self.config.logging

    @property
    def checkpoint(self) -> CheckpointConfig:
        return self.config.checkpoint

    @property
    def runtime(self) -> RuntimeConfig:
        return self.config.runtime


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
        self._sample_tokenizer = None  # --eval-log-samples: the run's tokenizer, when needed
        self.interval: Dict[str, torch.Tensor] = {}  # the interval's reduced SUM metrics, summed
        # the loop reads every reduced value on the host: one copy per all-reduce
        self.sums = step_metrics.Reducer(SUM, parallel_state.get_data_parallel_group(),
                                         self.device, to_host=True)
        self.maxima = step_metrics.Reducer(MAX, None, self.device, to_host=True)
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
            with self.ranges(TRAIN_STEP):  # the whole step (training/profiling.py)
                result = p.step.step(self.batches, p.schedule.lr(state.iteration))
        state.iteration += 1
        state.consumed_samples += p.batch.global_batch_size
        self.loss_scale = result.loss_scale
        step_s, wait_s = self.timer.step_end()
        self.pending.append((state.iteration, result, step_s, wait_s))
        return result

    def _flush_logs(self, extra: Optional[Metrics] = None) -> Dict[str, torch.Tensor]:
        """The pending steps' SUM metrics (and `extra`, the interval's), reduced over the
        data-parallel ranks in one all-reduce, into the state and the interval's sums; returns
        `extra` reduced."""
        rows = [step_metrics.select(r.metrics, SUM) for _, r, _, _ in self.pending]
        if extra is not None:
            rows.append(step_metrics.select(extra, SUM))
        if not rows:
            return {}
        with self.watchdog.watch("collective: the all-reduce of the step losses",
                                 self.collective_s), self.ranges(LOSS_ALL_REDUCE):
            reduced = self.sums(rows)
        dp = parallel_state.get_data_parallel_world_size()
        for (iteration, result, step_s, wait_s), values in zip(self.pending, reduced):
            loss = float(values[LOSS]) / dp
            self.state.losses[iteration] = loss
            self.state.grad_norms[iteration] = result.grad_norm
            self.stats.add_step(loss_sum=loss, loss_count=1, grad_norm=result.grad_norm,
                                skipped=result.skipped, input_tokens=int(values[INPUT_TOKENS]),
                                target_tokens=int(values[TARGET_TOKENS]),
                                model_flops=self.p.cost.model_flops, step_time_s=step_s,
                                data_wait_s=wait_s)
            per_kind = denoiser_metrics.step_losses(values)
            if per_kind:
                self.state.denoiser_losses[iteration] = per_kind
            step_metrics.add_into(self.interval, values)
        self.pending.clear()
        return reduced[-1] if extra is not None else {}

    def _log(self) -> None:
        """The metrics line (and the per-layer gradient norms) of the interval."""
        p, state = self.p, self.state
        model = p.step.reporting_module()
        moe_names, moe = moe_metrics.metrics(model, self.device) if model is not None \
            else (None, {})
        moe_values = self._flush_logs(moe)
        summary = self.stats.summary(state.iteration, state.consumed_samples,
                                     p.schedule.lr(state.iteration - 1), self.loss_scale,
                                     dist.get_world_size(), p.cost.peak_tflops)
        # the producers' fields of the interval (metrics.format_line shows them)
        summary.update(producers.summary_fields(self.interval))
        self.interval = {}
        experts = moe_metrics.layers(moe_names, moe_values)
        if experts:
            summary.update(moe_metrics.layer_summary(experts))
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
            evaluate_and_log(p.step, p.batch, p.runtime, p.valid_loader, "valid", state,
                             p.writer, self._tokenizer, self.watchdog, accuracy_name(p.config))
        # seq2seq fine-tuning: exact match and label accuracy of the greedy decoding
        generation = validation_generation(p.step, p.config, p.valid_loader, self.watchdog)
        if generation:
            p.writer.write_text(generation_line(state.iteration, generation))
            p.writer.write_scalars(generation_scalars(generation), state.iteration)
        self.timer.reset()

    def _tokenizer(self):
        """The run's tokenizer (built the first time the samples need it)."""
        if self._sample_tokenizer is None:
            self._sample_tokenizer = run_tokenizer(self.p.config)
        return self._sample_tokenizer

    def _agree_on_stopping(self, result) -> bool:
        """The one all-reduce after a step: its MAX metrics (the exit conditions, the NaN
        guard's and the divergence guard's numbers, and any the step reported)."""
        p = self.p
        maxima = [step_metrics.select(result.metrics, MAX)]
        if p.checkpoint.divergence.enabled:
            growth = self.weights.update() if p.checkpoint.divergence.weight_growth > 0 else None
            maxima.append(step_metrics.select(
                divergence.step_metrics(result, growth, self.device), MAX))
        with self.watchdog.watch("collective: the all-reduce that agrees on stopping",
                                 self.collective_s), self.ranges(STOP_ALL_REDUCE):
            if p.checkpoint.check_for_nan:
                maxima.append(step_metrics.select(
                    nan_locator.guard_metrics(result, self.device), MAX))
            return _exit_requested(p.runtime, p.batch.train_iters, self.state, self.start_time,
                                   self.maxima, p.signals, maxima,
                                   self.guard if p.checkpoint.divergence.enabled else None)

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
                    start_time: float, reducer, signals,
                    maxima: List[Dict[str, torch.Tensor]] = (), guard=None) -> bool:
    """Whether to stop after this step: --exit-interval, or (agreed by all ranks through one
    all-reduce, so that they save and leave together) --exit-duration-in-mins or a stop
    signal received by any rank. The same all-reduce (`reducer`, MAX) carries `maxima`, the
    producers' MAX metrics: the NaN guard's (nan_locator.guard_metrics: the lowest rank whose
    loss or gradient norm was not finite sets state.diverged) and the divergence guard's
    (divergence.step_metrics), which `guard` then checks (every rank the same numbers: the
    same decision), setting state.divergence. The all-reduce runs at every step (also the last
    and --exit-interval's), so that every rank takes the same decision from the same flags."""
    timed_out = runtime.exit_duration_in_mins is not None and \
        time.monotonic() - start_time > runtime.exit_duration_in_mins * 60
    signum = signals.received if signals is not None and signals.received is not None else 0
    local = {"exit/timed_out": torch.tensor(float(timed_out), dtype=torch.float64),
             "exit/signal": torch.tensor(float(signum), dtype=torch.float64)}
    for values in maxima:
        local.update(values)
    values, = reducer([local])
    timed_out, signum = int(values["exit/timed_out"]), int(values["exit/signal"])
    found = nan_locator.guard_finding(values)
    if found is not None:
        state.diverged = found
        return True
    if guard is not None:
        state.divergence = guard.observe(state.iteration, divergence.agreed_signs(values))
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

"""The training-step seam: what the loop calls, and the data-parallel implementation on DeepSpeed.

The loop (loop.py) knows one interface, `TrainStep`: `step(batches, lr)` runs one optimizer
update over this rank's share of the global batch, pulling its micro-batches from `batches`,
and returns a `StepResult`; `eval_step(batch)` returns the token-weighted loss of one batch and
its span-filling accuracy counts (`span_accuracy_counts`);
`save` / `load` write and read the engine's files in a folder the checkpoint code chooses. Every
DeepSpeed detail lives behind it: the micro-step API (`engine(...)`, `backward`, `step` per
micro-batch, the update at the accumulation boundary), the learning rate written into the
optimizer's groups, the loss scale, skipped (overflowed) steps, and the gradient norm that
DeepSpeed computes without keeping it under ZeRO-0 in fp32. A pipeline engine, which steps once
per global batch, is a second implementation beside `DataParallelStep`.
"""

from __future__ import annotations

import abc
import contextlib
import math
from pathlib import Path
from typing import Dict, Iterator, List, NamedTuple, Optional

import torch
import torch.distributed as dist

from megatron import deepspeed_internals, parallel_state
from megatron.checkpoint.formats.deepspeed_files import OPTIMIZER_PARAMETERS
from megatron.checkpoint.formats.weights import WeightsError, WeightsReader, load_into
from megatron.checkpoint.io.async_save import Capture
from megatron.checkpoint.io.checkpointing import rng_state, set_rng_state
from megatron.checkpoint.io.optimizer_state import load_optimizer_state
from megatron.checkpoint.io.prompt import holds_prompt_alone
from megatron.model.moe import expert_bias_layers, update_expert_bias
from megatron.model.state_dict import persistent_buffers
from megatron.tensor_parallel.group import TensorParallel
from megatron.training import experts
from megatron.training.layer_norms import LayerGradNorms
from megatron.training.nan_locator import GradientCheck, NonFiniteWatch
from megatron.training import denoiser_metrics
from megatron.training.denoiser_metrics import KIND_KEY
from megatron.training.profiling import BACKWARD, FORWARD, NO_RANGE, OPTIMIZER_STEP, no_range
from megatron.training.step_metrics import SUM, Metrics, merge, metric

BATCH_KEYS = ("encoder_input_ids", "decoder_input_ids", "encoder_attention_mask",
              "decoder_attention_mask", "labels")
LOSS, INPUT_TOKENS, TARGET_TOKENS = "loss", "tokens/input", "tokens/target"
"""The step metrics every step reports (`core_metrics`)."""

Batch = Dict[str, torch.Tensor]


class StepResult(NamedTuple):
    """One optimizer step on this rank. Tensors stay on the device (no host sync per step)."""

    metrics: Metrics
    """The step's metrics by name (step_metrics.py): `core_metrics`' loss and token counts, and
    what producers added (UL2's per-kind sums: denoiser_metrics.py)."""
    grad_norm: Optional[float]
    """The global gradient norm before clipping (None where the engine reports none)."""
    skipped: bool
    """The update was skipped (fp16 overflow)."""
    loss_scale: float
    """The loss scale after the step (1.0 without loss scaling)."""

    @property
    def loss(self) -> torch.Tensor:
        """float64 scalar: the mean of this rank's micro-batch losses; the step's global loss is
        its mean over the data-parallel ranks."""
        return self.metrics[LOSS].value


def core_metrics(loss, input_tokens, target_tokens) -> Metrics:
    """SUM metrics of every step: `loss` (the mean of this rank's micro-batch losses), the
    encoder tokens (padding excluded) and the labelled decoder tokens this rank consumed."""
    return {LOSS: metric(loss, SUM), INPUT_TOKENS: metric(input_tokens, SUM),
            TARGET_TOKENS: metric(target_tokens, SUM)}


class EvalResult(NamedTuple):
    loss_sum: torch.Tensor
    """float64 scalar: the sum of the token losses of the batch on this rank."""
    tokens: torch.Tensor
    """Labelled tokens of the batch on this rank."""
    metrics: Optional[Metrics] = None
    """More SUM numbers of the batch by name (`span_accuracy_metrics`); None: none."""
    predictions: Optional[torch.Tensor] = None
    """[batch, dec_len] int64: the teacher-forced greedy prediction at every decoder position,
    where `eval_step` was asked for it (on the ranks that read batches); else None."""


SPAN_CORRECT, SPAN_TOKENS = "span_accuracy/correct", "span_accuracy/tokens"
"""The evaluation's span-filling accuracy: labelled target tokens whose greedy prediction is the
label, and labelled target tokens (`span_accuracy_metrics`)."""


class SpanCounts(NamedTuple):
    correct: torch.Tensor
    """int64 scalar: labelled positions where the greedy prediction is the label."""
    total: torch.Tensor
    """int64 scalar: labelled positions (labels != ignore_index)."""
    predictions: torch.Tensor
    """[...] int64: the greedy prediction at every position (global vocabulary ids)."""


def greedy_tokens(logits: torch.Tensor, vocab_size: int, tp: TensorParallel) -> torch.Tensor:
    """The greedy prediction [...] (int64 global ids, the same on every tensor rank) from this
    rank's vocabulary-parallel logits [..., padded vocab / tp.size].

    Ids at or past `vocab_size` (the padding that makes the table divide by the TP size) are
    never predicted. Ties go to the lowest global id at any TP size: each rank takes its local
    maximum (torch's first index), then one all-reduce MAX of the values and one MIN of the
    indices of the ranks holding that maximum."""
    per_rank = logits.shape[-1]
    start = tp.rank * per_rank
    valid = max(min(vocab_size - start, per_rank), 0)  # local columns below vocab_size
    none = torch.full(logits.shape[:-1], vocab_size, dtype=torch.int64, device=logits.device)
    if valid > 0:
        best, index = logits[..., :valid].float().max(dim=-1)
        index = index + start
    else:  # every column of this rank is padding
        best = torch.full(logits.shape[:-1], float("-inf"), device=logits.device)
        index = none
    if tp.size > 1:
        top = best.clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=tp.group)
        index = torch.where(best == top, index, none)
        dist.all_reduce(index, op=dist.ReduceOp.MIN, group=tp.group)
    return index


def span_accuracy_counts(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                         tp: TensorParallel, ignore_index: int = -100) -> SpanCounts:
    """Span-filling accuracy counts of a batch, teacher-forced: of the labelled positions
    (labels != ignore_index: padding and unlabelled positions do not count), those where the
    greedy prediction (`greedy_tokens`) is the label.

    Args:
        logits: [..., padded vocab / tp.size] this rank's vocabulary slice (any float dtype).
        labels: [...] global ids, or ignore_index.
        vocab_size: the true vocabulary size (the tokenizer's): larger ids are never predicted.
        tp: the ranks that split the vocabulary (collective over tp.group when tp.size > 1).
    """
    predictions = greedy_tokens(logits, vocab_size, tp)
    labelled = labels != ignore_index
    return SpanCounts(((predictions == labels) & labelled).sum(), labelled.sum(), predictions)


def span_accuracy_metrics(correct, total) -> Metrics:
    """The SUM metrics of span-filling accuracy (reduced with the evaluation loss)."""
    return {SPAN_CORRECT: metric(correct, SUM), SPAN_TOKENS: metric(total, SUM)}


class TrainStep(abc.ABC):
    """One optimizer step over this rank's micro-batches, and evaluation, on some engine."""

    micro_batches: int
    """Micro-batches `step` takes from its iterator."""
    ranges = staticmethod(no_range)
    """ranges(name): a context for a named profiler range (megatron/training/profiling.py sets
    it on a profiled rank; elsewhere nothing)."""

    layer_grad_norms = None
    """A layer_norms.LayerGradNorms where --log-grad-norms-per-layer is on (the loop arms it
    before a logged step), else None."""

    @abc.abstractmethod
    def step(self, batches: Iterator[Batch], lr: float) -> StepResult:
        """Train on the next `micro_batches` batches of `batches` at learning rate `lr`."""

    def reporting_module(self):
        """This rank's module, whose Mixture-of-Experts layers report to the log
        (training/moe_metrics.py); None: nothing to report."""
        return None

    @abc.abstractmethod
    def eval_step(self, batch: Batch, predictions: bool = False) -> EvalResult:
        """The loss of `batch` without gradients (the model in evaluation mode) and its
        span-filling accuracy counts; predictions: also return the greedy prediction (for the
        logged samples: --eval-log-samples) where the batch is read."""

    @abc.abstractmethod
    def train(self, mode: bool = True) -> None:
        """Training (dropout on) or evaluation mode."""

    @abc.abstractmethod
    def save(self, root: Path, tag: str, iteration: int) -> None:
        """Write the engine's files (weights, optimizer, ZeRO partitions) into root/tag
        (collective)."""

    @abc.abstractmethod
    def load(self, root: Path, tag: str, weights_only: bool) -> bool:
        """Read root/tag (weights only: no optimizer states); False when the engine found
        nothing to load (collective)."""

    def load_weights(self, folder: Path, optimizer_step: Optional[int] = None,
                     open_reader=WeightsReader) -> None:
        """Read the full weights of a weights checkpoint folder (megatron/checkpoint/formats/weights.py)
        into this rank's part of the model (collective under ZeRO-3); with `optimizer_step`,
        its optimizer states too, Adam's step set to it. `open_reader(folder, prefix)`: what
        reads the tensors (megatron/checkpoint/io/reshard.py's, from our own files)."""
        raise NotImplementedError(f"{type(self).__name__} cannot load a weights checkpoint")

    def watch_nonfinite(self, detect_layers: bool = False) -> None:
        """Prepare `locate_nonfinite` (the NaN guard is on); detect_layers: watch every module
        on every step. A step that cannot locate does nothing."""

    def locate_nonfinite(self):
        """Where the last step's non-finite values started on this rank (collective, after the
        NaN guard fired; megatron/training/nan_locator.py): (the first `Finding` or None, how
        it was found: 'watched' (the step itself), 're-run' (on the weights the step failed
        with) or 'updated' (a re-run on the weights after its update)), or None where this
        step cannot tell."""
        return None

    def weight_norms(self) -> Optional[torch.Tensor]:
        """The norms of the weights this rank holds (its tensor shards, its pipeline stage, its
        ZeRO-3 partitions), a float64 vector on the device in the same order at every step
        (`weight_norms` below), without a host synchronisation: the divergence guard's weight
        growth. None where they cannot be read cheaply."""
        return None


SMALL_TENSOR = 1024
"""Tensors (or ZeRO-3 partitions) of fewer elements are pooled into one norm by `weight_norms`:
a handful of weights near 0 can double in a healthy step, a blown-up model moves every matrix."""


def weight_norms(tensors: List[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
    """The norms of `tensors` as a float64 vector on `device`, in the order given: one per
    tensor of at least SMALL_TENSOR elements, then one for all smaller ones together (None when
    there is nothing). Each norm is taken in float32 (a 16-bit tensor's own dtype would overflow
    at 65504) by torch's multi-tensor kernel (one launch per device and dtype, as
    torch.nn.utils.clip_grad_norm_ does), without a host synchronisation."""
    big = [t.detach() for t in tensors if t.numel() >= SMALL_TENSOR]
    small = [t.detach() for t in tensors if 0 < t.numel() < SMALL_TENSOR]
    parts = []
    for group in (big, small):
        groups: Dict[tuple, List[torch.Tensor]] = {}
        for t in group:
            groups.setdefault((t.device, t.dtype), []).append(t)
        norms = [n.to(device=device, dtype=torch.float64)
                 for same in groups.values()
                 for n in torch._foreach_norm(same, 2, dtype=torch.float32)]
        if group is small and norms:
            norms = [torch.stack(norms).square().sum().sqrt()]
        parts += norms
    return torch.stack(parts) if parts else None


def module_vocab_size(module) -> int:
    """The unpadded vocabulary of a T5Model or of a pipeline stage (its loss function knows)."""
    config = getattr(module, "config", None)
    if config is not None:
        return config.vocab_size
    return module.loss_fn.vocab_size


def to_device(batch: Batch, device: torch.device) -> Batch:
    return {k: batch[k].to(device, non_blocking=True) for k in BATCH_KEYS}


class EngineStep(TrainStep):
    """What every DeepSpeed-backed step shares: train mode, checkpoint files, the loss scale and
    the gradient norm the engine reports."""

    def __init__(self, engine, device: torch.device, clip_grad: float = 0.0,
                 expert_bias_update_rate: float = 1e-3) -> None:
        self.engine = engine
        self.device = device
        self.micro_batches = engine.gradient_accumulation_steps()
        self.clip_grad = clip_grad
        self.expert_bias_update_rate = expert_bias_update_rate
        module = engine.module
        self._clip_experts = engine.zero_optimization_stage() == 0 and \
            experts.uses_deepspeed_experts(module)
        """ZeRO-0 with experts over ranks: the step takes the norm and clips (experts.py)."""
        self._biased = expert_bias_layers(module)
        """The layers balancing by expert bias (found once, not on every step)."""

    def after_update(self) -> None:
        """After an optimizer step: the expert biases move toward equal load."""
        if self._biased:
            update_expert_bias(self._biased, self.expert_bias_update_rate,
                               parallel_state.get_data_parallel_group()
                               if parallel_state.model_parallel_is_initialized() else None)

    def train(self, mode: bool = True) -> None:
        self.engine.train(mode)

    def reporting_module(self):
        return self.engine.module

    def save(self, root: Path, tag: str, iteration: int) -> None:
        client_state = {"iteration": iteration}
        order = self._optimizer_parameters()
        if order is not None:
            client_state[OPTIMIZER_PARAMETERS] = order
        self.engine.save_checkpoint(str(root), tag=tag, client_state=client_state,
                                    save_latest=False,
                                    exclude_frozen_parameters=self._prompt_alone())
        for path, state in experts.expert_files(self.engine.module, root / tag).items():
            self.engine.checkpoint_engine.save(state, str(path))

    def capture(self, root: Path, tag: str, iteration: int, snapshot_with=None) -> list:
        """What `save` would write, as (path, object) pairs, without writing it (collective):
        DeepSpeed's checkpoint engine is replaced by megatron/training/async_save.Capture for
        the duration. snapshot_with: copies each object (async saves)."""
        real = self.engine.checkpoint_engine
        capture = Capture(real, snapshot_with)
        self.engine.checkpoint_engine = capture
        try:
            self.save(root, tag, iteration)
        finally:
            self.engine.checkpoint_engine = real
        return capture.files

    def _optimizer_parameters(self) -> Optional[List[List[str]]]:
        """The names of a plain torch optimizer's parameters, group by group (its state_dict
        numbers them only); None where DeepSpeed's ZeRO optimizers record them themselves."""
        optimizer = self.engine.optimizer
        if self.engine.zero_optimization_stage() != 0 \
                or not isinstance(optimizer, torch.optim.Optimizer):
            return None
        names = {id(p): n for n, p in self.engine.module.named_parameters()}
        groups = [[names.get(id(p)) for p in g["params"]] for g in optimizer.param_groups]
        return None if any(n is None for g in groups for n in g) else groups

    def _prompt_alone(self) -> bool:
        """Prompt tuning with the model frozen: the checkpoints hold the prompt alone (the frozen
        model stays in its base checkpoint, loaded from there first)."""
        module = self.engine.module
        return getattr(module, "prompt", None) is not None \
            and any(not p.requires_grad for p in module.parameters())

    def load(self, root: Path, tag: str, weights_only: bool) -> bool:
        # a prompt-tuning checkpoint of the prompt alone: the model stays the base's, loaded
        # before it (every other checkpoint, a base's included, loads strictly)
        frozen = self._prompt_alone()
        strict = not (frozen and holds_prompt_alone(root / tag))
        with deepspeed_internals.frozen_weights_from_module(self.engine) if frozen \
                else contextlib.nullcontext():
            path, _ = self.engine.load_checkpoint(str(root), tag=tag, load_module_strict=strict,
                                                  load_optimizer_states=not weights_only,
                                                  load_lr_scheduler_states=False,
                                                  load_module_only=weights_only)
        if path is not None:
            experts.load_expert_files(self.engine.module, root / tag)
        return path is not None

    def load_weights(self, folder: Path, optimizer_step: Optional[int] = None,
                     open_reader=WeightsReader) -> None:
        module = self.engine.module
        experts = (parallel_state.get_expert_model_parallel_rank(),
                   parallel_state.get_expert_model_parallel_world_size())
        problems = load_into(module, self._weight_names(), open_reader(folder),
                             module_vocab_size(module),
                             parallel_state.get_tensor_model_parallel_rank(),
                             parallel_state.get_tensor_model_parallel_world_size(),
                             buffers=self._buffer_names(), experts=experts)
        if problems:
            raise WeightsError("; ".join(problems))
        if optimizer_step is None:  # the masters of ZeRO and the 16-bit optimizers (with
            deepspeed_internals.refresh_masters(self.engine.optimizer)  # optimizer states
            # they come from the file)
        if optimizer_step is not None:
            load_optimizer_state(self.engine, self._weight_names(), folder, optimizer_step,
                                 module_vocab_size(module),
                                 parallel_state.get_tensor_model_parallel_rank(),
                                 parallel_state.get_tensor_model_parallel_world_size(), experts,
                                 open_reader)

    def _weight_names(self) -> Dict[str, str]:
        """{this rank's parameter name: our full name}."""
        return {name: name for name, _ in self.engine.module.named_parameters()}

    def _buffer_names(self) -> Dict[str, str]:
        """{this rank's persistent buffer name (expert biases): our full name}."""
        return {name: name for name in persistent_buffers(self.engine.module)}

    def weight_norms(self) -> Optional[torch.Tensor]:
        offload = self.engine.zero_offload_param()
        if offload is not None and str(getattr(offload, "device", "none")).endswith("nvme"):
            return None  # partitions swapped out to the disk: not read on every step
        # ZeRO-3 keeps a parameter's data only while a forward gathers it; between steps a
        # rank holds its partition, ds_tensor (on the CPU with --offload-param cpu)
        tensors = [deepspeed_internals.stored_tensor(p) for p in self.engine.module.parameters()]
        return weight_norms([t for t in tensors if t is not None], self.device)

    def watch_layer_grad_norms(self, groups: List[str]) -> None:
        """Take per-layer gradient norms at the steps the loop arms (megatron/training/
        layer_norms.py), where DeepSpeed takes the global norm."""
        self.layer_grad_norms = LayerGradNorms(self.engine, self._weight_names(), groups,
                                               self._loss_scale, self.device)

    def _loss_scale(self) -> float:
        return deepspeed_internals.loss_scale(self.engine.optimizer)

    def _grad_norm(self) -> Optional[float]:
        norm = self.engine.get_global_grad_norm()
        if norm is None:
            return None
        return float(norm.item() if torch.is_tensor(norm) else norm)


class DataParallelStep(EngineStep):
    """DeepSpeed's engine with data parallelism (ZeRO 0-3, offload) and tensor parallelism:
    each micro-batch is a forward, a backward and an engine step (DeepSpeed updates at the
    accumulation boundary).

    With `watch_nonfinite(detect_layers)` (the NaN guard on), the step keeps its micro-batches
    and holds back the update of a step whose loss or gradients are not finite on some rank
    (one all-reduce per step), so that `locate_nonfinite` re-runs it on the weights it failed
    with; fp16 runs are left to DeepSpeed, which skips overflowed steps itself."""

    last_batches: List[Batch] = []
    """The last step's micro-batches on the device (references, kept for the locator)."""
    _hold_bad = False  # hold back the update of a step that is not finite
    _gradients = None  # nan_locator.GradientCheck where the norm comes only with the update
    _layers = None  # nan_locator.NonFiniteWatch on every step (--detect-nan-layers)
    _held = False  # the last step's update was held back
    _keep_rng = False  # the model draws dropout masks: the re-run needs the step's generators
    _rng = None  # the generators' states at the start of the last step (for its re-run)

    def watch_nonfinite(self, detect_layers: bool = False) -> None:
        engine = self.engine
        self._hold_bad = not engine.fp16_enabled()
        self._keep_rng = self._hold_bad and not detect_layers and \
            getattr(getattr(engine.module, "config", None), "dropout_rate", 1.0) > 0
        if self._hold_bad and (engine.zero_optimization_stage() != 0
                               or engine.bfloat16_enabled()):
            self._gradients = GradientCheck(engine.module, self.device)
        if detect_layers:
            self._layers = NonFiniteWatch(self.engine.module).attach()

    def step(self, batches: Iterator[Batch], lr: float) -> StepResult:
        engine = self.engine
        for group in engine.optimizer.param_groups:
            group["lr"] = lr
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)
        kinds = denoiser_metrics.zeros(self.device)
        skipped_before = engine.skipped_steps
        norm = None
        ranges = self.ranges
        self.last_batches, self._held = [], False
        if self._keep_rng:  # the re-run draws the same dropout masks
            self._rng = rng_state(self.device.type)
        for watch in (self._gradients, self._layers):
            if watch is not None:
                watch.reset()
        for micro in range(self.micro_batches):
            raw = next(batches)
            batch = to_device(raw, self.device)
            self.last_batches.append(batch)
            if self._layers is not None:
                self._layers.new_micro_batch(micro)
            with ranges(FORWARD):
                out = engine(**batch)
            with ranges(BACKWARD):
                engine.backward(out.objective)
            totals[0] += out.loss.detach().double()
            totals[1] += batch["encoder_attention_mask"].sum()
            totals[2] += (batch["labels"] != -100).sum()
            if KIND_KEY in raw:
                kinds += denoiser_metrics.kind_sums(out.token_losses, batch["labels"],
                                                    raw[KIND_KEY])
            last = micro == self.micro_batches - 1
            if last:
                norm = self._unreported_grad_norm()
                if self._hold_bad and self._hold(totals[0], norm):
                    self._held = True
                    bad = (self._gradients is not None and bool(self._gradients.bad)) or (
                        norm is not None and not math.isfinite(norm))
                    return StepResult(self._metrics(totals, kinds),
                                      float("nan") if bad else norm, False, self._loss_scale())
            if last and self._clip_experts:
                experts.clip_gradients(engine.module, norm, self.clip_grad)
            with ranges(OPTIMIZER_STEP) if last else NO_RANGE:
                engine.step()
        self.after_update()
        if norm is None:
            norm = self._grad_norm()
        return StepResult(self._metrics(totals, kinds), norm,
                          engine.skipped_steps > skipped_before, self._loss_scale())

    def _metrics(self, totals: torch.Tensor, kinds: torch.Tensor) -> Metrics:
        return merge(core_metrics(totals[0] / self.micro_batches, totals[1], totals[2]),
                     denoiser_metrics.metrics(kinds))

    def eval_step(self, batch: Batch, predictions: bool = False) -> EvalResult:
        batch = to_device(batch, self.device)
        with torch.no_grad():
            out = self.engine(**batch)
            counts = span_accuracy_counts(out.logits, batch["labels"], self._vocab_size,
                                          TensorParallel.of_this_process())
        return EvalResult(out.token_losses.double().sum(), counts.total,
                          span_accuracy_metrics(counts.correct, counts.total),
                          counts.predictions if predictions else None)

    @property
    def _vocab_size(self) -> int:
        return module_vocab_size(self.engine.module)

    def _hold(self, loss_sum: torch.Tensor, norm: Optional[float]) -> bool:
        """Whether any rank's loss, gradient norm (ZeRO-0 fp32: known before the update) or
        gradients are not finite (all ranks agree: the update, a collective under ZeRO, is
        skipped on all or none)."""
        bad = ~torch.isfinite(loss_sum)
        if self._gradients is not None:
            bad = bad | self._gradients.bad
        if norm is not None and not math.isfinite(norm):
            bad = torch.ones_like(bad)
        bad = bad.double().reshape(1)
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        return bool(bad.item())

    def locate_nonfinite(self):
        """With --detect-nan-layers, the finding of the step itself; else the last step's
        micro-batches again (its update held back; not in fp16, where DeepSpeed decides; the
        random generators as the step found them, so dropout draws the same masks), forward
        through the engine's module (ZeRO-3's gathering hooks included) and backward
        with torch.autograd.grad over the parameters: the gradients are returned and dropped,
        never accumulated, and DeepSpeed's gradient hooks and reductions do not run."""
        if self._layers is not None:
            return self._layers.first(), "watched"
        if self._rng is not None:
            set_rng_state(self._rng, self.device.type)
        params = [p for p in self.engine.module.parameters() if p.requires_grad]
        watch = NonFiniteWatch(self.engine.module).attach()
        try:
            for micro, batch in enumerate(self.last_batches):
                watch.new_micro_batch(micro)
                out = self.engine.module(**batch)  # not the engine's forward: it expects
                torch.autograd.grad(out.objective, params, allow_unused=True)  # its backward
            return watch.first(), "re-run" if self._held else "updated"
        finally:
            watch.detach()

    def _unreported_grad_norm(self) -> Optional[float]:
        """The clipping norm where DeepSpeed computes it without keeping it (ZeRO-0 in fp32):
        taken over the reduced gradients before the step clips them (tensor shards counted
        once)."""
        engine = self.engine
        if engine.zero_optimization_stage() != 0 or engine.bfloat16_enabled() \
                or engine.fp16_enabled():
            return None
        if self._clip_experts:  # experts over ranks: DeepSpeed's ZeRO-0 norm mixes them
            return experts.global_grad_norm(engine.module)
        return deepspeed_internals.zero0_fp32_grad_norm(engine.module.parameters(), parallel_state)

"""The pipeline implementation of the training-step seam, on DeepSpeed's PipelineEngine.

`PipelineStep.step` runs one `train_batch` (1F1B over this data-parallel rank's micro-batches,
tied and data-parallel gradient reduction, the optimizer step) and returns what the loop
expects of any TrainStep, on every stage alike: the loss (it lives on the last stage), the
input tokens (counted on the first) and the target tokens (on the last) are summed over the
pipeline group, so rank 0, on the first stage, logs the same line as without a pipeline.

Only the first and the last stage read batches: the first feeds (encoder ids, decoder ids,
encoder mask, decoder mask) into the pipe, the last gets the labels; the stages between never
touch the loader.

The gradient norm: DeepSpeed's ZeRO-1, bf16 and fp16 optimizers count tensor shards on every
tensor rank, replicated weights on tensor rank 0 and tied copies once. Its fp32 ZeRO-0 path
(engine.clip_fp32_gradients) does not: it counts replicated weights only on the first stage
and tied weights on every stage that holds them. There we clip ourselves, in a pre-hook of the
optimizer step, with the norm taken as the other paths take it, and DeepSpeed's clipping is off.
"""

from __future__ import annotations

import collections
import math
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megatron import deepspeed_internals, parallel_state
from megatron.model.t5 import compile_blocks
from megatron.pipeline.module import (
    build_pipeline_module,
    single_process_buffer_names,
    single_process_names,
)
from megatron.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.tensor_parallel.group import TensorParallel
from megatron.training import experts
from megatron.training.engine import build_optimizer
from megatron.training.profiling import PIPELINE_BATCH, PIPELINE_SUMS
from megatron.training import denoiser_metrics, step_metrics
from megatron.training.denoiser_metrics import KIND_KEY
from megatron.training.step import (LOSS, Batch, EngineStep, EvalResult, StepResult, core_metrics,
                                    span_accuracy_counts, span_accuracy_metrics)
from megatron.training.step_metrics import SUM, Metric


class PipelineLoss:
    """The last stage's loss function; keeps the sums the step reports."""

    def __init__(self, vocab_size: int, label_smoothing: float, device,
                 tp: TensorParallel) -> None:
        self.vocab_size, self.label_smoothing, self.tp = vocab_size, label_smoothing, tp
        self.evaluating = False
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)
        """Training: [sum of micro-batch mean losses, target tokens, 0]; evaluation: [sum of
        token losses, target tokens, target tokens predicted right (span_accuracy_counts)]."""
        self.predictions: Optional[torch.Tensor] = None
        """Evaluation: the last batch's greedy prediction (step.greedy_tokens)."""
        self.kind_sums = denoiser_metrics.zeros(device)
        """Training: denoiser_metrics.kind_sums of the micro-batches whose kinds `kinds` held."""
        self.kinds: collections.deque = collections.deque()
        """The denoiser kinds of the micro-batches fed to this (last) stage and not yet through
        the loss, in order (DeepSpeed computes their losses in the order it loads them)."""

    def __call__(self, outputs, labels: torch.Tensor) -> torch.Tensor:
        # the head's logits, with the balancing losses of a Mixture-of-Experts model
        logits, aux = outputs if isinstance(outputs, tuple) else (outputs, None)
        token_losses = vocab_parallel_cross_entropy(logits, labels, self.vocab_size,
                                                    label_smoothing=self.label_smoothing,
                                                    tp=self.tp)
        count = (labels != -100).sum()
        if self.evaluating:
            counts = span_accuracy_counts(logits.detach(), labels, self.vocab_size, self.tp)
            self.sums[0] += token_losses.detach().double().sum()
            self.sums[1] += count
            self.sums[2] += counts.correct
            self.predictions = counts.predictions
            return token_losses.detach().sum()
        loss = token_losses.sum() / count.clamp(min=1)
        if self.kinds:
            self.kind_sums += denoiser_metrics.kind_sums(token_losses, labels,
                                                         self.kinds.popleft())
        self.sums[0] += loss.detach().double()
        self.sums[1] += count
        # what training minimises (T5Output.objective); the loss reported is the LM loss
        return loss if aux is None else loss + aux.reshape(())


class PipelineStep(EngineStep):
    """DeepSpeed's PipelineEngine with tensor and data parallelism (ZeRO 0 or 1)."""

    def __init__(self, engine, loss: PipelineLoss, device: torch.device,
                 clip_grad: float = 0.0, expert_bias_update_rate: float = 1e-3) -> None:
        super().__init__(engine, device, expert_bias_update_rate=expert_bias_update_rate)
        self.loss = loss
        self.first, self.last = engine.is_first_stage(), engine.is_last_stage()
        if engine.zero_optimization_stage() == 0 and \
                parallel_state.get_data_parallel_world_size() == 1:
            # Nothing to reduce: DeepSpeed would still flatten every gradient and all-reduce it
            # over a group of one (bench/RESULTS.md: up to 9% of a one-micro-batch step).
            deepspeed_internals.skip_lone_pipeline_allreduce(engine)
        self.clip_grad = clip_grad
        self._stage_sums = step_metrics.Reducer(
            SUM, parallel_state.get_pipeline_model_parallel_group(), device)
        self._norm: Optional[float] = None
        self._own_norm = engine.zero_optimization_stage() == 0 and not (
            engine.bfloat16_enabled() or engine.fp16_enabled())
        if self._own_norm:
            deepspeed_internals.run_before_optimizer_step(engine, self._clip)

    # The seam --------------------------------------------------------------------------------
    def step(self, batches: Iterator[Batch], lr: float) -> StepResult:
        engine = self.engine
        for group in engine.optimizer.param_groups:
            group["lr"] = lr
        self.loss.evaluating = False
        self.loss.sums.zero_()
        self.loss.kind_sums.zero_()
        self.loss.kinds.clear()
        inputs = torch.zeros((), dtype=torch.float64, device=self.device)
        skipped_before = engine.skipped_steps
        feed = self._feed(batches, self.micro_batches, inputs) \
            if self.first or self.last else None
        with self.ranges(PIPELINE_BATCH):  # the whole schedule: see training/profiling.py
            engine.train_batch(data_iter=feed)
        self.after_update()
        # each number lives on one stage (the loss and the kinds on the last, the input tokens
        # on the first): summed over the pipeline group, every stage reports the same
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        local = step_metrics.merge(
            core_metrics(self.loss.sums[0] if self.last else zero, inputs if self.first else zero,
                         self.loss.sums[1] if self.last else zero),
            denoiser_metrics.metrics(self.loss.kind_sums if self.last
                                     else self.loss.kind_sums * 0))
        with self.ranges(PIPELINE_SUMS):
            sums, = self._stage_sums([step_metrics.select(local, SUM)])
        sums[LOSS] = sums[LOSS] / self.micro_batches
        norm = self._norm if self._own_norm else self._grad_norm()
        return StepResult({name: Metric(value, SUM) for name, value in sums.items()}, norm,
                          engine.skipped_steps > skipped_before, self._loss_scale())

    def eval_step(self, batch: Batch, predictions: bool = False) -> EvalResult:
        self.loss.evaluating = True
        self.loss.sums.zero_()
        self.loss.predictions = None
        feed = self._feed(iter([batch]), 1, None) if self.first or self.last else None
        self.engine.eval_batch(feed, compute_loss=True, reduce_output=None, bcast_loss=False,
                               num_micro_batches=1)
        sums = self.loss.sums.clone() if self.last else torch.zeros_like(self.loss.sums)
        dist.all_reduce(sums, group=parallel_state.get_pipeline_model_parallel_group())
        self.loss.evaluating = False
        return EvalResult(sums[0], sums[1], span_accuracy_metrics(sums[2], sums[1]),
                          self._first_stage_predictions(batch) if predictions else None)

    def _first_stage_predictions(self, batch: Batch) -> Optional[torch.Tensor]:
        """The last stage's greedy prediction of `batch`, sent to the first stage (which logs
        the samples); None on the stages between. One stage: its own."""
        if self.first and self.last:
            return self.loss.predictions
        if not (self.first or self.last):
            return None
        if self.last:
            dist.send(self.loss.predictions.contiguous(),
                      dst=parallel_state.get_pipeline_model_parallel_first_rank())
            return None
        out = torch.empty(batch["labels"].shape, dtype=torch.int64, device=self.device)
        dist.recv(out, src=parallel_state.get_pipeline_model_parallel_last_rank())
        return out

    def save(self, root: Path, tag: str, iteration: int) -> None:
        super().save(root, tag, iteration)
        if experts.uses_deepspeed_experts(self.engine.module):
            # DeepSpeed's MoE checkpoint writes each stage's weights into its model file
            # (mp_rank_MM), not the layer files; the stage layout still goes beside them
            self.engine.module.write_layers_file(str(root / tag))

    def _weight_names(self):
        return single_process_names(self.engine.module)

    def _buffer_names(self):
        return single_process_buffer_names(self.engine.module)

    # Pieces ----------------------------------------------------------------------------------
    def _feed(self, batches: Iterator[Batch], count: int, inputs: Optional[torch.Tensor]):
        """DeepSpeed's (inputs, labels) pairs from `count` batches; counts encoder tokens."""
        for _ in range(count):
            batch = next(batches)
            if inputs is not None:
                inputs += batch["encoder_attention_mask"].sum().to(inputs.device)
                if self.last and KIND_KEY in batch:  # training: the loss reports per kind
                    self.loss.kinds.append(batch[KIND_KEY])
            masks = batch["encoder_attention_mask"].long(), batch["decoder_attention_mask"].long()
            yield (batch["encoder_input_ids"], batch["decoder_input_ids"], *masks), batch["labels"]

    def _clip(self) -> None:
        # this stage's squares summed over the tensor and pipeline ranks of this data-parallel
        # replica (and the expert-parallel ranks for the experts): tensor shards on every tensor
        # rank, replicated weights on tensor rank 0, tied copies once (DeepSpeed marks the
        # extra ones `ds_pipe_replicated`)
        self._norm = experts.global_grad_norm(self.engine.module)
        if math.isfinite(self._norm):
            experts.clip_gradients(self.engine.module, self._norm, self.clip_grad)


def build_pipeline_step(config, watchdog, writer) -> PipelineStep:
    """The model cut into stages, our AdamW and DeepSpeed's PipelineEngine (collective)."""
    import deepspeed
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology


    runtime, parallel, model = config.runtime, config.parallel, config.model
    device = runtime.torch_device()
    cut = config.pipeline_cut()
    for line in cut.describe():
        writer.write_text(line)
    topology = PipeModelDataParallelTopology(num_pp=parallel.pipeline_model_parallel_size,
                                             num_mp=parallel.tensor_model_parallel_size,
                                             num_dp=parallel.data_parallel_size)
    tp = TensorParallel.of_this_process()
    loss = PipelineLoss(model.t5.vocab_size, model.label_smoothing, device, tp)
    padded = model.t5.padded_vocab_size(model.make_vocab_size_divisible_by,
                                        parallel.tensor_model_parallel_size)
    collective_s = 60 * runtime.distributed_timeout_minutes
    with watchdog.watch("building this pipeline stage (tied weights are broadcast between "
                        "stages)", collective_s):
        module = build_pipeline_module(model.t5, cut, topology, padded, model.attention_backend,
                                       loss, model.checkpoint_activations,
                                       model.checkpoint_num_layers, device=device,
                                       tensor_parallel=tp)
    experts.prepare(module)  # expert parallelism on DeepSpeed's conventions
    if model.compile:
        compile_blocks(module)
    counts = torch.zeros(parallel.pipeline_model_parallel_size, dtype=torch.int64,
                         device=device)
    counts[parallel_state.get_pipeline_model_parallel_rank()] = sum(
        p.numel() for p in module.parameters())
    dist.all_reduce(counts, group=parallel_state.get_pipeline_model_parallel_group())
    writer.write_text("parameters per stage on tensor rank 0 (tied copies on each stage that "
                      "holds one): " + ", ".join(f"{c:,}" for c in counts.tolist()))
    ds_json = config.deepspeed_json()
    clip = float(ds_json.get("gradient_clipping", 0.0) or 0.0)
    own_norm = config.zero.stage == 0 and config.precision.precision == "fp32"
    if own_norm:
        ds_json["gradient_clipping"] = 0.0  # clipped by PipelineStep._clip
    adamw = build_optimizer(config.optimizer, config.zero.offload_optimizer, runtime.device_type,
                            module)
    with watchdog.watch("pipeline engine setup (DeepSpeed connects the stages)", collective_s):
        engine, _, _, _ = deepspeed.initialize(model=module, optimizer=adamw, config=ds_json,
                                               dist_init_required=False)
    return PipelineStep(engine, loss, device, clip if own_norm else 0.0,
                        model.expert_bias_update_rate)

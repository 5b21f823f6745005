"""Device memory of one training rank: ZeRO's model states plus one micro-batch's activations.

Model states follow ZeRO (Rajbhandari et al., 2020) as DeepSpeed implements them, per parameter
of this tensor rank (Psi) and data-parallel size N:

    precision   params  grads  master  Adam moments   (16-bit: master and moments are fp32)
    fp32        4       4      0 (*)   8              (*) stages 1, 2 keep a 4-byte clone / N
    bf16, fp16  2       2      4       8

    stage 0: nothing divided;  1: master + moments / N;  2: also grads / N;  3: also params / N
    (stage 3 keeps parameters of at most stage3_param_persistence_threshold elements whole).

Offloading moves master, moments and the gradient partition (stages 2, 3; stage 1 keeps its full
16-bit gradients on the device) to cpu/nvme, and with `offload_param` the parameter partition.
`buffers` are DeepSpeed's transient ones (`ZeroBuckets`); a 16-bit step also converts the
gradient partition to fp32, at a time when no activations are alive.

`device_type='cuda'` sums everything as alive at once (an upper bound on max_memory_allocated).
`device_type='cpu'` is a CPU run's resident memory, calibrated against bench/bench_training.py:
what is offloaded to cpu shares the same memory; `torch.empty` maps pages lazily, so a bucket
costs only the pages DeepSpeed writes (at most the model's gradients); gradients of stages 0-2
are freed by every step, so with one micro-batch per step they never meet the activations; and
fp32 ZeRO-3 keeps a 4-byte clone / N (stage3.py compares the partition's torch.device with a
device-name string, never equal, so it clones; the same code runs on CUDA). ZeRO 1-2 offload's
staging buffers and ZeRO-3's prefetch bucket are counted as measured there.

Activations are the tensors autograd saves in forward: each layer's terms are in
megatron/model/activations.py (beside the FLOPs); here they are added up for a rank.

With a pipeline (a `Cut` of P > 1 stages; ZeRO 0 or 1) a rank holds its stage's parameters
(`stage_parameter_numels`) and their states; bf16 with ZeRO-1 runs DeepSpeed's BF16 optimizer
(whole 16-bit gradients plus an fp32 accumulation buffer, an fp32 all-reduce bucket). Its
activations are the terms above of the stage's layers times the micro-batches in flight under
1F1B, min(P - s, m) on stage s, plus what DeepSpeed's engine keeps per micro-batch (the received
tuple, the ints passed on, the output; on the last stage the previous logits in its other buffer)
and its receive buffers (`pipeline_buffers`). DeepSpeed recomputes runs of checkpoint_num_layers
layers counted from the stage's first layer, if they hold blocks only: others run whole.
"""

from __future__ import annotations

import math
from collections import namedtuple
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

from megatron.model.activations import ActivationShape, micro_batch_activations
from megatron.model.config import T5Config
from megatron.model.meta import is_expert_parameter, parameter_numels

if TYPE_CHECKING:
    from megatron.config import Layout
    from megatron.pipeline.partition import Cut

PRECISIONS = ("fp32", "bf16", "fp16")
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
ATTENTION_KERNELS = ("fused", "eager")
DEVICE_TYPES = ("cuda", "cpu")


@dataclass(frozen=True)
class ZeroBuckets:
    """DeepSpeed's bucket settings, in elements, at DeepSpeed's defaults.

    Stages 1 and 2 allocate reduce_bucket_size elements of gradient dtype (twice with
    overlap_comm); stage 3 one bucket plus the parameters it gathers, at most
    stage3_max_live_parameters (prefetches included; with the default max_reuse_distance a model
    under 1e9 parameters may stay nearly all gathered from forward to backward). The all-gather
    bucket costs nothing: stages 1 and 2 gather into the flat parameter buffer in place."""

    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_param_persistence_threshold: int = 100_000
    overlap_comm: Optional[bool] = None
    """None: DeepSpeed's default, true for stage 3 only."""
    contiguous_gradients: bool = True

    @classmethod
    def from_zero_config(cls, zero: Dict) -> "ZeroBuckets":
        """From the `zero_optimization` section of a DeepSpeed config (absent keys: defaults)."""
        return cls(**{name: zero[name] for name in cls.__dataclass_fields__ if name in zero})


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank. parameters, gradients, optimizer_states (master weights + moments) and
    buffers are what stays on the device; offloaded is what moved to cpu/nvme. activations is
    the peak of one micro-batch, activations_saved what forward leaves saved for backward.
    total: the device peak (device_type 'cpu': the resident peak, with what is offloaded to
    cpu)."""

    parameters: int
    gradients: int
    optimizer_states: int
    activations: int
    activations_saved: int
    buffers: int
    total: int
    offloaded: int
    between_steps: int = 0
    """What stays allocated from one step to the next (model states, kept buffers; 'cpu': with
    what is offloaded to cpu); not in `table`."""
    pipeline_buffers: int = 0
    """A pipeline stage's receive buffers (activations in, gradients back); in total."""
    in_flight: int = 1
    """Micro-batches whose activations a stage holds at once (1F1B: min(P - s, m))."""

    def table(self) -> List[str]:
        """Printable lines, one per field (the pipeline's buffers only with a pipeline)."""
        rows = [("parameters", self.parameters), ("gradients", self.gradients),
                ("optimizer states", self.optimizer_states),
                ("activations (peak)", self.activations),
                ("  saved after forward", self.activations_saved), ("buffers", self.buffers),
                ("total on device", self.total), ("offloaded (cpu/nvme)", self.offloaded)]
        if self.pipeline_buffers:
            rows.insert(6, ("pipeline send/recv", self.pipeline_buffers))
        return [f"{name:<22}{value / 2 ** 30:>10.3f} GiB" for name, value in rows]


def stage_parameter_numels(config: T5Config, cut: "Cut", stage: int,
                           tensor_parallel_size: int = 1,
                           make_vocab_size_divisible_by: int = 128,
                           expert_parallel_size: int = 1) -> Dict[str, int]:
    """`parameter_numels` of what pipeline `stage` holds (module docstring; its experts over
    `expert_parallel_size` ranks); tied weights are counted on every stage that holds a copy."""
    enc, dec = cut.stage_blocks(stage)
    last, holds = stage == cut.stages - 1, {"encoder": enc, "decoder": dec}

    def keep(name: str) -> bool:
        stack, _, rest = name.partition(".")
        if name == "shared.weight":  # embeds on stage 0 and the first decoder stage; tied head
            return stage == 0 or (len(dec) > 0 and dec.start == 0) or \
                (last and config.tie_word_embeddings)
        if name == "lm_head.weight" or stack == "decoder" and rest.startswith("final_layer"):
            return last
        if rest.startswith("final_layer_norm"):
            return len(enc) > 0 and enc.stop == cut.encoder_layers
        if "relative_attention_bias" in rest:
            return len(holds[stack]) > 0
        return int(rest.split(".")[1]) in holds[stack]  # {stack}.block.{i}....

    return {name: n for name, n in parameter_numels(
        config, tensor_parallel_size, make_vocab_size_divisible_by,
        expert_parallel_size).items() if keep(name)}


def _validate(tp, dp, zero_stage, precision, offload_optimizer, offload_param, sizes,
              checkpoint_num_layers, attention_kernel, device_type) -> List[str]:
    out = [f"{name} must be a positive integer, not {value!r}" for name, value in
           (("tensor_parallel_size", tp), ("data_parallel_size", dp), *sizes.items(),
            ("checkpoint_num_layers", checkpoint_num_layers)) if not isinstance(value, int)
           or value < 1]
    if device_type not in DEVICE_TYPES:
        out.append(f"device_type must be 'cuda' or 'cpu', not {device_type!r}")
    if zero_stage not in (0, 1, 2, 3):
        out.append(f"zero_stage must be 0, 1, 2 or 3, not {zero_stage!r}")
    if precision not in PRECISIONS:
        out.append(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    if attention_kernel not in ATTENTION_KERNELS:
        out.append(f"attention_kernel must be 'fused' or 'eager', not {attention_kernel!r}")
    for name, value in (("offload_optimizer", offload_optimizer),
                        ("offload_param", offload_param)):
        if value not in OFFLOAD_DEVICES:
            out.append(f"{name} must be one of {', '.join(OFFLOAD_DEVICES)}, not {value!r}")
    if offload_optimizer != "none" and zero_stage == 0:
        out.append("offload_optimizer needs ZeRO stage 1, 2 or 3")
    if offload_optimizer == "nvme" and zero_stage != 3:
        out.append("offload_optimizer nvme needs ZeRO stage 3")
    if offload_param != "none" and zero_stage != 3:
        out.append("offload_param needs ZeRO stage 3")
    return out


def estimate_memory(layout: "Layout", device_type: str = "cuda", attention_kernel: str = "fused",
                    pipeline_cut: Optional["Cut"] = None,
                    pipeline_stage: int = 0, prompt_length: int = 0,
                    frozen_model: bool = False) -> MemoryEstimate:
    """Per-rank memory of training `layout` with DeepSpeed ZeRO and Adam(W).

    Args:
        layout: what a rank holds and computes (megatron.config.Layout): the model and how it is
            built (vocabulary padding, activation checkpointing), the tensor, data and expert
            parallel sizes, one micro-batch (size, sequence lengths) and the micro-batches per
            step, the precision ('fp32', 'bf16' or 'fp16'; 16-bit: fp32 master weights), the
            ZeRO stage and offload ('none', 'cpu' or 'nvme'), DeepSpeed's bucket sizes from its
            JSON's zero_optimization (absent: DeepSpeed's defaults). With 'cpu' and more than one
            micro-batch per step, stage 0-2 gradients live through the forward ('cuda' always
            counts them). A Mixture-of-Experts model's experts are split over the expert-parallel
            size: each rank holds E / EP of them, and ZeRO partitions their states over the
            data-parallel size / EP ranks holding the same experts.
        device_type: 'cuda' (device memory, everything alive at once) or 'cpu' (the resident
            memory a CPU run adds to its interpreter and libraries; see the module docstring).
        attention_kernel: 'fused' (sdpa's flash / memory-efficient kernels: the model's 'auto' on
            CUDA) or 'eager' (probabilities kept: attention_backend 'eager', torch's math path,
            and what 'auto' runs on the CPU, model/eager_attention.py).
        pipeline_cut, pipeline_stage: with a cut of more than one stage, the memory of a rank
            of that stage (see the module docstring); None or one stage: no pipeline.
        prompt_length: prompt tuning (megatron/model/prompt.py): the encoder input grows by
            this many vectors, a [prompt_length, d_model] parameter on every rank; with
            frozen_model, the model's parameters are held (16-bit ones in 16 bits) but have no
            gradients, optimizer states or ZeRO partitions: only the prompt's are counted.

    Raises:
        ValueError: a setting out of range or a combination DeepSpeed does not run.
        ConfigError: the model does not split over the tensor-parallel size.
    """
    model, parallel, batch = layout.model, layout.parallel, layout.batch
    config, tp, dp = model.t5, parallel.tensor_model_parallel_size, parallel.data_parallel_size
    ep, precision, zero = parallel.expert_model_parallel_size, layout.precision.precision, \
        layout.zero
    e, d = layout.encoder_seq_length + prompt_length, layout.decoder_seq_length
    micro_batches = batch.gradient_accumulation_steps
    buckets = ZeroBuckets.from_zero_config(layout.deepspeed.get("zero_optimization", {}))
    sizes = {"micro_batch_size": batch.micro_batch_size, "encoder_seq_length": e,
             "decoder_seq_length": d, "gradient_accumulation_steps": micro_batches}
    problems = _validate(tp, dp, zero.stage, precision, zero.offload_optimizer,
                         zero.offload_param, sizes, model.checkpoint_num_layers,
                         attention_kernel, device_type)
    pipelined = pipeline_cut is not None and pipeline_cut.stages > 1
    if pipelined and pipeline_stage not in range(pipeline_cut.stages):
        problems.append(f"pipeline_stage must be 0 .. {pipeline_cut.stages - 1}, not "
                        f"{pipeline_stage!r}")
    if prompt_length and (pipelined or zero.stage == 3 or ep > 1):
        problems.append("prompt tuning is estimated without a pipeline, ZeRO stage 3 or expert "
                        "parallelism")
    if pipelined and zero.stage not in (0, 1):
        problems.append("a pipeline runs ZeRO stage 0 or 1 only (DeepSpeed's pipeline engine)")
    if problems:
        raise ValueError("cannot estimate memory: " + "; ".join(problems))
    shape = ActivationShape(batch.micro_batch_size, config.d_model, config.inner_dim // tp,
                            config.d_ff // tp, config.num_heads // tp,
                            4 if precision == "fp32" else 2, precision == "fp16",
                            config.dropout_rate > 0, attention_kernel, config)
    divisor = model.make_vocab_size_divisible_by
    vocab = config.padded_vocab_size(divisor, tp) // tp
    if pipelined:
        numels = stage_parameter_numels(config, pipeline_cut, pipeline_stage, tp, divisor, ep)
        activations = _stage_activations(shape, tp, vocab, e, d, pipeline_cut, pipeline_stage,
                                         micro_batches, model.checkpoint_num_layers
                                         if model.checkpoint_activations else 0)
        experts = {n for n in numels if is_expert_parameter(n)} if ep > 1 else set()
        return _stage_estimate([n for name, n in numels.items() if name not in experts],
                               dp, zero.stage, precision, zero.offload_optimizer, buckets,
                               device_type, activations, [numels[name] for name in experts],
                               dp // ep)
    numels = parameter_numels(config, tp, divisor, ep)
    states = (zero.stage, precision, zero.offload_optimizer, zero.offload_param, buckets)
    if prompt_length:
        return _prompt_estimate(list(numels.values()), prompt_length * config.d_model,
                                frozen_model, dp, states, shape, tp, vocab, e, d, model,
                                device_type, micro_batches)
    params, grads, optimizer, buffers, step, offloaded = _model_states(
        list(numels.values()), dp, *states)
    if config.is_moe and ep > 1:  # the experts' states over expert-data ranks
        dense = [n for name, n in numels.items() if not is_expert_parameter(name)]
        expert = [n for name, n in numels.items() if is_expert_parameter(name)]
        parts = [_model_states(dense, dp, *states), _model_states(expert, dp // ep, *states)]
        params, grads, optimizer, _, step, offloaded = (
            sum(values) for values in zip(*parts))
    saved, activations = micro_batch_activations(shape, tp, vocab, e, d,
                                                 model.checkpoint_activations,
                                                 model.checkpoint_num_layers)
    if device_type == "cpu":
        return _host_estimate(list(numels.values()), dp, *states, saved, activations,
                              micro_batches)
    return MemoryEstimate(parameters=params, gradients=grads, optimizer_states=optimizer,
                          activations=activations, activations_saved=saved, buffers=buffers,
                          total=params + grads + optimizer + buffers + max(activations, step),
                          offloaded=offloaded, between_steps=params + grads + optimizer + buffers)


def estimate_run(config: "Layout", device_type: str, stage: Optional[int] = None,
                 cut: Optional["Cut"] = None, prompt_length: int = 0,
                 frozen_model: bool = False) -> MemoryEstimate:
    """`estimate_memory` for a run's layout (`RunConfig.layout()`, or `layout_from_flags` in
    megatron/arguments.py) on `device_type` ('cuda' or 'cpu'), with the attention kernel that
    the model's 'auto' backend picks there (fused on CUDA, eager on the CPU). What `--dry-run`,
    the training bench and the planner share. With a pipeline: a rank of `stage`, or with None
    of the stage with the largest total (`estimate_stages` gives them all); `cut`: the layout's
    `pipeline_cut()` when the caller has it already; prompt_length, frozen_model: prompt
    tuning (see estimate_memory)."""
    if config.parallel.pipeline_model_parallel_size == 1:
        cut = None
    elif cut is None:
        cut = config.pipeline_cut()
    if cut is not None and stage is None:
        return max(estimate_stages(config, device_type, cut), key=lambda e: e.total)
    kernel = "fused" if device_type == "cuda" else "eager"
    return estimate_memory(config, device_type, kernel, cut, stage or 0, prompt_length,
                           frozen_model)


def estimate_stages(config: "Layout", device_type: str,
                    cut: Optional["Cut"] = None) -> List[MemoryEstimate]:
    """`estimate_run` of every pipeline stage in stage order (without a pipeline: one)."""
    stages = config.parallel.pipeline_model_parallel_size
    if stages > 1 and cut is None:
        cut = config.pipeline_cut()
    return [estimate_run(config, device_type, s, cut) for s in range(stages)]


def _prompt_estimate(numels, prompt_numel, frozen_model, dp, states, shape, tp, vocab, e, d,
                     model, device_type, micro_batches) -> MemoryEstimate:
    """estimate_memory of prompt tuning: the states of what trains (the prompt alone with a
    frozen model), plus the frozen parameters as they are held."""
    trained = [prompt_numel] if frozen_model else numels + [prompt_numel]
    frozen = 0
    if frozen_model:  # held in the model's dtype, no fp32 master, never partitioned
        frozen = (4 if states[1] == "fp32" else 2) * sum(numels)
    saved, activations = micro_batch_activations(shape, tp, vocab, e, d,
                                                 model.checkpoint_activations,
                                                 model.checkpoint_num_layers)
    if device_type == "cpu":
        out = _host_estimate(trained, dp, *states, saved, activations, micro_batches)
        return replace(out, parameters=out.parameters + frozen, total=out.total + frozen,
                       between_steps=out.between_steps + frozen)
    params, grads, optimizer, buffers, step, offloaded = _model_states(trained, dp, *states)
    params += frozen
    return MemoryEstimate(parameters=params, gradients=grads, optimizer_states=optimizer,
                          activations=activations, activations_saved=saved, buffers=buffers,
                          total=params + grads + optimizer + buffers + max(activations, step),
                          offloaded=offloaded, between_steps=params + grads + optimizer + buffers)


def optimizer_bytes(stage: int, precision: str, numel: int) -> int:
    """Master weights and Adam's moments of `numel` elements (see the table above)."""
    master = 0 if precision == "fp32" and stage in (0, 3) else 4
    return (master + 8) * numel


def _model_states(numels, dp, stage, precision, offload_optimizer, offload_param, buckets):
    """(parameters, gradients, optimizer states, buffers, step transient, offloaded) bytes.
    The step transient is the fp32 copy of the gradient partition a 16-bit step makes."""
    psi = sum(numels)
    persistent = sum(n for n in numels if n <= buckets.stage3_param_persistence_threshold)
    shard = lambda n: math.ceil(n / dp)  # noqa: E731
    pb = 4 if precision == "fp32" else 2  # params and grads (DeepSpeed accumulates in this dtype)
    params = pb * (persistent + shard(psi - persistent) if stage == 3 else psi)
    grads = pb * (shard(psi) if stage >= 2 else psi)
    optimizer = optimizer_bytes(stage, precision, shard(psi) if stage >= 1 else psi)
    offloaded = 0
    if offload_optimizer != "none":  # the host also takes the gradient partition, fp32 < stage 3
        offloaded += optimizer + (4 if stage < 3 else pb) * shard(psi)
        optimizer, grads = 0, grads if stage == 1 else 0
    if offload_param != "none":
        offloaded += pb * shard(psi - persistent)
        params = pb * persistent
    step = 4 * (psi if stage == 0 else shard(psi)) \
        if precision != "fp32" and offload_optimizer == "none" else 0
    overlap = stage == 3 if buckets.overlap_comm is None else buckets.overlap_comm
    bucket = pb * buckets.reduce_bucket_size if buckets.contiguous_gradients else 0
    if stage == 0:  # the engine all-reduces flattened buckets of gradients
        buffers = pb * min(buckets.reduce_bucket_size, psi) if dp > 1 else 0
    elif stage < 3:
        buffers = bucket * (2 if overlap else 1)
    else:
        buffers = bucket + pb * min(buckets.stage3_max_live_parameters, psi - persistent)
    return params, grads, optimizer, buffers, step, offloaded


def _host_estimate(numels, dp, stage, precision, offload_optimizer, offload_param, buckets,
                   saved, activations, accumulation) -> MemoryEstimate:
    """estimate_memory for device_type 'cpu': the resident peak of a CPU run, phase by phase."""
    params, grads, optimizer, _, step, offloaded = _model_states(
        numels, dp, stage, precision, offload_optimizer, offload_param, buckets)
    psi = sum(numels)
    persistent = sum(n for n in numels if n <= buckets.stage3_param_persistence_threshold)
    shard = math.ceil(psi / dp)
    pb = 4 if precision == "fp32" else 2
    clone = 4 * shard if stage == 3 and precision == "fp32" else 0  # see the module docstring
    if offload_optimizer == "none":
        optimizer += clone
    else:
        offloaded += clone
    # what _model_states moved off the device, by destination; nvme is not memory
    moved_optimizer = (optimizer_bytes(stage, precision, shard) + clone
                       + (4 if stage < 3 else pb) * shard) if offload_optimizer != "none" else 0
    moved_params = pb * math.ceil((psi - persistent) / dp) if offload_param != "none" else 0
    in_ram = (moved_optimizer if offload_optimizer == "cpu" else 0) + \
        (moved_params if offload_param == "cpu" else 0)
    # A bucket's pages are written only as gradients arrive: at most the model's gradients.
    overlap = stage == 3 if buckets.overlap_comm is None else buckets.overlap_comm
    if stage == 0:
        bucket = pb * min(buckets.reduce_bucket_size, psi) if dp > 1 else 0
    elif not buckets.contiguous_gradients:
        bucket = 0
    else:
        copies = 2 if overlap and stage < 3 else 1
        bucket = pb * min(copies * buckets.reduce_bucket_size, psi)
    # ZeRO 1-2 offload stages the host step: the 16-bit partition it copies back, and two
    # gradient buffers of the largest parameter's size (one each side)
    staging = pb * shard + 2 * pb * max(numels) if offload_optimizer != "none" and stage < 3 \
        else 0
    resident = params + optimizer + in_ram + staging
    if stage == 3:
        # the bucket is made once and kept; gathered parameters live from forward to backward,
        # and a prefetching all-gather holds its bucket a second time for a moment (measured:
        # the peak falls by that much with a small stage3_prefetch_bucket_size)
        gathered = pb * (min(buckets.stage3_max_live_parameters, psi - persistent)
                         + min(buckets.stage3_prefetch_bucket_size, psi - persistent))
        resident += grads + bucket
        phases = (activations + gathered, step)
        buffers = bucket + gathered
    else:
        # forward and the start of backward; the end of backward; the optimizer step
        phases = (activations + (grads if accumulation > 1 else 0), grads + bucket, grads + step)
        buffers = bucket + staging
    return MemoryEstimate(parameters=params, gradients=grads, optimizer_states=optimizer,
                          activations=activations, activations_saved=saved, buffers=buffers,
                          total=resident + max(phases), offloaded=offloaded,
                          between_steps=resident)


# Pipeline stages ---------------------------------------------------------------------------
PIPELINE_ALLREDUCE_ELEMENTS = 500_000_000  # DeepSpeed's MEMORY_OPT_ALLREDUCE_SIZE
_StageActivations = namedtuple("_StageActivations", "saved peak pipeline_buffers in_flight m")


_KIND_CODES = {("embed", "encoder"): "embed_encoder", ("bias", "encoder"): "encoder_bias",
               ("block", "encoder"): "E", ("final_norm", "encoder"): "finish_encoder",
               ("embed", "decoder"): "embed_decoder", ("bias", "decoder"): "decoder_bias",
               ("block", "decoder"): "D", ("final_norm", "decoder"): "finish_decoder",
               ("head", None): "head"}


def _stage_layers(cut: "Cut", stage: int) -> List[str]:
    """The stage's layers (`Cut.layers`, in DeepSpeed's order) as the codes below: 'E' and 'D'
    a block, the other names the small layers."""
    return [_KIND_CODES[layer.kind, layer.stack] for layer in cut.stage_layers(stage)]


_FIELD_LENGTHS = {"encoder_output": "e", "enc_ids": "e", "enc_mask": "e", "dec_ids": "d",
                  "dec_mask": "d"}


def _wire(s: ActivationShape, cut: "Cut", stage: int, e: int, d: int) -> Tuple[int, int, int]:
    """(floating, int64, hidden state) bytes of the tuple stage `stage` sends on
    (`Cut.sent_after`: hidden state, encoder output, ids and masks)."""
    fields = cut.sent_after(stage)
    lengths = {"e": e, "d": d}
    hidden_len = e if cut.stage_layers(stage)[-1].stack == "encoder" else d
    hidden = s.a * s.b * s.D * hidden_len if "hidden" in fields else 0
    floating = hidden + s.a * s.b * s.D * e * ("encoder_output" in fields)
    ints = sum(8 * s.b * lengths[_FIELD_LENGTHS[f]] for f in fields
               if f in _FIELD_LENGTHS and f != "encoder_output")
    return floating, ints, hidden


def _stage_activations(s: ActivationShape, tp: int, vocab: int, e: int, d: int, cut: "Cut",
                       stage: int, micro_batches: int, chunk: int) -> _StageActivations:
    """A rank of pipeline `stage` under 1F1B (module docstring); chunk 0: no recompute."""
    a, b, D, P = s.a, s.b, s.D, cut.stages
    layers = _stage_layers(cut, stage)
    indices = [layer.index for layer in cut.stage_layers(stage)]
    sparse = {"E": set(s.config.sparse_blocks(False)), "D": set(s.config.sparse_blocks(True))}

    def block(kind: str, index: int) -> int:  # a sparse block saves its experts' terms
        if kind == "E":
            return s.encoder_block(e, index in sparse["E"])
        return s.decoder_block(d, e, index in sparse["D"])

    has = {k: k in layers for k in ("embed_encoder", "finish_encoder", "embed_decoder", "head")}
    # per kind: the blocks run whole (their saved bytes), the checkpointed runs (each run's
    # blocks' bytes, recomputed at once in backward)
    whole, whole_saved, runs = {"E": 0, "D": 0}, 0, {"E": [], "D": []}
    for i in range(0, len(layers), chunk or len(layers)):  # DeepSpeed's checkpointed runs
        run = layers[i:i + chunk] if chunk else layers
        at = indices[i:i + chunk] if chunk else indices
        if chunk and set(run) <= {"E", "D"}:
            runs[run[0]].append(sum(block(k, j) for k, j in zip(run, at)))
        else:
            whole = {k: n + run.count(k) for k, n in whole.items()}
            whole_saved += sum(block(k, j) for k, j in zip(run, at) if k in ("E", "D"))
    cross_entropy, head, logits, logits_grad = s.head(d, vocab, tp)
    saved = b * (8 if tp == 1 else 9) * (e * has["embed_encoder"] + d * has["embed_decoder"])
    saved += s.dropout * b * D * (e * (has["embed_encoder"] + has["finish_encoder"])
                                  + d * (has["embed_decoder"] + has["head"]))
    saved += s.norm(b * e) * has["finish_encoder"] + (s.norm(b * d) + cross_entropy) * has["head"]
    saved += whole_saved
    recompute = 0
    for kind, n in (("E", e), ("D", d)):
        if whole[kind] or runs[kind]:  # the stage's bias layer: buckets, fp16's clamp, the bias
            saved += 8 * n * n + s.fp16 * a * b * s.heads * n * n
            saved += (s.kernel == "fused" or len(runs[kind]) > 0) * (4 if a == 4 else a) * \
                b * s.heads * n * n
        saved += a * b * D * n * len(runs[kind])  # each checkpointed run's input
        recompute = max([recompute] + [run - a * b * D * n for run in runs[kind]])
    # DeepSpeed keeps per micro-batch the received tuple (stage 0: the batch), of the clone the
    # layers run on what they do not save (encoder output, ints passed on), the output or labels
    first, last = stage == 0, stage == P - 1
    in_float, in_int, _ = (0, 16 * b * (e + d), 0) if first else _wire(s, cut, stage - 1, e, d)
    out_float, out_int, out_hidden = (0, 0, 0) if last else _wire(s, cut, stage, e, d)
    held = in_float + in_int + out_int + out_hidden + 8 * b * d * last
    held += a * b * D * e * (not first and cut.blocks[stage] >= cut.encoder_layers)
    in_flight = min(P - stage, micro_batches)
    saved_all = in_flight * (saved + held)
    # the last stage: the previous micro-batch's logits stay in DeepSpeed's other output buffer
    transient = logits * (1 + (micro_batches > 1)) + max(logits_grad, recompute - head) \
        if last else recompute
    buffers = (0 if first else in_float + in_int) + out_float  # receive: activations, gradients
    return _StageActivations(saved_all, saved_all + transient, buffers, in_flight, micro_batches)


def _stage_estimate(numels, dp, stage, precision, offload_optimizer, buckets, device_type,
                    act: _StageActivations, expert_numels=(), expert_dp: int = 1
                    ) -> MemoryEstimate:
    """estimate_memory for a rank of a pipeline stage holding `numels` (and `expert_numels`,
    this rank's experts, whose optimizer states ZeRO partitions over the `expert_dp` ranks
    holding the same experts)."""
    pipe = act.pipeline_buffers
    extra = dict(pipeline_buffers=pipe, in_flight=act.in_flight)
    if device_type == "cpu":
        est = _host_estimate(list(numels) + list(expert_numels), dp, stage, precision,
                             offload_optimizer, "none", buckets, act.saved, act.peak, act.m)
        return replace(est, total=est.total + pipe, between_steps=est.between_steps + pipe,
                       **extra)
    if precision == "bf16" and stage == 1 and offload_optimizer == "none":
        # DeepSpeed's BF16 optimizer: whole 16-bit gradients and an fp32 accumulation buffer;
        # its step reads the fp32 partition in place; the all-reduce flattens fp32 buckets
        everything = list(numels) + list(expert_numels)
        psi = sum(everything)
        params, grads, step, offloaded = 2 * psi, 6 * psi, 0, 0
        optimizer = optimizer_bytes(1, precision, math.ceil(sum(numels) / dp)) + \
            optimizer_bytes(1, precision, math.ceil(sum(expert_numels) / expert_dp))
        buffers = 4 * min(PIPELINE_ALLREDUCE_ELEMENTS + max(everything), psi)
    else:
        parts = [_model_states(numels, dp, stage, precision, offload_optimizer, "none", buckets)]
        if expert_numels:
            parts.append(_model_states(list(expert_numels), expert_dp, stage, precision,
                                       offload_optimizer, "none", buckets))
        params, grads, optimizer, _, step, offloaded = (sum(values) for values in zip(*parts))
        buffers = _model_states(list(numels) + list(expert_numels), dp, stage, precision,
                                offload_optimizer, "none", buckets)[3]  # buckets: all of them
    states = params + grads + optimizer + buffers + pipe
    return MemoryEstimate(parameters=params, gradients=grads, optimizer_states=optimizer,
                          activations=act.peak, activations_saved=act.saved, buffers=buffers,
                          total=states + max(act.peak, step), offloaded=offloaded,
                          between_steps=states, **extra)

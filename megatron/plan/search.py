"""The candidate layouts of a request, their memory (the `--dry-run` estimate) and step time.

Every candidate is a command line of `megatron.pretrain_t5`; `layout_from_flags` resolves it as
the trainer would (DeepSpeed's JSON, the model, the pipeline cut, every check) and
`megatron.cost.memory.estimate_stages` gives what each pipeline stage holds: the numbers
`--dry-run --dry-run-device cuda` prints for the same flags. A candidate the trainer would refuse
is discarded with the trainer's own reason.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from megatron.arguments import layout_from_flags
from megatron.config import Layout
from megatron.model.config import T5Config
from megatron.pipeline.partition import Cut
from megatron.plan.cluster import Cluster
from megatron.plan.timing import LayoutShape, Machine, StepTime, block_flops, \
    model_flops_per_sample, step_time
from megatron.cost.report import all_to_all_bytes
from megatron.model.meta import parameter_numels
from megatron.cost.memory import MemoryEstimate, ZeroBuckets, estimate_stages, \
    stage_parameter_numels

GIB = 2 ** 30
# (ZeRO stage, offload optimizer, offload param); a pipeline runs ZeRO 0 or 1 only
STATE_OPTIONS = ((0, "none", "none"), (1, "none", "none"), (2, "none", "none"),
                 (3, "none", "none"), (2, "cpu", "none"), (3, "cpu", "none"),
                 (3, "cpu", "cpu"), (3, "nvme", "none"), (3, "nvme", "nvme"))


@dataclass(frozen=True)
class Request:
    """What to train: the model (preset name or JSON path), lengths, global batch, precision."""

    model_config: str
    encoder_seq_length: int
    decoder_seq_length: Optional[int]
    global_batch_size: int
    precision: str = "bf16"
    max_micro_batch: int = 64
    recompute: Tuple[bool, ...] = (False, True)
    """Whether to try without and with activation checkpointing."""


@dataclass
class Candidate:
    """One layout and what became of it."""

    tp: int
    pp: int
    dp: int
    micro_batch: int
    zero_stage: int
    offload_optimizer: str
    offload_param: str
    recompute: bool
    flags: List[str]
    problems: List[str] = field(default_factory=list)
    """Why the trainer would refuse it."""
    stages: List[MemoryEstimate] = field(default_factory=list)
    host_bytes_per_node: int = 0
    nvme_bytes_per_node: int = 0
    time: Optional[StepTime] = None
    short: Dict[str, float] = field(default_factory=dict)
    """What does not fit: {'device': GiB over, 'host': ..., 'nvme': ...}."""
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    micro_batches: int = 0
    """Per data-parallel rank per step (gradient accumulation steps)."""
    ep: int = 1
    """Expert-parallel size (a Mixture-of-Experts model)."""

    @property
    def fits(self) -> bool:
        """Sized, and nothing short."""
        return bool(self.stages) and not self.short

    @property
    def memory(self) -> Optional[MemoryEstimate]:
        """The stage with the largest device total (what a device must hold)."""
        return max(self.stages, key=lambda e: e.total) if self.stages else None

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def label(self) -> str:
        off = ""
        if self.offload_optimizer != "none":
            off = f", offload optimizer {self.offload_optimizer}"
            if self.offload_param != "none":
                off += f" + params {self.offload_param}"
        ep = f" (EP {self.ep})" if self.ep > 1 else ""
        return (f"TP {self.tp} x PP {self.pp} x DP {self.dp}{ep}, micro batch "
                f"{self.micro_batch}, ZeRO {self.zero_stage}{off}"
                f"{', recompute' if self.recompute else ''}")


def _powers_of_two(limit: int) -> List[int]:
    return [2 ** i for i in range(int(math.log2(max(limit, 1))) + 1)]


def expert_parallel_sizes(t5: T5Config, dp: int) -> List[int]:
    """The expert-parallel sizes to try: powers of two dividing the data-parallel size and the
    number of experts (1 alone for a dense model)."""
    if not t5.is_moe:
        return [1]
    return [ep for ep in _powers_of_two(dp) if dp % ep == 0 and t5.num_experts % ep == 0]


def enumerate_candidates(request: Request, cluster: Cluster, t5: T5Config
                         ) -> Iterator[Candidate]:
    """Every layout worth resolving: TP a power of two within a node, PP dividing what is left,
    micro batches that divide the global batch per data-parallel rank, the ZeRO/offload options
    DeepSpeed runs with that pipeline size, with and without recomputation."""
    world = cluster.world_size
    blocks = t5.num_layers + t5.num_decoder_layers
    for tp in _powers_of_two(cluster.devices_per_node):
        if world % tp:
            continue
        for pp in range(1, min(world // tp, blocks) + 1):
            if (world // tp) % pp:
                continue
            dp = world // (tp * pp)
            if request.global_batch_size % dp:
                continue
            per_rank = request.global_batch_size // dp
            for mb in _powers_of_two(min(per_rank, request.max_micro_batch)):
                if per_rank % mb:
                    continue
                for zero, off_opt, off_param in STATE_OPTIONS:
                    if pp > 1 and (zero > 1 or off_opt != "none"):
                        continue
                    if "nvme" in (off_opt, off_param) and not cluster.nvme_gib:
                        continue
                    if request.precision == "fp16" and cluster.device_type == "cpu":
                        continue
                    for recompute in request.recompute:
                        for ep in expert_parallel_sizes(t5, dp):
                            flags = layout_flags(request, tp, pp, mb, zero, off_opt, off_param,
                                                 recompute)
                            if ep > 1:
                                flags += ["--expert-model-parallel-size", str(ep)]
                            yield Candidate(tp, pp, dp, mb, zero, off_opt, off_param,
                                            recompute, flags, ep=ep)


def layout_flags(request: Request, tp: int, pp: int, micro_batch: int, zero: int,
                 offload_optimizer: str, offload_param: str, recompute: bool) -> List[str]:
    """The trainer's flags for a layout (data, tokenizer and schedule flags left to the user)."""
    flags = ["--model-config", request.model_config,
             "--encoder-seq-length", str(request.encoder_seq_length)]
    if request.decoder_seq_length is not None:
        flags += ["--decoder-seq-length", str(request.decoder_seq_length)]
    flags += ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
              "--micro-batch-size", str(micro_batch),
              "--global-batch-size", str(request.global_batch_size)]
    if request.precision != "fp32":
        flags.append(f"--{request.precision}")
    flags += ["--zero-stage", str(zero)]
    if offload_optimizer != "none":
        flags += ["--offload-optimizer", offload_optimizer]
    if offload_param != "none":
        flags += ["--offload-param", offload_param]
    if "nvme" in (offload_optimizer, offload_param):
        flags += ["--nvme-path", "/local_nvme"]
    if recompute:
        flags.append("--checkpoint-activations")
    return flags


class Evaluator:
    """Resolves candidates and fills in memory, fit and time for one cluster."""

    def __init__(self, cluster: Cluster, machine: Machine, headroom: float = 0.1):
        self.cluster, self.machine = cluster, machine
        self.usable = cluster.device.memory_gib * (1 - headroom) * GIB
        self._saved: Dict[tuple, List[float]] = {}
        self._cuts: Dict[Tuple[int, int], Cut] = {}
        self._parameters: Dict[Tuple[int, int], Tuple[List[int], List[int]]] = {}

    def evaluate(self, c: Candidate) -> Candidate:
        layout, problems = layout_from_flags(c.flags, self.cluster.world_size,
                                             self.cluster.device_type)
        if layout is None:
            c.problems = problems
            return c
        cut = self.cut(layout)
        try:
            c.stages = estimate_stages(layout, self.cluster.device_type, cut)
        except ValueError as e:
            c.problems = [str(e)]
            return c
        par = layout.parallel
        c.tp, c.pp, c.dp = (par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                            par.data_parallel_size)
        c.micro_batch = layout.batch.micro_batch_size
        c.micro_batches = layout.batch.gradient_accumulation_steps
        dpn = self.cluster.devices_per_node
        offloaded = max(e.offloaded for e in c.stages)
        if "cpu" in (c.offload_optimizer, c.offload_param):
            c.host_bytes_per_node = offloaded * dpn
        elif "nvme" in (c.offload_optimizer, c.offload_param):
            c.nvme_bytes_per_node = offloaded * dpn
        short = {}
        over = c.memory.total - self.usable
        if over > 0:
            short["device"] = over / GIB
        host = self.cluster.host_memory_gib * GIB
        if c.host_bytes_per_node > 0.8 * host:  # the OS, the data loaders, pinned staging
            short["host"] = (c.host_bytes_per_node - 0.8 * host) / GIB
        if c.nvme_bytes_per_node and c.nvme_bytes_per_node > (self.cluster.nvme_gib or 0) * GIB:
            short["nvme"] = (c.nvme_bytes_per_node - (self.cluster.nvme_gib or 0) * GIB) / GIB
        c.short = short
        shape = self.shape(layout, c.stages, cut)
        c.time = step_time(shape, self.machine)
        t5 = layout.model.t5
        tokens = layout.batch.global_batch_size * (layout.encoder_seq_length
                                                   + layout.decoder_seq_length)
        c.tokens_per_s = tokens / c.time.total
        vocab = t5.padded_vocab_size(layout.model.make_vocab_size_divisible_by, c.tp)
        model_flops = model_flops_per_sample(t5, layout.encoder_seq_length,
                                             layout.decoder_seq_length, vocab) \
            * layout.batch.global_batch_size
        peak = self.cluster.device.tflops(layout.precision.precision) * 1e12
        c.mfu = model_flops / (c.time.total * self.cluster.world_size * peak)
        return c

    def cut(self, layout: Layout) -> Optional[Cut]:
        """The layout's pipeline cut (None without a pipeline), made once per pipeline and
        tensor-parallel size (the vocabulary's padding depends on the latter)."""
        par = layout.parallel
        if par.pipeline_model_parallel_size == 1:
            return None
        key = (par.pipeline_model_parallel_size, par.tensor_model_parallel_size)
        if key not in self._cuts:
            self._cuts[key] = layout.pipeline_cut()
        return self._cuts[key]

    def shape(self, layout: Layout, stages: Sequence[MemoryEstimate],
              cut: Optional[Cut]) -> LayoutShape:
        """The numbers of `layout` the time model reads."""
        model, par, t5 = layout.model, layout.parallel, layout.model.t5
        tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
        mvd = model.make_vocab_size_divisible_by
        vocab = t5.padded_vocab_size(mvd, tp)
        if cut is not None:
            blocks = [tuple(len(r) for r in cut.stage_blocks(s)) for s in range(pp)]
        else:
            blocks = [(t5.num_layers, t5.num_decoder_layers)]
        ep = par.expert_model_parallel_size
        key = (tp, pp, ep)
        if key not in self._parameters:  # (per stage, each tensor's): one tp x pp layout
            numels = parameter_numels(t5, tp, mvd, ep)
            self._parameters[key] = (
                [sum(stage_parameter_numels(t5, cut, s, tp, mvd, ep).values())
                 for s in range(pp)]
                if cut is not None else [sum(numels.values())], list(numels.values()))
        params, numels = self._parameters[key]
        buckets = ZeroBuckets.from_zero_config(layout.deepspeed.get("zero_optimization", {}))
        threshold = buckets.stage3_param_persistence_threshold
        return LayoutShape(
            tp=tp, pp=pp, dp=par.data_parallel_size, micro_batch=layout.batch.micro_batch_size,
            micro_batches=layout.batch.gradient_accumulation_steps,
            encoder_len=layout.encoder_seq_length, decoder_len=layout.decoder_seq_length,
            d_model=t5.d_model, precision=layout.precision.precision,
            zero_stage=layout.zero.stage, offload_optimizer=layout.zero.offload_optimizer,
            offload_param=layout.zero.offload_param, recompute=model.checkpoint_activations,
            block_flops=block_flops(t5, layout.encoder_seq_length, layout.decoder_seq_length,
                                    vocab),
            stage_blocks=blocks, stage_parameters=params,
            saved_per_micro_batch=self.saved_per_micro_batch(layout, stages),
            persistent_parameters=sum(n for n in numels if n <= threshold),
            max_live_parameters=buckets.stage3_max_live_parameters,
            ep=ep, all_to_all_bytes=all_to_all_bytes(layout),
            all_to_all_calls=4 * layout.batch.gradient_accumulation_steps * (
                len(t5.sparse_blocks(False)) + len(t5.sparse_blocks(True))) if ep > 1 else 0)

    def saved_per_micro_batch(self, layout: Layout, stages: Sequence[MemoryEstimate]
                              ) -> List[float]:
        """What forward saves per micro-batch on each stage without recomputation (the
        element-wise kernels' traffic does not shrink with recomputation)."""
        if not layout.model.checkpoint_activations:
            return [e.activations_saved / e.in_flight for e in stages]
        key = (layout.parallel, layout.batch, layout.precision.precision,
               layout.encoder_seq_length, layout.decoder_seq_length)
        if key not in self._saved:
            plain = dataclasses.replace(layout, model=dataclasses.replace(
                layout.model, checkpoint_activations=False))
            self._saved[key] = [e.activations_saved / e.in_flight
                                for e in estimate_stages(plain, self.cluster.device_type,
                                                         self.cut(plain))]
        return self._saved[key]

"""How long one training step of a layout takes: an analytic model, term by term.

Every term is time on the critical path of one optimizer step, nothing is assumed to overlap
(DeepSpeed overlaps little by default: ZeRO 1-2 reduce after backward, the pipeline engine waits
on its sends), so the terms add up to the step:

compute        each stage's blocks and LM head: forward FLOPs x 3 (x 4 for recomputed blocks,
               model/flops.py), at the device's rate for the matrix products' row count:
               flops x rows / (rows + half_rows), rows being the micro-batch's encoder or
               decoder tokens (T5's short decoder runs its products far below the peak); plus
               the element-wise kernels: what forward saves for backward (the memory
               estimate's activations) written and read back ELEMENTWISE_PASSES times at the
               device's memory bandwidth.
tp_comm        Megatron's tensor-parallel all-reduces per micro-batch: forward, after each
               row-parallel linear (2 per encoder block, 3 per decoder block) and the embedding;
               backward, at each column-parallel input (2 per encoder block, 4 per decoder block,
               one of them the encoder output that cross-attention reads) and the LM head's
               input; again in forward with recomputation.
pp_bubble      1F1B: a step is (m + P - 1) slots of the slowest stage's micro-batch (its work and
               its sends); what is beyond the average stage's m micro-batches of work is idle
               (the (P - 1) / (m + P - 1) bubble, the stages' imbalance, the transfers).
dp_comm        the data-parallel reductions of DeepSpeed's engine and ZeRO optimizers, read in
               DeepSpeed 0.19: ZeRO 0 all-reduces the gradients once per step; ZeRO 1 and 2
               also all-reduce their buckets (`use_multi_rank_bucket_allreduce`, the default:
               not a reduce-scatter) and all-gather the updated 16-bit partition; ZeRO 2
               reduces after every micro-batch, ZeRO 1 once; ZeRO 3 gathers the parameters in
               forward (and again in backward when they exceed stage3_max_live_parameters,
               else they stay gathered) and reduce-scatters the gradients, every micro-batch.
optimizer      Adam over the partition on the device: OPTIMIZER_BYTES per element at the
               device's memory bandwidth.
offload        with offloading: gradients to the host and 16-bit parameters back over the host
               link, DeepSpeed's CPU Adam at the node's memory bandwidth shared by its devices,
               ZeRO-3's offloaded parameters fetched in forward and backward, NVMe reads and
               writes of the optimizer states.

Ring collectives over n ranks move 2 (n - 1) / n (all-reduce) or (n - 1) / n (all-gather,
reduce-scatter) of the buffer through the slowest link of the group, plus `latency` each; the
data-parallel ones also copy their tensors into DeepSpeed's flat buckets and back. Ranks
are ordered tensor first, then data, then pipeline (megatron/parallel_state.py): a tensor group
within a node uses NVLink; a data-parallel group spanning nodes gets the node's network shared by
the node's devices; pipeline neighbours cross nodes once a stage fills a node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

from megatron.model.flops import forward_flops_per_sample, training_step_flops

OPTIMIZER_BYTES = 36
"""Memory traffic of one Adam step per element: gradient, master, two moments read, master and
moments written, the 16-bit copy written, the gradient's conversion to fp32."""
CPU_ADAM_BYTES = 36
"""The same for DeepSpeed's CPU Adam on the host."""
FLATTEN_PASSES = 4
"""A bucketed collective copies its tensors into the bucket and back out (read + write each)."""
ELEMENTWISE_PASSES = 3
FALLBACK = {"zero3_gather": "all_gather"}
"""A measured collective that stands in for one not measured."""
"""Forward writes what it saves, backward reads it and writes a gradient as large."""


@dataclass(frozen=True)
class Machine:
    """What the time model reads of a cluster; bandwidths in bytes/s, rates in FLOP/s."""

    devices_per_node: int
    flops: float
    """Achieved FLOP/s of a device on large matrix products (peak x efficiency)."""
    half_rows: float
    """The row count at which a matrix product reaches half of `flops`."""
    memory_bw: float
    intra_bw: float
    inter_bw: float
    """The node's network."""
    host_link_bw: float
    host_memory_bw: float
    """A node's CPU memory."""
    nvme_bw: float = 0.0
    optimizer_bw: Optional[float] = None
    """What the optimizer step reaches of `memory_bw` (None: all of it)."""
    latency: float = 20e-6
    """Seconds per collective or transfer, on top of its bytes."""
    collective_bw: Optional[Dict[str, float]] = None
    """Measured bandwidth per collective ('all_reduce', 'all_gather', 'reduce_scatter', 'p2p')
    overriding the links (the CPU calibration: gloo's collectives differ from each other)."""

    def link(self, group_span: int, stride: int) -> float:
        """Bytes/s per device of a group of `group_span` ranks `stride` apart: NVLink inside a
        node, else the node's network shared by the node's devices."""
        if group_span * stride <= self.devices_per_node:
            return self.intra_bw
        return self.inter_bw / self.devices_per_node

    def collective(self, kind: str, ranks: int, nbytes: float, bw: float,
                   flattened: bool = False) -> float:
        """Seconds of one ring collective of `nbytes` over `ranks` ranks; `flattened`: the
        buffer is first copied into a flat bucket and back out (DeepSpeed's gradient and
        parameter buckets), FLATTEN_PASSES passes at the memory bandwidth."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        if self.collective_bw:
            bw = self.collective_bw.get(kind, self.collective_bw.get(FALLBACK.get(kind), bw))
        share = 2 * (ranks - 1) / ranks if kind == "all_reduce" else (ranks - 1) / ranks
        copies = FLATTEN_PASSES * nbytes / self.memory_bw if flattened else 0.0
        return share * nbytes / bw + self.latency + copies


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step, by term (module docstring); `total` is their sum."""

    compute: float
    tp_comm: float
    pp_bubble: float
    dp_comm: float
    optimizer: float
    offload: float
    ep_comm: float = 0.0
    """Mixture-of-Experts: the all-to-all of the token choices to their experts and back."""

    @property
    def total(self) -> float:
        return self.compute + self.tp_comm + self.pp_bubble + self.dp_comm + self.optimizer + \
            self.offload + self.ep_comm

    def terms(self) -> Dict[str, float]:
        out = {"compute": self.compute, "tp_comm": self.tp_comm, "pp_bubble": self.pp_bubble,
               "dp_comm": self.dp_comm, "optimizer": self.optimizer, "offload": self.offload}
        if self.ep_comm:
            out["ep_comm"] = self.ep_comm
        return out


@dataclass(frozen=True)
class LayoutShape:
    """The numbers of a layout that the time model reads (see `shape_of`)."""

    tp: int
    pp: int
    dp: int
    micro_batch: int
    micro_batches: int
    encoder_len: int
    decoder_len: int
    d_model: int
    precision: str
    zero_stage: int
    offload_optimizer: str
    offload_param: str
    recompute: bool
    block_flops: Tuple[float, float, float]
    """Forward FLOPs per sample of an encoder block, a decoder block (with its cross-attention
    K/V projections) and the LM head."""
    stage_blocks: Sequence[Tuple[int, int]]
    """(encoder blocks, decoder blocks) of each stage; the last stage has the head."""
    stage_parameters: Sequence[int]
    """Parameters per tensor rank of each stage."""
    saved_per_micro_batch: Sequence[float]
    """Bytes forward saves per micro-batch on each stage, without recomputation."""
    persistent_parameters: int = 0
    """ZeRO-3: parameters small enough to stay whole (not gathered)."""
    max_live_parameters: int = 1_000_000_000
    """ZeRO-3: parameters gathered in forward stay for backward when the partitioned ones are
    at most this many (DeepSpeed's stage3_max_live_parameters); else backward gathers again."""
    ep: int = 1
    """Expert-parallel ranks (a run of EP data-parallel ranks, TP apart)."""
    all_to_all_bytes: float = 0.0
    """Bytes a rank sends by all-to-all per step (megatron/cost/report.all_to_all_bytes)."""
    all_to_all_calls: int = 0
    """All-to-alls per step (4 per sparse layer and micro-batch: there and back, twice)."""


def block_flops(t5, encoder_len: int, decoder_len: int, vocab: int
                ) -> Tuple[float, float, float]:
    """`LayoutShape.block_flops` from model/flops.py."""
    parts = forward_flops_per_sample(t5, encoder_len, decoder_len, vocab)
    return (parts["encoder"] / max(t5.num_layers, 1),
            (parts["decoder"] + parts["cross_kv"]) / max(t5.num_decoder_layers, 1),
            float(parts["lm_head"]))


def model_flops_per_sample(t5, encoder_len: int, decoder_len: int, vocab: int) -> float:
    """Forward and backward FLOPs of one sample (MFU's numerator)."""
    return float(training_step_flops(t5, 1, encoder_len, decoder_len, vocab).model)


def step_time(shape: LayoutShape, machine: Machine) -> StepTime:
    """The step time of `shape` on `machine` (module docstring)."""
    s, mc = shape, machine
    a = 4 if s.precision == "fp32" else 2
    b, m, P = s.micro_batch, s.micro_batches, s.pp
    # per micro-batch, per stage: work (compute) and tensor-parallel communication
    tp_bw = mc.link(s.tp, 1)
    enc_bytes = b * s.encoder_len * s.d_model * a
    dec_bytes = b * s.decoder_len * s.d_model * a
    rate = lambda rows: mc.flops * rows / (rows + mc.half_rows)  # noqa: E731
    enc_rate, dec_rate = rate(b * s.encoder_len), rate(b * s.decoder_len)
    passes_per_block = 4 if s.recompute else 3
    work, comm = [], []
    for stage in range(P):
        n_enc, n_dec = s.stage_blocks[stage]
        f_enc, f_dec, f_head = (b * f / s.tp for f in s.block_flops)
        seconds = passes_per_block * (n_enc * f_enc / enc_rate + n_dec * f_dec / dec_rate)
        seconds += 3 * f_head / dec_rate if stage == P - 1 else 0.0
        elementwise = ELEMENTWISE_PASSES * s.saved_per_micro_batch[stage] / mc.memory_bw
        work.append(seconds + elementwise)
        forward = [enc_bytes] * (2 * n_enc) + [dec_bytes] * (3 * n_dec)
        backward = [enc_bytes] * (2 * n_enc) + [dec_bytes] * (3 * n_dec) + [enc_bytes] * n_dec
        if stage == 0:
            forward.append(enc_bytes)
        if stage == P - 1:
            forward.append(dec_bytes)
            backward.append(dec_bytes)
        passes = forward * (2 if s.recompute else 1) + backward
        comm.append(sum(mc.collective("all_reduce", s.tp, x, tp_bw) for x in passes))
    mean_work, mean_comm = sum(work) / P, sum(comm) / P
    compute, tp_comm = m * mean_work, m * mean_comm
    bubble = 0.0
    if P > 1:
        stride = s.tp * s.dp
        p2p_bw = mc.link(2, stride)
        if mc.collective_bw and "p2p" in mc.collective_bw:
            p2p_bw = mc.collective_bw["p2p"]
        wire = (enc_bytes + dec_bytes) / p2p_bw + mc.latency  # hidden state (+ encoder output)
        slot = max(w + c for w, c in zip(work, comm)) + 2 * wire
        bubble = (m + P - 1) * slot - compute - tp_comm
    # data parallelism, on the stage with the most parameters
    psi = max(s.stage_parameters)
    pb = a
    gb = 4 if (P > 1 and s.precision == "bf16" and s.zero_stage == 1) else pb
    dp_bw = mc.link(s.dp, s.tp)
    coll = lambda kind, nbytes: mc.collective(kind, s.dp, nbytes, dp_bw, True)  # noqa: E731
    if s.zero_stage == 0:
        dp_comm = coll("all_reduce", psi * gb)
    elif s.zero_stage == 1:
        dp_comm = coll("all_reduce", psi * gb) + coll("all_gather", psi * pb)
    elif s.zero_stage == 2:
        dp_comm = m * coll("all_reduce", psi * gb) + coll("all_gather", psi * pb)
    else:  # into the parameters' own flat buffer: no bucket copies
        partitioned = psi - s.persistent_parameters
        gather = mc.collective("zero3_gather", s.dp, partitioned * pb, dp_bw)
        again = gather if partitioned > s.max_live_parameters else 0.0
        dp_comm = m * (gather + again + coll("reduce_scatter", psi * gb))
    partition = psi if s.zero_stage == 0 else -(-psi // s.dp)
    offload = 0.0
    if s.offload_optimizer == "none":
        optimizer = partition * OPTIMIZER_BYTES / (mc.optimizer_bw or mc.memory_bw)
    else:
        optimizer = 0.0
        share = mc.host_memory_bw / mc.devices_per_node
        offload += partition * (4 + pb) / mc.host_link_bw  # fp32 gradients out, params back
        offload += partition * CPU_ADAM_BYTES / share
        if s.offload_optimizer == "nvme":
            offload += 2 * partition * 12 / (mc.nvme_bw / mc.devices_per_node)
    if s.offload_param != "none":
        gathered = (psi - s.persistent_parameters) / s.dp * pb
        bw = mc.host_link_bw if s.offload_param == "cpu" else mc.nvme_bw / mc.devices_per_node
        offload += m * 2 * gathered / bw
    ep_comm = 0.0
    if s.ep > 1:  # every rank sends and receives at once: the bytes over its link
        bw = mc.link(s.ep, s.tp)
        if mc.collective_bw and "all_to_all" in mc.collective_bw:
            bw = mc.collective_bw["all_to_all"]
        ep_comm = s.all_to_all_bytes / bw + s.all_to_all_calls * mc.latency
    return StepTime(compute, tp_comm, bubble, dp_comm, optimizer, offload, ep_comm)


"""Ranking the candidates, saying what is missing when none fits, and the reports."""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from megatron.data.datasets.t5_dataset import T5DatasetConfig
from megatron.model.settings import load_model_config
from megatron.plan.cluster import Cluster
from megatron.plan.search import GIB, Candidate, Evaluator, Request, enumerate_candidates
from megatron.plan.timing import Machine

MEMORY_EFFICIENCY = 0.8
"""The share of the datasheet's device and host memory bandwidth that kernels reach."""
TERM_NAMES = {"compute": "compute", "tp_comm": "TP communication",
              "pp_bubble": "pipeline bubble", "dp_comm": "DP/ZeRO communication",
              "optimizer": "optimizer step", "offload": "offload traffic",
              "ep_comm": "expert all-to-all"}


HALF_ROWS = 48
"""Rows at which a GPU's matrix product reaches half its large-product rate (bf16 tensor cores:
about 3/4 of it at 128 rows)."""


def machine_for(cluster: Cluster, precision: str, efficiency: float,
                latency_s: float = 20e-6) -> Machine:
    """The time model's view of `cluster` at `precision`, large matrix products at `efficiency`
    of the peak."""
    d = cluster.device
    return Machine(devices_per_node=cluster.devices_per_node,
                   flops=d.tflops(precision) * 1e12 * efficiency, half_rows=HALF_ROWS,
                   memory_bw=d.memory_gbs * 1e9 * MEMORY_EFFICIENCY,
                   intra_bw=d.intra_node_gbs * 1e9, inter_bw=cluster.inter_node_gbs * 1e9,
                   host_link_bw=d.host_link_gbs * 1e9,
                   host_memory_bw=cluster.host_memory_gbs * 1e9 * MEMORY_EFFICIENCY,
                   nvme_bw=cluster.nvme_gbs * 1e9, latency=latency_s)


@dataclass
class Plan:
    request: Request
    cluster: Cluster
    candidates: List[Candidate]
    """Every candidate, resolved or refused."""
    ranked: List[Candidate]
    """Those that fit, fastest first."""
    nodes_needed: Optional[int] = None
    """When none fits: the fewest nodes (doubling) on which one does, if any up to 64x."""


def plan(request: Request, cluster: Cluster, machine: Machine, headroom: float = 0.1,
         find_nodes: bool = True) -> Plan:
    """Evaluate every candidate of `request` on `cluster` and rank those that fit.

    Raises:
        ConfigError: the model config cannot be read.
    """
    t5 = load_model_config(request.model_config)
    evaluator = Evaluator(cluster, machine, headroom)
    candidates = [evaluator.evaluate(c) for c in enumerate_candidates(request, cluster, t5)]
    ranked = sorted((c for c in candidates if c.fits),
                    key=lambda c: (c.time.total, c.memory.total))
    result = Plan(request, cluster, candidates, ranked)
    if not ranked and find_nodes:
        for factor in (2, 4, 8, 16, 32, 64):
            bigger = dataclasses.replace(cluster, nodes=cluster.nodes * factor)
            more = plan(request, bigger, machine, headroom, False)
            if more.ranked:
                result.nodes_needed = bigger.nodes
                break
    return result


def command_line(c: Candidate, cluster: Cluster) -> str:
    """The launch/ command that runs `c` (data, tokenizer and schedule as shell variables)."""
    rest = ["--data-path", "$DATA", "--tokenizer-model", "$TOKENIZER",
            "--train-iters", "$TRAIN_ITERS", "--lr", "$LR"]
    flags = " ".join(shlex.quote(f) for f in c.flags) + " " + \
        " ".join(f if f.startswith("--") else f'"{f}"' for f in rest)
    if cluster.nodes == 1:
        return f"NPROC_PER_NODE={cluster.devices_per_node} launch/torchrun.sh {flags}"
    return (f"sbatch --nodes {cluster.nodes} --gpus-per-node {cluster.devices_per_node} "
            f"launch/slurm/pretrain_t5.sbatch {flags}")


def memory_parts(c: Candidate) -> Dict[str, float]:
    """GiB per device of the stage that holds the most."""
    m = c.memory
    return {"parameters": m.parameters / GIB, "gradients": m.gradients / GIB,
            "optimizer_states": m.optimizer_states / GIB, "activations": m.activations / GIB,
            "buffers": (m.buffers + m.pipeline_buffers) / GIB, "total": m.total / GIB,
            "offloaded": m.offloaded / GIB}


def as_json(result: Plan, top: int) -> List[dict]:
    """The `--json` list: the best `top` layouts."""
    out = []
    for rank, c in enumerate(result.ranked[:top], 1):
        out.append({
            "rank": rank, "layout": c.label(), "world_size": c.world_size,
            "tensor_parallel": c.tp, "pipeline_parallel": c.pp, "data_parallel": c.dp,
            "expert_parallel": c.ep,
            "micro_batch_size": c.micro_batch, "micro_batches_per_step": c.micro_batches,
            "zero_stage": c.zero_stage, "offload_optimizer": c.offload_optimizer,
            "offload_param": c.offload_param, "checkpoint_activations": c.recompute,
            "memory_per_device_gib": c.memory.total / GIB,
            "memory_per_device_bytes": c.memory.total, "memory": memory_parts(c),
            "host_memory_per_node_gib": c.host_bytes_per_node / GIB,
            "nvme_per_node_gib": c.nvme_bytes_per_node / GIB,
            "step_time_s": c.time.total, "step_time": c.time.terms(),
            "tokens_per_s": c.tokens_per_s, "mfu": c.mfu,
            "flags": list(c.flags), "command": command_line(c, result.cluster)})
    return out


def report(result: Plan, top: int, explain: bool, notes: Sequence[str] = ()) -> str:
    """The text report: the best layouts, or what is missing; with `explain`, every other
    candidate and why it lost. `notes` (a precision chosen for the device) follow the header."""
    r, cl = result.request, result.cluster
    decoder = T5DatasetConfig(r.encoder_seq_length, r.decoder_seq_length).lengths()[2]
    lines = [f"plan: {r.model_config}, encoder {r.encoder_seq_length} / decoder "
             f"{decoder} tokens, global batch "
             f"{r.global_batch_size}, {r.precision}",
             f"cluster: {cl.describe(r.precision)}"]
    lines += [f"precision {note}" for note in notes]
    lines.append(f"candidates: {len(result.candidates)} layouts; {len(result.ranked)} fit")
    if not result.ranked:
        lines += missing(result)
    for rank, c in enumerate(result.ranked[:top], 1):
        lines += [""] + describe(rank, c, cl)
    if explain:
        lines += [""] + explanation(result, top)
    return "\n".join(lines)


def describe(rank: int, c: Candidate, cluster: Cluster) -> List[str]:
    m, t = memory_parts(c), c.time
    lines = [f"#{rank}  {c.label()}; {c.micro_batches} micro-batches per step",
             f"    memory per device: {m['total']:.1f} GiB (parameters {m['parameters']:.1f}, "
             f"gradients {m['gradients']:.1f}, optimizer states {m['optimizer_states']:.1f}, "
             f"activations {m['activations']:.1f}, buffers {m['buffers']:.1f}; offloaded "
             f"{m['offloaded']:.1f})" + (f"; {c.pp} stages, the fullest shown" if c.pp > 1
                                          else "")]
    if c.host_bytes_per_node:
        lines.append(f"    host memory per node: {c.host_bytes_per_node / GIB:.0f} GiB of "
                     f"{cluster.host_memory_gib:g}")
    if c.nvme_bytes_per_node:
        lines.append(f"    NVMe per node: {c.nvme_bytes_per_node / GIB:.0f} GiB of "
                     f"{cluster.nvme_gib:g}")
    terms = ", ".join(f"{TERM_NAMES[k]} {v:.3g}" for k, v in t.terms().items() if v > 0)
    lines += [f"    step {t.total:.3g} s ({terms}); {c.tokens_per_s:,.0f} tokens/s, "
              f"MFU {100 * c.mfu:.1f}%",
              f"    {command_line(c, cluster)}"]
    return lines


def missing(result: Plan) -> List[str]:
    """Why nothing fits: the smallest memory any layout needs against the device's, and the
    nodes on which something would."""
    cl = result.cluster
    sized = [c for c in result.candidates if c.stages]
    if not sized:
        reasons = sorted({p for c in result.candidates for p in c.problems})
        return ["no layout can run: " + ("; ".join(reasons[:5]) if reasons else
                f"the global batch {result.request.global_batch_size} does not divide over "
                f"any data-parallel size of {cl.world_size} devices")]
    lines = []
    if all("device" in c.short for c in sized):
        c = min(sized, key=lambda c: c.memory.total)
        usable = c.memory.total / GIB - c.short["device"]
        lines.append(f"nothing fits: the smallest layout ({c.label()}) needs "
                     f"{c.memory.total / GIB:.1f} GiB per device, {c.short['device']:.1f} GiB "
                     f"more than the {usable:.1f} GiB usable of {cl.device.memory_gib:g}")
    else:
        c = min((c for c in sized if "device" not in c.short),
                key=lambda c: sum(c.short.values()))
        where = []
        if "host" in c.short:
            where.append(f"{c.short['host']:.0f} GiB more host memory per node "
                         f"({c.host_bytes_per_node / GIB:.0f} GiB against 80% of "
                         f"{cl.host_memory_gib:g})")
        if "nvme" in c.short:
            where.append(f"{c.short['nvme']:.0f} GiB more NVMe per node "
                         f"({c.nvme_bytes_per_node / GIB:.0f} GiB against {cl.nvme_gib:g})")
        lines.append(f"nothing fits: offloading fits the devices ({c.label()}) but needs "
                     f"{' and '.join(where)}")
        kept = [c for c in sized if c.offload_optimizer == "none"]
        if kept:
            k = min(kept, key=lambda c: c.memory.total)
            lines.append(f"  without offloading the smallest layout ({k.label()}) needs "
                         f"{k.memory.total / GIB:.1f} GiB per device, "
                         f"{k.short.get('device', 0):.1f} GiB more than usable")
    if result.nodes_needed:
        lines.append(f"  with more devices: fits on {result.nodes_needed} nodes of "
                     f"{cl.devices_per_node} (doubling from {cl.nodes})")
    else:
        lines.append(f"  not even on {cl.nodes * 64} nodes: a device with more memory is needed")
    return lines


def explanation(result: Plan, top: int) -> List[str]:
    """Every candidate not shown, with the reason: refused (the trainer's message), does not fit
    (by how much), or slower (by how much, and the term that costs most)."""
    lines = ["why the other candidates were not chosen:"]
    best = result.ranked[0] if result.ranked else None
    for c in result.ranked[top:]:
        diff = {k: v - best.time.terms()[k] for k, v in c.time.terms().items()}
        worst = max(diff, key=diff.get)
        lines.append(f"  slower by {100 * (c.time.total / best.time.total - 1):.0f}% "
                     f"(+{diff[worst]:.3g} s {TERM_NAMES[worst]}): {c.label()}")
    for c in sorted((c for c in result.candidates if c.stages and not c.fits),
                    key=lambda c: sum(c.short.values())):
        what = ", ".join(f"{v:.1f} GiB over on the {k}" if k == "device" else
                         f"{v:.0f} GiB over in {k} per node" for k, v in c.short.items())
        lines.append(f"  does not fit ({what}; {c.memory.total / GIB:.1f} GiB per device): "
                     f"{c.label()}")
    refused: Dict[str, List[Candidate]] = {}
    for c in result.candidates:
        if c.problems:
            refused.setdefault(c.problems[0], []).append(c)
    for reason, cs in sorted(refused.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"  refused by the trainer ({reason}): {len(cs)} layout(s), e.g. "
                     f"{cs[0].label()}")
    return lines

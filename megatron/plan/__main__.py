"""`python -m megatron.plan`: rank the parallel layouts of a model on a cluster.

    python -m megatron.plan --model-config t5-11b --encoder-seq-length 512 \\
        --decoder-seq-length 114 --global-batch-size 2048 --nodes 8 --gpus-per-node 8 \\
        --gpu H100-80GB --top 5
    python -m megatron.plan --model-config t5-11b --global-batch-size 2048 \\
        --cluster 8x8xH100-80GB --json

Exit status: 0 a layout fits, 1 none fits (the report says what is missing), 2 a bad command
line. Stdout holds the report or the JSON alone; log lines (DeepSpeed's among them) go to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import List, Optional, Sequence

from megatron.cli import RENAMED_FLAGS, CommandLineParser
from megatron.data.storage.paths import scheme_problems
from megatron.model.config import ConfigError
from megatron.plan.cluster import (
    DEVICES,
    PRESET,
    Cluster,
    custom_device,
    device_named,
    plan_precision,
)
from megatron.plan.planner import as_json, machine_for, plan, report
from megatron.plan.search import Request
from megatron.stdout import logs_to_stderr


class _DefaultsFormatter(argparse.HelpFormatter):
    """--help with each flag's default, where it has one (None and False are no default)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or action.default in (None, False, argparse.SUPPRESS) \
                or not action.option_strings or action.required:
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def build_parser() -> argparse.ArgumentParser:
    """The planner's command line (every flag with its default in --help)."""
    p = CommandLineParser(
        prog="python -m megatron.plan", renamed=RENAMED_FLAGS,
        formatter_class=_DefaultsFormatter,
        description="The k best parallel layouts (TP, PP, DP, ZeRO, offload, micro batch, "
                    "recomputation) of an encoder-decoder on a cluster: memory per device from "
                    "the --dry-run estimate, a step-time model, and the flags to run each.")
    g = p.add_argument_group("model and batch")
    g.add_argument("--model-config", required=True,
                   help="a preset name from configs/model (t5-11b) or a model JSON")
    g.add_argument("--encoder-seq-length", "--seq-length", type=int, default=512,
                   help="encoder tokens per sample")
    g.add_argument("--decoder-seq-length", type=int, default=None,
                   help="default: the target length span corruption gives (114 for 512)")
    g.add_argument("--global-batch-size", type=int, required=True, help="samples per step")
    g.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default=None,
                   help="default: bf16 where the device computes it, else fp16 (V100); a "
                        "precision the device lacks is refused")
    g.add_argument("--max-micro-batch", type=int, default=64,
                   help="the largest micro batch tried (powers of two)")
    g.add_argument("--no-recompute", action="store_true",
                   help="do not consider activation checkpointing")
    g = p.add_argument_group("cluster")
    g.add_argument("--cluster", default=None, metavar="NODESxGPUSxDEVICE",
                   help="a preset such as 8x8xH100-80GB (instead of --nodes, --gpus-per-node, "
                        "--gpu)")
    g.add_argument("--nodes", type=int, default=None, help="nodes (or --cluster)")
    g.add_argument("--gpus-per-node", type=int, default=None,
                   help="devices per node (or --cluster)")
    g.add_argument("--gpu", default=None,
                   help=f"one of {', '.join(DEVICES)}; another name with --gpu-memory-gib and "
                        f"--gpu-tflops describes a device not in the table")
    g.add_argument("--gpu-memory-gib", type=float, default=None,
                   help="device memory (a device not in the table, or to correct one)")
    g.add_argument("--gpu-tflops", type=float, default=None,
                   help="dense peak TFLOP/s at the training precision; default: the device "
                        "table's")
    g.add_argument("--intra-node-gbs", type=float, default=None,
                   help="device-to-device GB/s inside a node (NVLink), per device; default: "
                        "the device table's")
    g.add_argument("--inter-node-gbs", type=float, default=None,
                   help="a node's network GB/s (all NICs), shared by its devices; default: "
                        "the device table's")
    g.add_argument("--host-link-gbs", type=float, default=None,
                   help="device-to-host GB/s (PCIe) per device, what offloading crosses; "
                        "default: the device table's")
    g.add_argument("--cpu-memory-gib", type=float, default=None,
                   help="host memory per node; default: the device table's")
    g.add_argument("--nvme-gib", type=float, default=None,
                   help="NVMe per node for ZeRO-Infinity (without it NVMe offload is not "
                        "considered)")
    g.add_argument("--nvme-gbs", type=float, default=6.0, help="a node's NVMe GB/s")
    g = p.add_argument_group("model of the step")
    g.add_argument("--efficiency", type=float, default=0.6,
                   help="the fraction of the peak that large matrix products reach")
    g.add_argument("--headroom", type=float, default=0.1,
                   help="the fraction of device memory left to the CUDA context, NCCL and "
                        "fragmentation")
    g = p.add_argument_group("output")
    g.add_argument("--top", type=int, default=5, help="how many layouts to show")
    g.add_argument("--json", action="store_true", help="print the layouts as one JSON list")
    g.add_argument("--explain", action="store_true",
                   help="also say why every other candidate was not chosen")
    return p


def cluster_from_args(args: argparse.Namespace, problems: List[str]) -> Optional[Cluster]:
    nodes, per_node, gpu = args.nodes, args.gpus_per_node, args.gpu
    if args.cluster is not None:
        match = PRESET.match(args.cluster)
        if match is None:
            problems.append(f"--cluster {args.cluster}: expected NODESxGPUSxDEVICE, e.g. "
                            f"8x8xH100-80GB")
            return None
        if nodes is not None or per_node is not None or gpu is not None:
            problems.append("--cluster replaces --nodes, --gpus-per-node and --gpu: give one "
                            "or the other")
        nodes, per_node, gpu = int(match.group(1)), int(match.group(2)), match.group(3)
    for flag, value in (("--nodes", nodes), ("--gpus-per-node", per_node)):
        if value is None:
            problems.append(f"{flag} is required (or --cluster)")
        elif value < 1:
            problems.append(f"{flag} must be positive")
    for flag in ("gpu_memory_gib", "gpu_tflops", "intra_node_gbs", "inter_node_gbs",
                 "host_link_gbs", "cpu_memory_gib", "nvme_gib", "nvme_gbs"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            problems.append(f"--{flag.replace('_', '-')} must be positive")
    described = args.gpu_memory_gib is not None and args.gpu_tflops is not None
    try:
        try:
            base = device_named(gpu) if gpu is not None else None
        except ValueError:
            if not described:
                raise
            base = None  # a name the table lacks, described by both figures: its own device
        device = custom_device(base, args.gpu_memory_gib, args.gpu_tflops,
                               name=gpu or "custom")
    except ValueError as e:
        problems.append(f"--gpu: {e}" if gpu is not None else str(e))
        return None
    if problems:
        return None
    overrides = {k: v for k, v in (("intra_node_gbs", args.intra_node_gbs),
                                   ("host_link_gbs", args.host_link_gbs)) if v is not None}
    if overrides:
        device = dataclasses.replace(device, **overrides)
    return Cluster(nodes, per_node, device,
                   inter_node_gbs=args.inter_node_gbs or device.inter_node_gbs,
                   host_memory_gib=args.cpu_memory_gib or device.host_memory_gib,
                   nvme_gib=args.nvme_gib, nvme_gbs=args.nvme_gbs)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the planner; the exit status (module docstring)."""
    args = build_parser().parse_args(argv)
    problems: List[str] = scheme_problems("--model-config", args.model_config)
    cluster = cluster_from_args(args, problems)
    for flag in ("encoder_seq_length", "global_batch_size", "max_micro_batch", "top"):
        if getattr(args, flag) < 1:
            problems.append(f"--{flag.replace('_', '-')} must be positive")
    if args.decoder_seq_length is not None and args.decoder_seq_length < 1:
        problems.append("--decoder-seq-length must be positive")
    if not 0 < args.efficiency <= 1:
        problems.append("--efficiency must be in (0, 1]")
    if not 0 <= args.headroom < 1:
        problems.append("--headroom must be in [0, 1)")
    precision, note = args.precision, None
    if cluster is not None:
        try:
            precision, note = plan_precision(cluster.device, args.precision)
        except ValueError as e:
            problems.append(str(e))
    if problems:
        print("error: " + "\n       ".join(problems), file=sys.stderr)
        return 2
    request = Request(args.model_config, args.encoder_seq_length, args.decoder_seq_length,
                      args.global_batch_size, precision, args.max_micro_batch,
                      (False,) if args.no_recompute else (False, True))
    machine = machine_for(cluster, precision, args.efficiency)
    try:
        with logs_to_stderr():  # DeepSpeed, which checks each layout's config, logs to stdout
            result = plan(request, cluster, machine, args.headroom)
            document = json.dumps(as_json(result, args.top), indent=1) if args.json else \
                report(result, args.top, args.explain, notes=[note] if note else [])
    except ConfigError as e:
        print(f"error: --model-config {args.model_config}: {e}", file=sys.stderr)
        return 2
    if note and args.json:  # stdout is the JSON alone
        print(f"note: precision {note}", file=sys.stderr)
    print(document)
    return 0 if result.ranked else 1


if __name__ == "__main__":
    sys.exit(main())

"""Mixture-of-Experts on CPU: (a) dense against top-1 MoE training, (b) our layer against
DeepSpeed's, (c) expert parallelism (EP=2) against data parallelism (EP=1).

The three parts share this script's data preparation, timed trainer worker and saved results;
the report is bench/moe_report.py.

    python bench/bench_moe.py [--parts abc] [--steps 300] [--speed-steps 30] [--speed-rounds 2]
                              [--layer-repeats 15] [--layer-batches 8 32] [--ep-steps 8]
                              [--ep-rounds 2] [--work DIR] [--report-only] [--no-write]

Each part saves its figures in WORK/results.json (default bench/work/moe, ignored by git) with
the command that made them, so the parts can be run one at a time (`--parts a`, about 7 min;
b, 1 min; c, 3 min on 2 cores); the report (bench/RESULTS.md, section moe) is written from
whatever parts are saved.

(a) Training. The English test corpora (3.6 MB), bench_training's SentencePiece tokenizer
(8000 pieces + 100 sentinels) and .bin/.idx. Model: configs/model/t5-demo.json's shape (d_model
128, 4 heads x 32, d_ff 512 gated-gelu, 2 + 2 layers, untied) with the bench's vocabulary (8100,
padded to 8192) and dropout 0; the quickstart's recipe (launch/quickstart.sh): encoder 128
tokens, micro batch 8 on each of 2 ranks (`torchrun --nproc_per_node 2`, gloo, one thread each),
global batch 16, AdamW, lr 3e-3 with 20 warm-up steps and cosine decay to 3e-4, ZeRO 0, fp32.
The same run dense and with `--num-experts 8 --moe-router-type switch` (every block's
feed-forward sparse; and, Switch Transformer's layout, every second block's:
`--moe-encoder-sparse-step 2 --moe-decoder-sparse-step 2`), dropless (the default), balancing
losses at their defaults (aux 1e-2, z 1e-3), and, to show the run-to-run noise, dense again with
other initial weights. Top-1 routing runs one expert per token, so the active FLOPs are the
dense model's plus the router's. Same --seed, so the same data order and the same evaluation
batches (the first --eval-iters global batches of the 5% validation split, every
--eval-interval steps). Speed from separate runs of --speed-steps steps without evaluation in
--speed-rounds rounds: rank 0's wall time in the trainer's step, the median after the first 5
steps, the fastest round counting. The trainer runs under this file's worker, which times the
parts of each step and reads each sparse layer's routing counts (expert load).

(b) The layer alone, one process, fp32, --threads threads. Ours: SparseMLP, router 'switch',
expert_capacity_factor = eval_expert_capacity_factor = 1.25 (and dropless). DeepSpeed's
`deepspeed.moe.layer.MoE(k=1, capacity_factor=1.25, eval_capacity_factor=1.25)` (and
`drop_tokens=False`), its other arguments at their defaults, ep_size 1 (torch.distributed
started with gloo and one process), its expert a gated-gelu MLP of the same size without bias
(T5's); both with the same router and expert weights. Forward and backward (the output times a
fixed random gradient plus the balancing loss each returns), the input requiring a gradient, in
training mode: the median over --layer-repeats calls, the two layers alternating. Peak memory:
torch.profiler's allocation events (profile_memory) during one more call of each, the largest
sum of bytes allocated and not yet freed since the call began, the same way for both.

(c) Expert parallelism. bench_training's model (d_model 512, 8 heads x 64, d_ff 1024
gated-gelu, 4 + 4 layers, untied, vocabulary 8192) with 8 experts in every block, its flags
(encoder 256 tokens, micro batch 4 per rank, global 8, ZeRO 0, fp32, AdamW), 2 processes:
`--expert-model-parallel-size 2` (4 experts on each rank, tokens sent by all-to-all) against 1
(every expert on both ranks, their gradients all-reduced). Speed as bench_training's: rank 0's
logged step time, the mean after --skip steps, --ep-rounds rounds, the fastest counting. In
each rank the worker times DeepSpeed's forward, backward and optimizer step and the wall time
inside torch.distributed.all_reduce and all_to_all_single (with calls and bytes), per training
step.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    WORK,
    allocated,
    busy_seconds,
    deepspeed_version,
    machine_line,
    own_seconds,
    prepare_data,
    run_torchrun,
    train_flags,
    write_section,
)
from bench.moe_report import (  # noqa: E402
    A_ENC_LEN,
    A_GLOBAL,
    A_MICRO,
    A_SKIP,
    CAPACITY,
    LAYER,
    MIB,
    PARTS,
    report,
)

SMALL = dict(vocab_size=8100, d_model=128, d_kv=32, d_ff=512, num_layers=2,
             num_decoder_layers=2, num_heads=4, feed_forward_proj="gated-gelu",
             tie_word_embeddings=False, dropout_rate=0.0)
"""(a): t5-demo.json's shape, the bench tokenizer's vocabulary, dropout 0."""
MOE = ["--num-experts", "8", "--moe-router-type", "switch"]
EVERY_SECOND = ["--moe-encoder-sparse-step", "2", "--moe-decoder-sparse-step", "2"]
TRAINING_RUNS = [
    # name, flags, offset of the initial weights' seed (the data's stays --seed's)
    ("dense", [], 0),
    ("MoE 8 experts, every block", MOE, 0),
    ("MoE 8 experts, every second block", [*MOE, *EVERY_SECOND], 0),
    ("dense, other initial weights", [], 1),
]
EP_RUNS = [("EP=1 (data parallel, experts replicated)", "1"),
           ("EP=2 (4 experts per rank, all-to-all)", "2")]
TIMES_ENV = "BENCH_MOE_TIMES"
INIT_OFFSET_ENV = "BENCH_MOE_INIT_OFFSET"
"""The worker draws the initial weights from --seed plus this (the data order and noise keep
--seed), so a run differs from another only by its initial weights."""
STEP_LINE = re.compile(r" iteration\s+(\d+)/.*\| loss: ([\d.E+-]+) \|")
EVAL_LINE = re.compile(r" validation loss at iteration (\d+) \| lm loss: ([\d.E+-]+)")


# The worker (inside each rank of (a) and (c)) -----------------------------------------------
RANGE_PARTS = {"forward": "forward", "backward": "backward", "optimizer-step": "optimizer",
               "comm:grad-reduce": "all_reduce", "comm:all-to-all": "a2a"}
"""The library's range names (megatron/training/profiling.py) -> PARTS."""


def _worker_listener(out: Path, expert_dp: int):
    """A timing listener writing one JSON line per training step to `out`: the wall time of
    the step (the 'train-step' range; a library without it: from the step's first range to the
    end of its optimizer step), PARTS, the all-to-all's calls and input bytes, the bytes of the
    gradients DeepSpeed all-reduces (every parameter's under ZeRO 0; an expert's only when its
    expert-data group has more than one rank) and the sparse layers' routing counts."""
    from megatron.model.meta import is_expert_parameter
    from megatron.model.moe import sparse_layers
    from megatron.training.timing import RangeListener

    class Steps(RangeListener):
        def __init__(self):
            self.layers, self.reduced_bytes, self.has_train_step = [], 0, False
            self.began = None
            self.reset()

        def reset(self):
            self.spent = dict.fromkeys(PARTS, 0.0)
            self.counts = {"a2a_calls": 0, "a2a_bytes": 0}
            for layer in self.layers:  # leave out what evaluations routed
                layer.stats.reset()

        def attach(self, step):
            model = step.engine.module
            self.layers = sparse_layers(model)
            self.reduced_bytes = sum(
                p.numel() * p.element_size() for name, p in model.named_parameters()
                if p.requires_grad and (expert_dp > 1 or not is_expert_parameter(name)))

        def opened(self, name):
            if name == "train-step":
                self.has_train_step = True
                self.reset()
                self.began = time.perf_counter()
            elif self.began is None and name in ("data-wait", "forward"):
                self.began = time.perf_counter()

        def closed(self, name, seconds, nbytes):
            part = RANGE_PARTS.get(name)
            if part is not None:
                self.spent[part] += seconds
            if part == "a2a":
                self.counts["a2a_calls"] += 1
                self.counts["a2a_bytes"] += nbytes
            if name == "evaluation":
                self.reset()
                self.began = None
            elif name == "train-step" or (name == "optimizer-step" and not self.has_train_step):
                self.write(time.perf_counter() - self.began)

        def write(self, wall):
            record = {"wall": wall, **{f"{k}_s": v for k, v in self.spent.items()},
                      **self.counts, "all_reduce_bytes": self.reduced_bytes,
                      "load": [layer.stats.load.tolist() for layer in self.layers],
                      "dropped": [float(layer.stats.dropped) for layer in self.layers]}
            with open(out, "a") as f:
                f.write(json.dumps(record) + "\n")
            self.began = None
            self.reset()

    return Steps()


def worker(argv: Sequence[str]) -> int:
    """The entry point with a timing listener (`_worker_listener`): one JSON line per step in
    $BENCH_MOE_TIMES/rank<R>.jsonl."""
    from megatron.pretrain_t5 import main as entry_point

    offset = int(os.environ.get(INIT_OFFSET_ENV, "0"))
    if offset:  # other initial weights, the same data order (no flag for that: see the docstring)
        from megatron.tensor_parallel import random as model_random

        layer_seed = model_random.layer_seed  # init_rng looks it up at each layer
        model_random.layer_seed = lambda base, name: layer_seed(base + offset, name)
    flag = "--expert-model-parallel-size"
    ep = int(argv[list(argv).index(flag) + 1]) if flag in argv else 1
    out = Path(os.environ[TIMES_ENV]) / f"rank{os.environ['RANK']}.jsonl"
    listener = _worker_listener(out, int(os.environ["WORLD_SIZE"]) // ep)
    return entry_point(list(argv), listeners=[listener])


def read_steps(folder: Path, rank: int) -> List[dict]:
    path = folder / f"rank{rank}.jsonl"
    if not path.exists():
        sys.exit(f"the worker of rank {rank} wrote nothing ({path})")
    return [json.loads(line) for line in path.read_text().splitlines()]


def worker_run(flags: Sequence[str], log: Path, times: Path, init_offset: int = 0):
    """One `torchrun --nproc_per_node 2` run of the worker; (Run, [rank 0's steps, rank 1's])."""
    times.mkdir(parents=True, exist_ok=True)
    for old in times.glob("rank*.jsonl"):
        old.unlink()
    run = run_torchrun(["--worker", *flags], log,
                       {TIMES_ENV: str(times), INIT_OFFSET_ENV: str(init_offset)},
                       module="bench.bench_moe")
    return run, [read_steps(times, rank) for rank in (0, 1)]


# (a) dense against MoE training ---------------------------------------------------------------
def small_flags(paths: Dict[str, Path], steps: int, eval_interval: int, eval_iters: int,
                extra: Sequence[str]) -> List[str]:
    return ["--data-path", str(paths["data"]), "--tokenizer-model", str(paths["tokenizer"]),
            "--model-config", str(paths["small"]), "--encoder-seq-length", str(A_ENC_LEN),
            "--micro-batch-size", str(A_MICRO), "--global-batch-size", str(A_GLOBAL),
            "--train-iters", str(steps), "--lr", "3e-3", "--min-lr", "3e-4",
            "--lr-decay-style", "cosine", "--lr-warmup-iters", "20", "--split", "95,5,0",
            "--log-interval", "1", "--eval-interval", str(eval_interval),
            "--eval-iters", str(eval_iters), "--num-workers", "0", *extra]


def shape_of(flags: Sequence[str]) -> dict:
    """Parameters, active FLOPs per step and decoder length of the run `flags` describe (its
    model built on the meta device)."""
    from megatron.arguments import parse_args
    from megatron.model.flops import training_step_flops
    from megatron.model.meta import meta_model

    config = parse_args(list(flags), env={"WORLD_SIZE": "2"})
    t5, data = config.model.t5, config.data
    model = meta_model(t5, 1)
    flops = training_step_flops(t5, config.batch.global_batch_size, data.encoder_seq_length,
                                data.decoder_seq_length, model.padded_vocab_size)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return {"parameters": sum(p.numel() for p in model.parameters()), "expert_parameters":
            experts, "flops": flops.model, "decoder_seq_length": data.decoder_seq_length,
            "sparse": [len(t5.sparse_blocks(False)), len(t5.sparse_blocks(True))]}


def run_training(paths, args) -> dict:
    """The long runs (losses, expert load), then the speed runs: every configuration but the
    noise reference for --speed-steps steps without evaluation, in --speed-rounds rounds."""
    rows = []
    for index, (name, extra, init_offset) in enumerate(TRAINING_RUNS):
        flags = small_flags(paths, args.steps, args.eval_interval, args.eval_iters, extra)
        log = args.work / f"a{index}.log"
        run, steps = worker_run(flags, log, args.work / "times", init_offset)
        text = log.read_text()
        losses = {int(m[1]): float(m[2]) for m in STEP_LINE.finditer(text)}
        evals = {int(m[1]): float(m[2]) for m in EVAL_LINE.finditer(text)}
        if len(losses) != args.steps or len(steps[0]) != args.steps:
            sys.exit(f"{name}: expected {args.steps} steps, found {len(losses)} logged and "
                     f"{len(steps[0])} timed ({log})")
        rows.append({"name": name, "flags": extra, **shape_of(flags), "losses": losses,
                     "evals": evals, "init_offset": init_offset,
                     "balance": expert_balance(steps, args.steps), "speeds": [],
                     "others": [], "hwm": [0, 0]})
        print(f"(a) {name}: evaluations "
              + ", ".join(f"{it}: {loss:.3f}" for it, loss in sorted(evals.items()))
              + f" ({run.wall_s:.0f} s)", flush=True)
    for round_ in range(args.speed_rounds):
        for index, row in enumerate(rows):
            if row["init_offset"]:
                continue
            flags = small_flags(paths, args.speed_steps, 1000, 0, row["flags"])
            run, steps = worker_run(flags, args.work / f"a{index}_speed{round_}.log",
                                    args.work / "times")
            walls = [r["wall"] for r in steps[0]][A_SKIP:]
            median = statistics.median(walls)
            if not row["speeds"] or median < min(row["speeds"]):
                row["parts"] = timed_share(steps[0][A_SKIP:])
                row["step_wall"] = walls
            row["speeds"].append(median)
            row["others"].append(run.others_cpu)
            row["hwm"] = [max(a, run.hwm[k]) for k, a in enumerate(row["hwm"])]
            print(f"(a) round {round_ + 1}, {row['name']}: median step {median:.3f} s; others' "
                  f"CPU {run.others_cpu:.2f}", flush=True)
    return {"rows": rows, "eval_iters": args.eval_iters, "speed_steps": args.speed_steps,
            "speed_rounds": args.speed_rounds}


def expert_balance(steps: List[List[dict]], train_iters: int) -> Optional[dict]:
    """The busiest expert's share over the even share (1: balanced, 8: all tokens to one),
    per sparse layer, over both ranks' tokens of the first and the last 50 steps."""
    if not steps[0] or not steps[0][0]["load"]:
        return None
    window = min(50, train_iters // 2)

    def busiest(records_by_rank):
        layers = len(records_by_rank[0][0]["load"])
        out = []
        for layer in range(layers):
            totals = None
            for records in records_by_rank:
                for record in records:
                    load = torch.tensor(record["load"][layer])
                    totals = load if totals is None else totals + load
            out.append(float(totals.max() / totals.mean()))
        return out

    first = busiest([r[:window] for r in steps])
    last = busiest([r[-window:] for r in steps])
    dropped = sum(sum(record["dropped"]) for r in steps for record in r)
    return {"first": first, "last": last, "window": window, "dropped": dropped}


# (b) our layer against DeepSpeed's ----------------------------------------------------------
class GatedMLP(torch.nn.Module):
    """T5's gated-gelu feed-forward (no bias), DeepSpeed's expert."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.wi_0 = torch.nn.Linear(d_model, d_ff, bias=False)
        self.wi_1 = torch.nn.Linear(d_model, d_ff, bias=False)
        self.wo = torch.nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.nn.functional.gelu(self.wi_0(x), approximate="tanh")
        return self.wo(gate * self.wi_1(x))


def start_one_process_group() -> None:
    """torch.distributed with gloo and one process, which DeepSpeed's MoE needs at ep_size 1."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)


def build_layers(capacity: Optional[float]):
    """(ours, DeepSpeed's) with the same router and expert weights; capacity None: dropless."""
    from deepspeed.moe.layer import MoE

    from megatron.model.config import T5Config
    from megatron.model.moe import SparseMLP
    from megatron.model.transformer import InitMethods
    from megatron.tensor_parallel.group import NO_EXPERT_PARALLEL, SINGLE

    d_model, d_ff, experts = LAYER["d_model"], LAYER["d_ff"], LAYER["experts"]
    config = T5Config(vocab_size=256, d_model=d_model, d_kv=64, d_ff=d_ff, num_layers=1,
                      num_heads=8, feed_forward_proj="gated-gelu", dropout_rate=0.0,
                      num_experts=experts, router_type="switch",
                      expert_capacity_factor=capacity, eval_expert_capacity_factor=capacity)
    torch.manual_seed(0)
    ours = SparseMLP(config, InitMethods(config, 1), tp=SINGLE, ep=NO_EXPERT_PARALLEL,
                     sparse_layers=1)
    theirs = MoE(d_model, GatedMLP(d_model, d_ff), num_experts=experts, ep_size=1, k=1,
                 capacity_factor=capacity or 1.0, eval_capacity_factor=capacity or 1.0,
                 drop_tokens=capacity is not None)
    theirs.set_deepspeed_parallelism()
    moe = theirs.deepspeed_moe
    with torch.no_grad():
        moe.gate.wg.weight.copy_(ours.router.classifier.weight)
        for e, expert in enumerate(moe.experts.deepspeed_experts):
            expert.wi_0.weight.copy_(ours.experts.wi_0[e])
            expert.wi_1.weight.copy_(ours.experts.wi_1[e])
            expert.wo.weight.copy_(ours.experts.wo[e])
    return ours.train(), theirs.train()


def clear_grads(layer, hidden: torch.Tensor) -> None:
    layer.zero_grad(set_to_none=True)
    hidden.grad = None


def layer_call(layer, hidden: torch.Tensor, grad: torch.Tensor, ours: bool) -> torch.Tensor:
    """Forward and backward of one layer (gradients cleared first); returns the output."""
    clear_grads(layer, hidden)
    return forward_backward(layer, hidden, grad, ours)


def forward_backward(layer, hidden: torch.Tensor, grad: torch.Tensor, ours: bool) -> torch.Tensor:
    if ours:
        out, aux = layer(hidden)
    else:
        out, aux, _ = layer(hidden)
    torch.autograd.backward([out, aux], [grad, torch.ones_like(aux)])
    return out.detach()


def layer_memory(layer, hidden: torch.Tensor, grad: torch.Tensor, ours: bool) -> Dict[str, int]:
    clear_grads(layer, hidden)
    out = allocated(lambda: forward_backward(layer, hidden, grad, ours))
    if out["low"] < -MIB:
        sys.exit(f"the profiled call freed {-out['low'] / MIB:.1f} MiB allocated before it: "
                 "its peak is not comparable")
    return out


def dropped_choices(ours, theirs, hidden: torch.Tensor, capacity: Optional[float]):
    """(ours, DeepSpeed's) fraction of the token choices dropped by capacity in one forward."""
    import math

    ours.stats.reset()
    with torch.no_grad():
        ours(hidden)
        _, _, counts = theirs(hidden)
    mine = float(ours.stats.dropped) / ours.stats.choices
    if capacity is None:
        return mine, 0.0
    tokens = hidden.shape[0] * hidden.shape[1]
    limit = max(math.ceil(tokens / LAYER["experts"] * capacity), 4)  # min_capacity 4
    return mine, float((counts - limit).clamp(min=0).sum()) / tokens


def compare_layers(args) -> dict:
    torch.set_num_threads(args.threads)
    start_one_process_group()
    rows = []
    for batch in args.layer_batches:
        for capacity in (CAPACITY, None):
            ours, theirs = build_layers(capacity)
            g = torch.Generator().manual_seed(1)
            shape = (batch, LAYER["length"], LAYER["d_model"])
            hidden = torch.randn(shape, generator=g).requires_grad_()
            grad = torch.randn(shape, generator=g)
            times = {"ours": [], "deepspeed": []}
            started, busy, own = time.perf_counter(), busy_seconds(), own_seconds()
            for i in range(args.layer_repeats + 2):
                for name, layer in (("ours", ours), ("deepspeed", theirs)):
                    began = time.perf_counter()
                    layer_call(layer, hidden, grad, name == "ours")
                    if i >= 2:
                        times[name].append(time.perf_counter() - began)
            others = max(0.0, (busy_seconds() - busy) - (own_seconds() - own)) \
                / (time.perf_counter() - started)
            memory = {name: layer_memory(layer, hidden, grad, name == "ours")
                      for name, layer in (("ours", ours), ("deepspeed", theirs))}
            drop_ours, drop_theirs = dropped_choices(ours, theirs, hidden, capacity)
            row = {"batch": batch, "capacity": capacity, "times": times, "memory": memory,
                   "others": others,
                   "dropped": {"ours": drop_ours, "deepspeed": drop_theirs},
                   "speedup": statistics.median(t / o for o, t in
                                                zip(times["ours"], times["deepspeed"]))}
            if capacity is None:  # nothing dropped: the two layers compute the same function
                out_ours = layer_call(ours, hidden, grad, True)
                grad_ours = hidden.grad.clone()
                out_theirs = layer_call(theirs, hidden, grad, False)
                row["max_difference"] = {
                    "output": float((out_ours - out_theirs).abs().max() / out_theirs.abs().max()),
                    "input_grad": float((grad_ours - hidden.grad).abs().max()
                                        / hidden.grad.abs().max())}
            rows.append(row)
            print(f"(b) batch {batch}, capacity {capacity}: ours "
                  f"{statistics.median(times['ours']) * 1e3:.1f} ms, DeepSpeed "
                  f"{statistics.median(times['deepspeed']) * 1e3:.1f} ms; peak "
                  f"{memory['ours']['peak'] / MIB:.1f} / "
                  f"{memory['deepspeed']['peak'] / MIB:.1f} MiB; others' CPU {others:.2f}",
                  flush=True)
    return {"rows": rows, "threads": args.threads, "repeats": args.layer_repeats}


# (c) EP=2 against EP=1 --------------------------------------------------------------------------
def run_expert_parallel(paths, args) -> dict:
    rows = [{"name": name, "ep": ep, "speeds": [], "others": [], "hwm": [0, 0]}
            for name, ep in EP_RUNS]
    for round_ in range(args.ep_rounds):
        for index, row in enumerate(rows):
            flags = train_flags(paths, "model", args.ep_steps,
                                [*MOE, "--expert-model-parallel-size", row["ep"]])
            if round_ == 0:
                row.update(shape_of(flags))
            run, steps = worker_run(flags, args.work / f"c{index}_{round_}.log",
                                    args.work / "times")
            logged = [t for it, t in sorted(run.step_s.items()) if it > args.skip]
            if len(logged) != args.ep_steps - args.skip:
                sys.exit(f"{row['name']}: expected {args.ep_steps} logged steps, found "
                         f"{len(run.step_s)}")
            speed = 1 / statistics.mean(logged)
            if not row["speeds"] or speed > max(row["speeds"]):
                row["steps"] = logged
                row["ranks"] = [timed_share(r[args.skip:]) for r in steps]
            row["speeds"].append(speed)
            row["others"].append(run.others_cpu)
            row["hwm"] = [max(a, run.hwm[k]) for k, a in enumerate(row["hwm"])]
            share = " / ".join(f"{100 * timed_share(r[args.skip:])['share']:.1f}%"
                               for r in steps)
            print(f"(c) round {round_ + 1}, {row['name']}: {speed:.3f} steps/s, all-to-all "
                  f"{share} of the step; others' CPU {run.others_cpu:.2f}", flush=True)
    return {"rows": rows, "steps": args.ep_steps, "skip": args.skip, "rounds": args.ep_rounds}


def timed_share(records: List[dict]) -> dict:
    """A rank's timed steps, per step: the wall time, each of PARTS (seconds), the all-to-all
    calls and the MiB this rank gave them (its rows to itself included), and the all-to-all's
    share of the wall time."""
    n = len(records)
    out = {"wall": sum(r["wall"] for r in records) / n}
    out.update({part: sum(r[f"{part}_s"] for r in records) / n for part in PARTS})
    out["calls"] = sum(r["a2a_calls"] for r in records) / n
    out["mib"] = sum(r["a2a_bytes"] for r in records) / n / MIB
    out["all_reduce_mib"] = sum(r["all_reduce_bytes"] for r in records) / n / MIB
    out["share"] = out["a2a"] / out["wall"]
    return out


# Main ---------------------------------------------------------------------------------------
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="abc", help="which parts to run: a, b, c")
    parser.add_argument("--steps", type=int, default=300, help="(a) training steps of each run")
    parser.add_argument("--eval-interval", type=int, default=50, help="(a)")
    parser.add_argument("--eval-iters", type=int, default=10,
                        help="(a) global batches of 16 in each evaluation")
    parser.add_argument("--speed-steps", type=int, default=30,
                        help="(a) steps of each speed run (without evaluation)")
    parser.add_argument("--speed-rounds", type=int, default=2,
                        help="(a) speed runs of each configuration, one round after the other; "
                             "the fastest counts")
    parser.add_argument("--layer-repeats", type=int, default=15,
                        help="(b) timed calls of each layer")
    parser.add_argument("--layer-batches", type=int, nargs="+", default=[8, 32],
                        help="(b) sequences of 256 tokens in a call")
    parser.add_argument("--threads", type=int, default=2, help="(b) torch threads")
    parser.add_argument("--ep-steps", type=int, default=8, help="(c) steps of each run")
    parser.add_argument("--skip", type=int, default=3, help="(c) warm-up steps left out")
    parser.add_argument("--ep-rounds", type=int, default=2,
                        help="(c) runs of each configuration, one round after the other; the "
                             "fastest counts")
    parser.add_argument("--work", type=Path, default=WORK / "moe",
                        help="data, model JSONs, the runs' logs and results.json")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite the report from WORK/results.json without running")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    if not set(args.parts) <= set("abc") or args.ep_steps <= args.skip:
        sys.exit("--parts takes a, b and c; --ep-steps must exceed --skip")
    saved = args.work / "results.json"
    results = json.loads(saved.read_text()) if saved.exists() else {}
    if not args.report_only:
        paths = prepare_data(args.work)
        paths["small"] = args.work / "small.json"
        paths["small"].write_text(json.dumps(SMALL, indent=1) + "\n")
        for part, measure in (("a", lambda: run_training(paths, args)),
                              ("b", lambda: compare_layers(args)),
                              ("c", lambda: run_expert_parallel(paths, args))):
            if part not in args.parts:
                continue
            started = time.perf_counter()
            figures = measure()
            results[part] = {**figures, "wall_s": time.perf_counter() - started,
                             "command": command_line(part, args), "machine": machine(),
                             "when": time.strftime("%Y-%m-%d")}
            saved.write_text(json.dumps(results, indent=1))
    if not results:
        sys.exit(f"{saved} does not exist: run the bench first")
    body = report(results)
    print(body)
    if not args.no_write:
        write_section("moe", body)
    return 0


def command_line(part: str, args) -> str:
    defaults = {"a": (("steps", 300), ("eval_interval", 50), ("eval_iters", 10),
                      ("speed_steps", 30), ("speed_rounds", 2)),
                "b": (("layer_repeats", 15), ("layer_batches", [8, 32]), ("threads", 2)),
                "c": (("ep_steps", 8), ("skip", 3), ("ep_rounds", 2))}[part]
    out = f"python bench/bench_moe.py --parts {part}"
    for name, default in defaults:
        value = getattr(args, name)
        if value != default:
            shown = " ".join(map(str, value)) if isinstance(value, list) else value
            out += f" --{name.replace('_', '-')} {shown}"
    return out


def machine() -> str:
    return (f"{machine_line()}, torch {torch.__version__}, DeepSpeed {deepspeed_version()}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        sys.exit(worker(sys.argv[2:]))
    sys.exit(main())

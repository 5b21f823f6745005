"""The 'cpm2' router (CPM-2-MoE's BASE layers) against our 'base' router, on CPU.

    python bench/bench_cpm2_router.py [--steps 12] [--skip 4] [--rounds 2] [--repeats 20]
                                      [--no-write]

(a) Training step. bench_training's model (bench/common.py: d_model 512, 8 heads x 64, d_ff
1024 gated-gelu, 4 + 4 layers, untied, vocabulary 8192), every block's feed-forward made 2
experts, its flags (encoder 256 tokens, micro batch 4 per rank, global 8, ZeRO 0, fp32, AdamW),
2 processes with one expert each (`--expert-model-parallel-size 2`, CPM-2-MoE's layout):
`--moe-router-type cpm2` against `--moe-router-type base`. Both send each token to one expert and
back by all-to-all; cpm2 adds CPM-2's shuffle (two more all-to-alls of every token) and its
auction over the data-parallel rank's tokens, base routes per sequence with its exact auction and
scales by a gate. Speed: rank 0's logged step time, the median after --skip steps, --rounds
rounds alternating the two, the fastest round counting.

(b) The assignment alone, one thread: CPM-2's auction (`cpm2_assignment`, csrc/cpm2_auction.cpp)
against our exact one (`balanced_assignment`) on the same standard-normal scores: one group of
4096 tokens on 32 experts (a CPM-2-MoE rank: micro-batch 8 x 512 encoder tokens, 32 experts) and
8 groups of 512 tokens on 32 experts (base's per-sequence groups of the same tokens). Median
process CPU time of --repeats runs, new scores each run.
Results go to bench/RESULTS.md (section cpm2_router).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (WORK, machine_line, markdown_table, prepare_data, run_torchrun,
                          train_flags, write_section)
from megatron.model.balanced_assignment import balanced_assignment, cpm2_assignment

ROUTERS = ("base", "cpm2")


def step_times(steps: int, skip: int, rounds: int) -> dict:
    work = WORK / "cpm2_router"
    paths = prepare_data(work)
    best = {}
    for r in range(rounds):
        for router in ROUTERS:
            flags = train_flags(paths, "model", steps, [
                "--num-experts", "2", "--moe-router-type", router,
                "--expert-model-parallel-size", "2", "--global-batch-size", "8",
                "--zero-stage", "0", "--seed", "1"])
            run = run_torchrun(flags, work / f"{router}_{r}.log",
                               env={"OMP_NUM_THREADS": "1"})
            times = [run.step_s[i] for i in sorted(run.step_s) if i > skip]
            median = statistics.median(times)
            print(f"round {r} {router}: {median * 1e3:.0f} ms per step", flush=True)
            best[router] = min(best.get(router, median), median)
    return best


def cpu_time(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def assignment_times(repeats: int) -> list:
    torch.set_num_threads(1)
    rows = []
    for groups, tokens, experts in ((1, 4096, 32), (8, 512, 32)):
        mine, exact = [], []
        for seed in range(repeats):
            scores = torch.randn(groups, tokens, experts,
                                 generator=torch.Generator().manual_seed(seed))
            mine.append(cpu_time(lambda: cpm2_assignment(scores)))
            exact.append(cpu_time(lambda: balanced_assignment(scores)))
        a, b = statistics.median(mine), statistics.median(exact)
        rows.append((f"{groups} x {tokens} tokens, {experts} experts", f"{a * 1e3:.1f}",
                     f"{b * 1e3:.1f}", f"{a / b:.2f}"))
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--skip", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    started = time.perf_counter()
    steps = step_times(args.steps, args.skip, args.rounds)
    assignment = assignment_times(args.repeats)
    minutes = (time.perf_counter() - started) / 60
    command = "python bench/bench_cpm2_router.py" + "".join(
        f" --{k.replace('_', '-')} {v}" for k, v in vars(args).items()
        if k != "no_write" and v != p.get_default(k))
    body = [
        f"Command: `{command}` ({minutes:.1f} min, {time.strftime('%Y-%m-%d')}); "
        f"{machine_line()}.", "",
        "(a) Training step, 2 processes, one expert each (EP = DP = 2), every block sparse "
        "(bench_training's model, fp32, ZeRO 0; rank 0's median step time after the first "
        f"{args.skip} steps, fastest of {args.rounds} rounds):", "",
        *markdown_table(["router", "step (ms)", "against base"],
                        [(r, f"{steps[r] * 1e3:.0f}", f"{steps[r] / steps['base']:.2f}")
                         for r in ROUTERS]),
        "", "(b) The assignment alone, one thread, median CPU time of "
        f"{args.repeats} draws of standard-normal scores:", "",
        *markdown_table(["problem", "cpm2 auction (ms)", "exact auction, base (ms)",
                         "cpm2 / exact"], assignment),
    ]
    print("\n".join(body))
    if not args.no_write:
        write_section("cpm2_router", "\n".join(body))


if __name__ == "__main__":
    main()

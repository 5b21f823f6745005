"""The balanced assignment of BASE layers (csrc/balanced_assignment.cpp) against scipy.

    python bench/bench_balanced_assignment.py [--repeats 20]

Problems: 8 groups of 512 tokens on 32 experts (capacity 16, every slot taken) and 8 groups of
114 tokens on 32 experts (capacity 4, 14 spare slots), with two kinds of scores: standard normal,
and router-like log-softmax scores where most tokens prefer the same 4 experts.
Ours: `megatron.model.balanced_assignment.balanced_assignment` on the whole [8, T, E] tensor (one
call, one thread). scipy: `linear_sum_assignment(maximize=True)` on each group expanded to
experts * capacity slots, the 8 groups one after the other. Each of the `--repeats` runs draws new
scores (seeds 0, 1, ...; solving the same problem again is faster, the branch predictor learns
it), both solve them and their totals are checked equal. Median and best of the runs, process CPU
time (other work on the machine does not count).
Results go to bench/RESULTS.md (section balanced_assignment).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import scipy
import torch
from scipy.optimize import linear_sum_assignment

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine_line, write_section
from megatron.model.balanced_assignment import balanced_assignment

SHAPES = ((8, 512, 32, 16), (8, 114, 32, 4))  # groups, tokens, experts, capacity


def make_scores(kind: str, groups: int, tokens: int, experts: int, seed: int) -> torch.Tensor:
    logits = torch.randn(groups, tokens, experts, generator=torch.Generator().manual_seed(seed))
    if kind == "normal":
        return logits
    logits[..., :4] += 2.0  # most tokens' favourite is among 4 experts: far from balanced
    return torch.log_softmax(2.0 * logits, dim=-1)


def scipy_assignment(scores: np.ndarray, capacity: int) -> np.ndarray:
    """scipy's optimum for every group: [groups, tokens] experts."""
    out = np.empty(scores.shape[:2], np.int64)
    for g, group in enumerate(scores):
        slots = np.repeat(group, capacity, axis=1)  # [tokens, experts * capacity]
        rows, cols = linear_sum_assignment(slots, maximize=True)
        out[g, rows] = cols // capacity
    return out


def cpu_time(fn):
    start = time.process_time()
    result = fn()
    return time.process_time() - start, result


def total(scores: np.ndarray, expert: np.ndarray) -> np.ndarray:
    picked = np.take_along_axis(scores.astype(np.float64), expert[..., None], axis=2)[..., 0]
    return picked.sum(axis=1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)

    rows = []
    for groups, tokens, experts, capacity in SHAPES:
        for kind in ("normal", "router"):
            ours_times, scipy_times, gap = [], [], 0.0
            for seed in range(args.repeats):
                scores = make_scores(kind, groups, tokens, experts, seed)
                array = scores.numpy()
                seconds, ours = cpu_time(lambda: balanced_assignment(scores, capacity).numpy())
                ours_times.append(seconds)
                seconds, theirs = cpu_time(lambda: scipy_assignment(array, capacity))
                scipy_times.append(seconds)
                assert all(np.bincount(row, minlength=experts).max() <= capacity for row in ours)
                difference = np.abs(total(array, ours) - total(array, theirs)).max()
                assert difference <= 1e-6 * float(array.max() - array.min()), (kind, difference)
                gap = max(gap, difference)
            rows.append((f"{groups} x {tokens} tokens, {experts} experts, capacity {capacity}",
                         kind, statistics.median(ours_times), min(ours_times),
                         statistics.median(scipy_times), min(scipy_times), gap))
            print(rows[-1], flush=True)

    lines = [
        "## Balanced assignment (BASE-layer routing)",
        "",
        f"Command: `python bench/bench_balanced_assignment.py --repeats {args.repeats}`",
        f"Machine: {machine_line()}, torch {torch.__version__}, scipy {scipy.__version__}, one "
        "thread. Process CPU time of one call on all groups, median (best) of "
        f"{args.repeats} runs, each on new scores (seeds 0, 1, ...) that both solve; scipy's "
        "`linear_sum_assignment` solves each group expanded to experts x capacity slots, one "
        "group after the other. Scores: `normal` standard normal; `router` log-softmax of "
        "2 x (normal + 2 on 4 of the experts), most tokens preferring those 4. The totals agree "
        "(largest difference over all runs and groups in the last column).",
        "",
        "| problem | scores | ours (ms) | scipy (ms) | speed-up | total difference |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for problem, kind, ours_med, ours_best, scipy_med, scipy_best, gap in rows:
        lines.append(f"| {problem} | {kind} | {ours_med * 1e3:.2f} ({ours_best * 1e3:.2f}) | "
                     f"{scipy_med * 1e3:.2f} ({scipy_best * 1e3:.2f}) | "
                     f"{scipy_med / ours_med:.1f}x | {gap:.1e} |")
    write_section("balanced_assignment", "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

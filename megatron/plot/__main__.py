"""`python -m megatron.plot`: PNG figures of one or more runs.

    python -m megatron.plot ckpt/run1                     # a --save folder: its plots/
    python -m megatron.plot ckpt/a ckpt/b --x samples --output cmp/
    python -m megatron.plot logs/train.log --x time --smoothing 0.9

A RUN is a --save folder (the --log-file and --tensorboard-dir its newest meta.json names, else
log.txt or events files in it), a log file, or a TensorBoard events folder or file. One PNG per
quantity (loss with validation and test points, learning rate, gradient norm, tokens/s, memory;
the per-layer gradient norms as a heat map when logged), every run on it.

Exit status: 0 figures written, 1 matplotlib missing or a file could not be written, 2 a bad
command line or a RUN with nothing to plot.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from megatron.cli import CommandLineParser
from megatron.data.storage.paths import scheme_problems
from megatron.plot.find import RunNotFound, default_labels, load_run
from megatron.plot.runs import Run


def build_parser() -> argparse.ArgumentParser:
    p = CommandLineParser(
        prog="python -m megatron.plot",
        description="PNG figures of training runs (loss, validation loss, learning rate, "
                    "gradient norm, tokens/s, memory, per-layer gradient norms) from their "
                    "log files or TensorBoard events, several runs on one figure.")
    p.add_argument("runs", nargs="+", metavar="RUN",
                   help="a --save folder, a log file, or a TensorBoard events folder or file")
    p.add_argument("--output", "-o", default=None, metavar="DIR",
                   help="where the PNGs go (default: the first RUN's plots/, or plots/ beside "
                        "it when it is a file)")
    p.add_argument("--x", choices=("step", "samples", "tokens", "time"), default="step",
                   help="the x axis: steps, consumed samples (lines up runs with different "
                        "batch sizes), consumed tokens (samples x encoder sequence length), or "
                        "time: hours spent in training steps, the sum of the step times the "
                        "metrics lines report (rank 0's wall clock from the end of one step to "
                        "the end of the next, data waits included); evaluation, checkpoint "
                        "saves, start-up and the gaps between restarts are left out, so it is "
                        "not the job's elapsed time (default: step)")
    p.add_argument("--smoothing", type=float, default=0.6,
                   help="weight of the moving average drawn over the raw curves of loss, "
                        "gradient norm and tokens/s, as TensorBoard's slider (0: raw only; "
                        "default 0.6)")
    p.add_argument("--labels", nargs="+", default=None, metavar="NAME",
                   help="legend names, one per RUN (default: each RUN's last path component "
                        "that is not generic, such as ckpt, tb or log.txt)")
    p.add_argument("--source", choices=("auto", "log", "tensorboard"), default="auto",
                   help="read the log file or the TensorBoard events (default: the log when "
                        "a RUN has both)")
    return p


def default_output(run: str) -> Path:
    path = Path(run)
    return (path if path.is_dir() else path.parent) / "plots"


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    problems: List[str] = scheme_problems("RUN", args.runs) + scheme_problems("--output",
                                                                            args.output)
    if problems:  # (a URL would be read as a local path)
        print("error: " + "\n       ".join(problems), file=sys.stderr)
        return 2
    if not 0.0 <= args.smoothing < 1.0:
        problems.append(f"--smoothing {args.smoothing}: must be in [0, 1)")
    if args.labels is not None and len(args.labels) != len(args.runs):
        problems.append(f"--labels: {len(args.labels)} names for {len(args.runs)} runs")
    labels = args.labels or default_labels(args.runs)
    runs: List[Run] = []
    for run, label in zip(args.runs, labels):
        try:
            runs.append(load_run(run, label, args.source))
        except RunNotFound as e:
            problems.append(str(e))
        except OSError as e:
            problems.append(f"{run}: cannot be read ({e})")
    for run in runs:
        try:
            run.x_values([1], args.x)
        except ValueError as e:
            problems.append(f"--x {args.x}: {e}")
    if problems:
        print("error: " + "\n       ".join(problems), file=sys.stderr)
        return 2
    from megatron.plot.figures import MissingMatplotlib, build_figures, write_figures

    output = Path(args.output) if args.output else default_output(args.runs[0])
    try:
        paths = write_figures(build_figures(runs, args.x, args.smoothing), output)
    except MissingMatplotlib as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"error: --output {output}: {e}", file=sys.stderr)
        return 1
    for run in runs:
        print(f"{run.label}: {run.source} ({run.starts} start{'s' if run.starts != 1 else ''}"
              f", up to iteration {run.last_train_iteration()})")
    for path in paths:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

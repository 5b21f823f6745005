"""Preprocessing in shards against one process: does sharding cost anything?

    python bench/bench_preprocess_shards.py [--mb 30] [--trials 3]

On the same input (one English JSONL of ~30 MB from tests/data/corpora, so that the two shards
cut it mid-file) and the same 2 cores:
- one process, `--workers 2`;
- two processes started at once, `--num-shards 2 --shard-index 0|1 --workers 1`.
Tokens/s = the tokens written / wall time from the first start to the last exit (interpreter
start-up included in both). Trials alternate the two so that a neighbour's load hits both alike;
the median of each is kept, with the CPU seconds
the process trees used (what neighbours' load does not change). The shards' tokens are checked
equal to the single run's.
Results go to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, WORK, machine_line, make_english_jsonl, markdown_table, \
    tokenizer_model, write_section

TOKENS_RE = re.compile(r"done in [\d.]+ s: \d+ documents, (\d+) tokens")


def _command(model: Path, jsonl: Path, out: Path, workers: int, extra=()):
    return [sys.executable, str(REPO / "data_tools" / "preprocess_data.py"), "--input", str(jsonl),
            "--output-prefix", str(out), "--tokenizer-model", str(model), "--workers",
            str(workers), "--append-eod", "--no-progress", *extra]


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_at_once(commands) -> tuple:
    """(wall seconds from the first start to the last exit, CPU seconds of the process trees,
    tokens written by all)."""
    cpu = _children_cpu()
    start = time.perf_counter()
    procs = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for c in commands]
    errs = [p.communicate()[1] for p in procs]
    wall = time.perf_counter() - start
    for p, err in zip(procs, errs):
        if p.returncode != 0:
            sys.exit(f"a run failed:\n{err}")
    return wall, _children_cpu() - cpu, sum(int(TOKENS_RE.search(e).group(1)) for e in errs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=30)
    p.add_argument("--trials", type=int, default=5)
    args = p.parse_args()
    model = tokenizer_model(16000)
    jsonl = make_english_jsonl(WORK / f"en_{args.mb:g}mb.jsonl", args.mb)
    out = WORK / "shards_out"
    one = [_command(model, jsonl, out / "one", 2)]
    two = [_command(model, jsonl, out / "set", 1, ("--num-shards", "2", "--shard-index", str(i)))
           for i in range(2)]
    results = {"one": [], "two": []}
    for _ in range(args.trials):
        for name, commands in (("one", one), ("two", two)):
            results[name].append(run_at_once(commands))
            print(name, results[name][-1], file=sys.stderr)
    tokens = {name: {t for _, _, t in runs} for name, runs in results.items()}
    assert tokens["one"] == tokens["two"] and len(tokens["one"]) == 1, tokens
    total = tokens["one"].pop()
    wall = {name: statistics.median(w for w, _, _ in runs) for name, runs in results.items()}
    cpu = {name: statistics.median(c for _, c, _ in runs) for name, runs in results.items()}
    ratio = wall["one"] / wall["two"]
    fastest = {name: min(w for w, _, _ in runs) for name, runs in results.items()}
    cpu_ratio = cpu["one"] / cpu["two"]
    rows = [["one process, `--workers 2`", f"{wall['one']:.2f}", f"{total / wall['one']:,.0f}",
             "1.00", f"{cpu['one']:.2f}", f"{total / cpu['one']:,.0f}", "1.00"],
            ["2 shards at once, `--workers 1` each", f"{wall['two']:.2f}",
             f"{total / wall['two']:,.0f}", f"{ratio:.2f}", f"{cpu['two']:.2f}",
             f"{total / cpu['two']:,.0f}", f"{cpu_ratio:.2f}"]]
    table = "\n".join(markdown_table(["run", "wall s", "tokens/s", "ratio", "CPU s",
                                      "tokens/CPU s", "ratio"], rows))
    body = f"""## Preprocessing in shards (2 one-worker shards against one 2-worker process)

Command: `python bench/bench_preprocess_shards.py --mb {args.mb:g} --trials {args.trials}`
Machine: {machine_line()}, shared with other sessions (load average at the end:
{os.getloadavg()[0]:.1f}). Input: one {jsonl.stat().st_size / 1e6:.1f} MB English JSONL (cut
mid-file by the 2 shards), SentencePiece unigram vocab 16000, `--append-eod`; {total:,} tokens
either way (checked equal). Wall time from the first start to the last exit, interpreter start-up
included; medians of {args.trials} alternating trials. CPU s: user + system time of the whole
process trees (main processes and workers), which neighbours on the machine do not change.

{table}

The 2 shards reach **{ratio:.2f}x** the single process's tokens/s of wall time (goal >= 0.95x)
and **{cpu_ratio:.2f}x** its tokens per CPU second. Wall times move with the neighbours' load
(fastest trials: {fastest['one']:.2f} s for one process, {fastest['two']:.2f} s for the 2 shards,
{fastest['one'] / fastest['two']:.2f}x); the CPU seconds, the cost of the work itself, do not.
"""
    write_section("preprocess_shards", body)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())

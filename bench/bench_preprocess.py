"""Preprocessing throughput and memory, against the tokenizer's own limit measured in this run.

    python bench/bench_preprocess.py [--mb 50] [--rss-mb 50 200] [--workers 2]

1. Makes an English JSONL of ~50 MB by repeating tests/data/corpora text, and a tokenizer.
2. The limit: SentencePiece encoding of the same texts with 2 threads, already in memory (no I/O).
3. Ours: `preprocess_data.py --workers 2`, end to end (process start to exit) and steady state
   (as the tool's summary reports it: from the first finished chunk to the last).
4. Peak RSS of the whole process tree at two input sizes: it must not grow with the input.

Megatron-LM's tools/preprocess_data.py is not installable from PyPI, so it is not rerun here; the
issue's figures for it (60 MB, 2 workers: 8.4 MB/s steady, 3.6 MB/s end to end, tokenizer limit
11.7 MB/s on that machine) are compared as fractions of the tokenizer limit, which is what carries
across machines. Results go to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, WORK, machine_line, make_english_jsonl, run_measured, \
    tokenizer_model, write_section

MEGATRON = {"steady": 8.4, "end_to_end": 3.6, "limit": 11.7}


def tokenizer_limit(model: Path, jsonl: Path, threads: int) -> float:
    """MB/s of SentencePiece alone on the texts of `jsonl`, `threads` threads, best of 2."""
    import sentencepiece as spm

    with open(jsonl, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    nbytes = jsonl.stat().st_size  # MB of input, as the tool's rate counts
    sp = spm.SentencePieceProcessor(model_file=str(model))
    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        sp.encode(texts, num_threads=threads)
        best = min(best, time.perf_counter() - start)
    return nbytes / 1e6 / best


def preprocess(model: Path, jsonl: Path, workers: int, extra=()):
    out = WORK / f"out_{jsonl.stem}"
    cmd = [sys.executable, str(REPO / "data_tools" / "preprocess_data.py"), "--input", str(jsonl),
           "--output-prefix", str(out), "--tokenizer-model", str(model), "--workers", str(workers),
           "--append-eod", "--no-progress", *extra]
    wall, peak, err = run_measured(cmd)
    rate = float(re.search(r"steady state: ([\d.]+) MB/s", err).group(1))
    return wall, peak, rate


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=50)
    p.add_argument("--rss-mb", type=float, nargs=2, default=[50, 200])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=16000)
    args = p.parse_args()

    model = tokenizer_model(args.vocab)
    main_input = make_english_jsonl(WORK / f"en_{args.mb:g}mb.jsonl", args.mb)
    mb = main_input.stat().st_size / 1e6
    limit = tokenizer_limit(model, main_input, args.workers)
    runs = [preprocess(model, main_input, args.workers) for _ in range(2)]
    wall = min(r[0] for r in runs)
    rate = max(r[2] for r in runs)
    e2e = mb / wall
    rss = []
    for size in args.rss_mb:
        jsonl = make_english_jsonl(WORK / f"en_{size:g}mb.jsonl", size)
        rss.append((jsonl.stat().st_size / 1e6, preprocess(model, jsonl, args.workers)[1]))

    ours_frac_steady, ours_frac_e2e = rate / limit, e2e / limit
    meg_frac_steady = MEGATRON["steady"] / MEGATRON["limit"]
    meg_frac_e2e = MEGATRON["end_to_end"] / MEGATRON["limit"]
    body = f"""## Preprocessing throughput and memory

Command: `python bench/bench_preprocess.py --mb {args.mb:g} --workers {args.workers}`
Machine: {machine_line()}. Input: {mb:.1f} MB English JSONL (tests/data/corpora repeated),
SentencePiece unigram vocab {args.vocab} (+100 sentinels), `--append-eod`, {args.workers} workers.

| measure | MB/s | fraction of the tokenizer limit |
| --- | ---: | ---: |
| tokenizer limit (SentencePiece, {args.workers} threads, texts in memory) | {limit:.2f} | 1.00 |
| ours, steady state (tool's summary: first to last chunk) | {rate:.2f} | {ours_frac_steady:.2f} |
| ours, end to end incl. interpreter start-up ({wall:.1f} s) | {e2e:.2f} | {ours_frac_e2e:.2f} |
| Megatron-LM steady state (issue's figures, 60 MB) | {MEGATRON['steady']} | {meg_frac_steady:.2f} |
| Megatron-LM end to end (issue's figures, 60 MB) | {MEGATRON['end_to_end']} | {meg_frac_e2e:.2f} |

End to end against Megatron-LM, as fractions of each machine's tokenizer limit:
**{ours_frac_e2e / meg_frac_e2e:.2f}x** (goal >= 2x). Steady state: {ours_frac_steady:.0%} of the
limit (goal >= 90%).

Peak RSS of the whole process tree (main + workers):

| input | peak RSS |
| ---: | ---: |
""" + "\n".join(f"| {size:.0f} MB | {peak / 2**20:.0f} MiB |" for size, peak in rss) + "\n"
    write_section("preprocess", body)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())

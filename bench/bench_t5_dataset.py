"""T5 dataset: index build time, warm-cache start-up and samples/s on ~200 MB of tokens.

    python bench/bench_t5_dataset.py [--token-mb 200] [--samples 1000000]

Tokens: tests/data/corpora (English and Chinese) preprocessed once with a 16k SentencePiece model
and `--append-eod`, then merged with itself until the .bin holds ~200 MB. The dataset is asked for
`--samples` span-corruption samples of 512 encoder tokens (568 raw tokens each).
Results go to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, WORK, corpora_dir, machine_line, run_measured, tokenizer_model, \
    write_section

OPEN = """
import sys, time
t0 = time.perf_counter()
from megatron.data.storage.indexed_dataset import IndexedDataset
from megatron.data.datasets.t5_dataset import T5DatasetConfig, T5SpanCorruptionDataset, T5SpecialTokens
from megatron.data.tokenizers.tokenizer import T5Tokenizer
t1 = time.perf_counter()
prefix, model, samples, cache = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
tokens = T5SpecialTokens.from_tokenizer(T5Tokenizer(model))
ds = IndexedDataset(prefix)
d = T5SpanCorruptionDataset("train", ds, (0, ds.num_documents), samples,
                            T5DatasetConfig(encoder_seq_length=512, seed=1), tokens, cache)
d[0]
t2 = time.perf_counter()
print(t1 - t0, t2 - t1)
"""


def token_dataset(model: Path, target_mb: float) -> str:
    base = WORK / "t5_base"
    if not Path(f"{base}_text_document.idx").exists():
        run_measured([sys.executable, str(REPO / "data_tools" / "preprocess_data.py"), "--input",
                      *[str(p) for p in sorted(corpora_dir().glob("*.jsonl"))],
                      "--output-prefix", str(base), "--tokenizer-model", str(model),
                      "--append-eod", "--workers", "2", "--no-progress"])
    one = Path(f"{base}_text_document.bin").stat().st_size
    copies = max(1, int(round(target_mb * 1e6 / one)))
    prefix = WORK / f"t5_tokens_{copies}x"
    if not Path(f"{prefix}.idx").exists():
        run_measured([sys.executable, str(REPO / "data_tools" / "merge_datasets.py"), "--input",
                      *[f"{base}_text_document"] * copies, "--output-prefix", str(prefix)])
    return str(prefix)


def open_in_fresh_process(prefix: str, model: Path, samples: int, cache: Path):
    out = subprocess.run([sys.executable, "-c", OPEN, prefix, str(model), str(samples),
                          str(cache)], capture_output=True, text=True, check=True, cwd=REPO)
    imports, ready = (float(x) for x in out.stdout.split())
    return imports, ready


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--token-mb", type=float, default=200)
    p.add_argument("--samples", type=int, default=1_000_000)
    p.add_argument("--reads", type=int, default=5000)
    args = p.parse_args()
    model = tokenizer_model(16000)
    prefix = token_dataset(model, args.token_mb)
    cache = WORK / "t5_cache"
    shutil.rmtree(cache, ignore_errors=True)
    _, cold = open_in_fresh_process(prefix, model, args.samples, cache)
    imports, warm = open_in_fresh_process(prefix, model, args.samples, cache)

    from megatron.data.storage.indexed_dataset import IndexedDataset
    from megatron.data.datasets.t5_dataset import T5DatasetConfig, T5SpanCorruptionDataset, T5SpecialTokens
    from megatron.data.tokenizers.tokenizer import T5Tokenizer

    ds = IndexedDataset(prefix)
    d = T5SpanCorruptionDataset("train", ds, (0, ds.num_documents), args.samples,
                                T5DatasetConfig(encoder_seq_length=512, seed=1),
                                T5SpecialTokens.from_tokenizer(T5Tokenizer(str(model))),
                                str(cache))
    idx = np.random.default_rng(0).integers(0, len(d), size=args.reads)
    start = time.perf_counter()
    for i in idx:
        d[int(i)]
    per_second = args.reads / (time.perf_counter() - start)
    bin_mb = Path(f"{prefix}.bin").stat().st_size / 1e6
    body = f"""## T5 span-corruption dataset

Command: `python bench/bench_t5_dataset.py --token-mb {args.token_mb:g} --samples {args.samples}`
Machine: {machine_line()}. Tokens: {bin_mb:.0f} MB .bin ({ds.num_tokens / 1e6:.0f} M tokens,
{ds.num_documents} documents: tests/data/corpora preprocessed and merged with itself);
{args.samples} samples of 512 encoder / {d.decoder_length} decoder tokens ({d.raw_length} raw).

| measure | value |
| --- | ---: |
| index build, cold cache (fresh process, after imports) | {cold:.2f} s |
| start-up with a warm cache (fresh process, after imports) | {warm:.3f} s |
| imports (numpy, sentencepiece, our modules) | {imports:.2f} s |
| random samples/s, one process | {per_second:,.0f} |

megatron-core's T5 dataset is not run beside it yet: it is a different objective (BERT-style
n-gram masking over `_text_sentence` data) and wants a tokenizer with WordPiece-style special
tokens (`cls`, `sep`, `mask`); a comparison needs a shim tokenizer and sentence-level data.
"""
    write_section("t5_dataset", body)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())

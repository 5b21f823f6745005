"""Random-access reads of our reader against megatron-core's IndexedDataset, and reader memory.

    python bench/bench_reader.py [--sequences 1000000] [--reads 200000]

Both readers open the same files (written by us) in this process; each does the same random
`ds[i]` and `ds.get(i, offset, length)` reads, best of 3 rounds. Memory: a fresh process opens the
dataset and reads 20,000 random sequences; we report its private (anonymous) RSS, which is what a
reader owns, beside the size of the index and of the data. File-backed pages of the mmap are
shared page cache, reclaimable and the same for every reader. Results go to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import WORK, machine_line, write_section
from megatron.data.storage.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

MEMORY_PROBE = """
import sys, numpy as np
def anon_kib():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
kind, prefix = sys.argv[1], sys.argv[2]
before = anon_kib()
if kind == "ours":
    from megatron.data.storage.indexed_dataset import IndexedDataset
    before = anon_kib()
    ds = IndexedDataset(prefix)
else:
    import warnings; warnings.simplefilter("ignore")
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    before = anon_kib()
    ds = IndexedDataset(prefix)
rng = np.random.default_rng(0)
total = 0
for i in rng.integers(0, len(ds), size=20000):
    total += int(ds[int(i)][-1])
print(anon_kib() - before)
"""


def build(prefix: Path, sequences: int) -> None:
    if Path(f"{prefix}.idx").exists():
        return
    prefix.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(f"{prefix}.bin", np.uint16) as b:
        done = 0
        while done < sequences:
            n = min(100000, sequences - done)
            lengths = rng.integers(1, 512, size=n)
            tokens = rng.integers(0, 32000, size=int(lengths.sum()), dtype=np.uint16)
            b.add_documents(tokens, lengths, np.ones(n, dtype=np.int64))
            done += n
        b.finalize(f"{prefix}.idx")


def reads_per_second(fn, indices) -> float:
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for i in indices:
            fn(i)
        best = min(best, time.perf_counter() - start)
    return len(indices) / best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sequences", type=int, default=1_000_000)
    p.add_argument("--reads", type=int, default=200_000)
    args = p.parse_args()
    prefix = WORK / f"reader_{args.sequences}"
    build(prefix, args.sequences)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset as McoreDataset

    ours, theirs = IndexedDataset(str(prefix)), McoreDataset(str(prefix))
    rng = np.random.default_rng(1)
    idx = [int(i) for i in rng.integers(0, len(ours), size=args.reads)]
    lengths = ours.sequence_lengths
    spans = [(i, int(lengths[i]) // 4, int(lengths[i]) // 2) for i in idx]
    for i in idx[:1000]:  # same answers before we time anything
        assert np.array_equal(ours[i], theirs[i])
    r_ours = reads_per_second(lambda i: ours[i], idx)
    r_theirs = reads_per_second(lambda i: theirs[i], idx)
    g_ours = reads_per_second(lambda s: ours.get(*s), spans)
    g_theirs = reads_per_second(lambda s: theirs.get(*s), spans)

    mem = {}
    for kind in ("ours", "megatron-core"):
        out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, kind, str(prefix)],
                             capture_output=True, text=True, check=True)
        mem[kind] = int(out.stdout.strip().splitlines()[-1])
    idx_mb = Path(f"{prefix}.idx").stat().st_size / 2**20
    bin_mb = Path(f"{prefix}.bin").stat().st_size / 2**20

    body = f"""## Indexed dataset reader

Command: `python bench/bench_reader.py --sequences {args.sequences} --reads {args.reads}`
Machine: {machine_line()}. Dataset: {args.sequences} uint16 sequences of 1-511 tokens,
.idx {idx_mb:.1f} MiB, .bin {bin_mb:.0f} MiB; {args.reads} uniformly random reads, best of 3.

| operation | ours (reads/s) | megatron-core (reads/s) | ratio |
| --- | ---: | ---: | ---: |
| `ds[i]` | {r_ours:,.0f} | {r_theirs:,.0f} | {r_ours / r_theirs:.2f}x |
| `ds.get(i, offset, length)` | {g_ours:,.0f} | {g_theirs:,.0f} | {g_ours / g_theirs:.2f}x |

Private memory (RssAnon) a reader process adds by opening the dataset and reading 20,000 random
sequences: ours {mem['ours'] / 1024:.1f} MiB, megatron-core {mem['megatron-core'] / 1024:.1f} MiB
(index file {idx_mb:.1f} MiB, data {bin_mb:.0f} MiB): O(index), not O(data).
"""
    write_section("reader", body)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Opening a shard set as one --data-path: how long for 10, 100 and 1,000 shards?

    python bench/bench_shard_set.py [--shards 10 100 1000] [--documents 100] [--trials 3] [--s3]

Each set is written once under bench's work folder: N shards of `--documents` documents each
(50..500 uint16 tokens, one sequence per document), named as preprocess_data.py --num-shards
names them, and its manifest (megatron/data/preprocess/manifest.py); beside it the same
documents merged into one file. Timed, median of the trials, in this process with the files in
the page cache:
- `ShardSet(prefix)`: the manifest read, every shard's files looked up and its index opened and
  checked (megatron/data/storage/shard_set.py), the concatenated index made;
- `IndexedDataset` of the merged file, for the ratio;
- `build_datasets` of the set (span corruption, train/valid/test), first with an empty cache
  folder (the set's index caches built: once for the whole set) and then again (found).
With --s3, also the set on a local S3 server (tests/objectstore/s3_server.py, `rclone serve
s3`): `ShardSet(s3://...)` with an empty node-local folder (the manifest and every shard's `.idx`
fetched, by a pool of --object-storage-max-connections threads) and again (the copies found:
one HEAD per object).
Results go to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "objectstore"))

from bench.common import WORK, machine_line, markdown_table, write_section
from megatron.data.datasets.builder import DataConfig, build_datasets
from megatron.data.datasets.t5_dataset import T5DatasetConfig, T5SpecialTokens
from megatron.data.preprocess.manifest import write_manifest
from megatron.data.storage.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, \
    merge_datasets
from megatron.data.storage.object_storage import ObjectStorage, StorageSettings
from megatron.data.storage.shard_set import ShardSet

NOTE_S3 = ("On S3 each shard costs a HEAD of its `.idx` and of its `.bin` (and, cold, a GET of "
           "the `.idx`), sent through boto3 by 64 threads: about 1.8 ms of wall time per request "
           "at 1,000 shards warm, which on these 2 shared cores points at the client's CPU rather "
           "than the server (not measured apart). Locally a shard costs 0.04 to 0.2 ms (a stat, "
           "two mmaps and the C++ check of its index).")

TOKENS = T5SpecialTokens(0, 1, 0, tuple(range(32099, 31999, -1)))


def make_set(folder: Path, shards: int, documents: int) -> tuple:
    """(the set's prefix, the merged file's prefix), written once."""
    base, suffix = str(folder / "set"), "_text_document"
    prefix, merged = base + suffix, str(folder / "merged_text_document")
    if Path(prefix + ".shards.json").exists() and Path(merged + ".idx").exists():
        return prefix, merged
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    rng = np.random.default_rng(shards)
    members = []
    for i in range(shards):
        member = f"{base}-{i:05d}-of-{shards:05d}{suffix}"
        with IndexedDatasetBuilder(member + ".bin", dtype=np.uint16) as b:
            for _ in range(documents):
                doc = rng.integers(5, 32000, size=int(rng.integers(50, 500)))
                doc[-1] = 1  # EOD appended
                b.add_document(doc, [len(doc)])
            b.finalize(member + ".idx")
        members.append(member)
    write_manifest(base, suffix, shards)
    merge_datasets(members, merged)
    return prefix, merged


def timed(fn, trials: int) -> float:
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(shards: int, documents: int, trials: int) -> list:
    folder = WORK / "shard_set" / f"{shards}x{documents}"
    prefix, merged = make_set(folder, shards, documents)
    open_set = timed(lambda: ShardSet(prefix), trials)
    open_merged = timed(lambda: IndexedDataset(merged, "infer"), trials)
    cache = folder / "cache"
    config = DataConfig([prefix], split="98,2,0", data_cache_path=str(cache),
                        t5=T5DatasetConfig(encoder_seq_length=512, seed=1))

    def build():
        build_datasets(config, TOKENS, (10_000, 200, 0))

    first = []
    for _ in range(trials):
        shutil.rmtree(cache, ignore_errors=True)
        first.append(timed(build, 1))
    again = timed(build, trials)
    return [f"{shards:,}", f"{shards * documents:,}", f"{open_set * 1e3:,.1f}",
            f"{open_merged * 1e3:,.2f}", f"{open_set / shards * 1e3:.2f}",
            f"{statistics.median(first) * 1e3:,.0f}", f"{again * 1e3:,.0f}"]


def measure_s3(server, shards: int, documents: int, trials: int) -> list:
    """[shards, cold open ms, warm open ms, objects fetched] of the set served from S3."""
    import os

    folder = WORK / "shard_set" / f"{shards}x{documents}"
    prefix, _ = make_set(folder, shards, documents)
    bucket = f"set{shards}"
    target = server.root / bucket  # a folder under rclone's root is a bucket: copied, not PUT
    server.make_bucket(bucket)  # through the API, so that rclone's folder cache knows it
    for path in folder.iterdir():
        if path.is_file() and path.name.startswith("set"):
            shutil.copy(path, target / path.name)
    url = f"s3://{bucket}/{Path(prefix).name}"
    node = WORK / "shard_set" / "node"
    cold, fetched = [], 0
    for _ in range(trials):
        shutil.rmtree(node, ignore_errors=True)
        storage = ObjectStorage(StorageSettings(cache_path=str(node)))
        cold.append(timed(lambda: ShardSet(url, storage=storage), 1))
        fetched = len(storage.downloads)
    storage = ObjectStorage(StorageSettings(cache_path=str(node)))
    warm = timed(lambda: ShardSet(url, storage=storage), trials)
    workers = os.environ.get("AWS_ENDPOINT_URL") and storage.settings.max_connections
    return [f"{shards:,}", f"{statistics.median(cold) * 1e3:,.0f}", f"{warm * 1e3:,.0f}",
            f"{fetched:,}", f"{workers}"]


def s3_rows(shards, documents: int, trials: int) -> list:
    import os

    from s3_server import S3Server

    server = S3Server(extra_args=("--etag-hash", "", "--dir-cache-time", "1h"))
    saved = dict(os.environ)
    try:
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_REGION"):
            os.environ.pop(name, None)
        os.environ.update(server.env())
        rows = []
        for n in shards:
            rows.append(measure_s3(server, n, documents, trials))
            print("s3 " + " | ".join(rows[-1]), flush=True)
        return rows
    finally:
        os.environ.clear()
        os.environ.update(saved)
        server.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", type=int, nargs="+", default=[10, 100, 1000])
    p.add_argument("--documents", type=int, default=100, help="documents per shard")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--s3", action="store_true", help="also open the sets from a local S3 server")
    args = p.parse_args()
    rows = []
    for n in args.shards:
        rows.append(measure(n, args.documents, args.trials))
        print(" | ".join(rows[-1]), flush=True)
    command = "python bench/bench_shard_set.py " + " ".join(sys.argv[1:])
    body = "\n".join([
        "## Opening a shard set (`--data-path` naming the shards of `--num-shards` as one)", "",
        f"Command: `{command.strip()}`",
        f"Machine: {machine_line()}, shared with other sessions; local files, in the page "
        f"cache. Shards of {args.documents} documents (50..500 uint16 tokens each); medians of "
        f"{args.trials} trials. `build_datasets`: span corruption, 512 encoder tokens, 10,000 "
        "train and 200 valid samples, `--data-append-eod auto` (each shard's EOD decided from "
        "a sample of its document ends), the set's index caches built (first) or found "
        "(again).",
        "",
        *markdown_table(["shards", "documents", "open set ms", "open merged file ms",
                         "ms per shard", "build_datasets first ms", "again ms"], rows), ""])
    if args.s3:
        body += "\n".join([
            "", "The same sets on a local S3 server (`rclone serve s3` on this machine, ~5 ms a "
            "request): `ShardSet(s3://...)` with an empty node-local folder (cold: the manifest "
            "and every `.idx` fetched) and with the copies in place (warm: HEADs only), the "
            "shards handled by a pool of `--object-storage-max-connections` threads.", "",
            *markdown_table(["shards", "cold open ms", "warm open ms", "objects fetched",
                             "threads"], s3_rows(args.shards, args.documents, args.trials)),
            "", NOTE_S3, ""])
    write_section("shard_set", body)


if __name__ == "__main__":
    main()

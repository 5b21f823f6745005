"""Peak memory and wall time of merge_datasets.py's streaming merge against the merge it replaced.

    python bench/bench_merge.py [--shards 1000] [--documents 10000000] [--write]

Writes --shards synthetic `.bin/.idx` shards with the project's writer (IndexedDatasetBuilder,
uint16, one sequence of 1-3 tokens per document, --documents in all: the index is most of the
bytes, which is what the old merge's memory grew with), then merges them in a fresh subprocess per
run, each reporting its own peak RSS and wall time:

- old: indexed_dataset.merge_datasets (an IndexedDatasetBuilder fed by add_index: every length and
  document index of the output held in Python arrays), as data_tools/merge_datasets.py ran it;
- new: megatron/data/storage/merge.py (open_inputs + merge_streaming), as it runs it now;

at 1/100 of the size (shards and documents), at all the documents in one input, and at the full
size, to show what the peak grows with. With --s3, the full-size shards are also uploaded to a
local S3 server (`rclone serve s3`, tests/objectstore/s3_server.py) and merged from s3:// to
s3:// by data_tools/merge_datasets.py (new only: the old merge read local files only).
The outputs of both are compared byte for byte. Disk: about 60 bytes per document.

The peak is the process's VmHWM (/proc/self/status), not getrusage's ru_maxrss: Linux carries
ru_maxrss over fork and exec, so a child's starts at its parent's resident size (this bench's,
which grows as it makes the shards) and hides a smaller peak of the child's own; VmHWM belongs to
the address space that exec made. Both are printed to stderr.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import WORK, machine_line, write_section  # noqa: E402


def make_shards(folder: Path, shards: int, documents: int) -> list:
    """`shards` prefixes under `folder` holding `documents` documents in all (made once)."""
    from megatron.data.storage.indexed_dataset import IndexedDatasetBuilder

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    prefixes = []
    for k in range(shards):
        prefix = str(folder / f"shard-{k:05d}-of-{shards:05d}_text_document")
        prefixes.append(prefix)
        n = documents // shards + (1 if k < documents % shards else 0)
        if os.path.exists(prefix + ".idx"):
            continue
        lengths = rng.integers(1, 4, size=n)
        tokens = rng.integers(0, 32000, size=int(lengths.sum())).astype(np.uint16)
        with IndexedDatasetBuilder(prefix + ".bin", np.uint16) as b:
            b.add_documents(tokens, lengths, np.ones(n, dtype=np.int64))
            b.finalize(prefix + ".idx")
    return prefixes


def vm_hwm_kib() -> int:
    """Peak resident set of this process's address space (since its exec), KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def run_one(which: str, inputs_file: str, output: str) -> None:
    """In the measuring subprocess: one merge, then a JSON line of its wall time and peak RSS."""
    prefixes = Path(inputs_file).read_text().split("\n")
    base = vm_hwm_kib()
    start = time.perf_counter()
    if which == "s3":
        from data_tools import merge_datasets

        assert merge_datasets.main(["--input", *prefixes, "--output-prefix", output,
                                    "--staging-dir", os.environ["BENCH_STAGING"]]) == 0
    elif which == "old":
        from megatron.data.storage.indexed_dataset import merge_datasets

        merge_datasets(prefixes, output)
    else:
        from megatron.data.storage.merge import merge_streaming, open_inputs

        inputs = open_inputs(prefixes)
        merge_streaming(inputs, output)
        for item in inputs:
            item.close()
    wall = time.perf_counter() - start
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    print(json.dumps({"wall_s": wall, "peak_kib": vm_hwm_kib(), "start_kib": base,
                      "ru_maxrss_kib": maxrss}))


def measure(which: str, prefixes: list, output) -> dict:
    inputs_file = WORK / f"merge-{which}.inputs"
    inputs_file.parent.mkdir(parents=True, exist_ok=True)
    inputs_file.write_text("\n".join(prefixes))
    # the imports happen before the first figure so that both runs start alike
    code = ("import sys, numpy, megatron.data.storage.indexed_dataset, "
            "megatron.data.storage.merge; sys.path.insert(0, sys.argv[4]); "
            "from bench.bench_merge import run_one; run_one(*sys.argv[1:4])")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        out = subprocess.run([sys.executable, "-c", code, which, str(inputs_file), str(output),
                              str(REPO)], check=True, capture_output=True, text=True, env=env)
    finally:
        inputs_file.unlink(missing_ok=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_s3(prefixes: list, work: Path) -> dict:
    """The shards uploaded to a local S3 server, then merged from s3:// to s3://."""
    sys.path.insert(0, str(REPO / "tests" / "objectstore"))
    from s3_server import S3Server

    from megatron.data.storage.object_storage import ObjectStorage

    with S3Server() as server:
        server.make_bucket("bench-merge")
        saved = dict(os.environ)
        os.environ.update(server.env())
        os.environ["BENCH_STAGING"] = str(work / "staging")
        try:
            storage = ObjectStorage()
            t = time.perf_counter()
            remote = []
            for prefix in prefixes:
                remote.append(f"s3://bench-merge/in/{Path(prefix).name}")
                for suffix in (".bin", ".idx"):
                    storage.upload(prefix + suffix, remote[-1] + suffix)
            print(f"uploaded {len(prefixes)} shards in {time.perf_counter() - t:.0f} s",
                  file=sys.stderr)
            got = measure("s3", remote, "s3://bench-merge/out/merged")
        finally:
            os.environ.clear()
            os.environ.update(saved)
        got["digest"] = digest(Path(server.root) / "bench-merge" / "out" / "merged")
    print(f"s3: {got}", file=sys.stderr)
    return got


def digest(prefix: Path) -> str:
    h = hashlib.sha256()
    for suffix in (".bin", ".idx"):
        with open(f"{prefix}{suffix}", "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", type=int, default=1000)
    p.add_argument("--documents", type=int, default=10_000_000)
    p.add_argument("--work", default=str(WORK / "merge"))
    p.add_argument("--write", action="store_true", help="record the figures in bench/RESULTS.md")
    p.add_argument("--keep", action="store_true", help="keep the shards for another run")
    p.add_argument("--s3", action="store_true", help="also merge the full size from and to s3://")
    args = p.parse_args()
    work = Path(args.work)
    rows = []
    sizes = [(max(1, args.shards // 100), args.documents // 100), (1, args.documents),
             (args.shards, args.documents)]
    for shards, documents in sizes:
        t = time.perf_counter()
        prefixes = make_shards(work / f"in-{shards}-{documents}", shards, documents)
        made = time.perf_counter() - t
        idx_mb = sum(os.path.getsize(p + ".idx") for p in prefixes) / 2 ** 20
        bin_mb = sum(os.path.getsize(p + ".bin") for p in prefixes) / 2 ** 20
        got = {}
        for which in ("old", "new"):
            got[which] = measure(which, prefixes, work / f"out-{which}")
            got[which]["digest"] = digest(work / f"out-{which}")
            print(f"{shards} shards, {documents} documents ({idx_mb:.0f} MiB .idx, {bin_mb:.0f} "
                  f"MiB .bin, made in {made:.0f} s): {which} {got[which]}", file=sys.stderr)
        same = got["old"]["digest"] == got["new"]["digest"]
        if not same:
            sys.exit("the outputs differ: the streaming merge is not byte-identical")
        if args.s3 and (shards, documents) == sizes[-1]:
            got["s3"] = measure_s3(prefixes, work)
            if got["s3"]["digest"] != got["new"]["digest"]:
                sys.exit("the s3:// merge differs from the local one")
        rows.append((shards, documents, idx_mb, bin_mb, got))
        for which in ("old", "new"):
            for suffix in (".bin", ".idx"):
                (work / f"out-{which}{suffix}").unlink(missing_ok=True)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    lines = [
        "## merge_datasets.py: peak memory of the streaming merge against the old one",
        "",
        f"Command: `python bench/bench_merge.py --shards {args.shards} --documents "
        f"{args.documents}{' --s3' if args.s3 else ''} --write`",
        f"Machine: {machine_line()}. Synthetic shards written by IndexedDatasetBuilder (uint16, "
        "one sequence of 1-3 tokens per document); one fresh subprocess per merge, its peak RSS "
        "(VmHWM: getrusage's ru_maxrss starts at the parent's size, see the bench's docstring; "
        "'start': the interpreter with numpy and the modules imported), outputs compared byte "
        "for byte (identical in every row).",
        "",
        "| shards | documents | inputs .idx / .bin (MiB) | merge | start RSS (MiB) "
        "| peak RSS (MiB) | wall (s) |",
        "| ---: | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for shards, documents, idx_mb, bin_mb, got in rows:
        for which, name in (("old", "old (builder.add_index)"), ("new", "new (streaming)"),
                            ("s3", "new, s3:// to s3:// (CLI)")):
            if which not in got:
                continue
            g = got[which]
            lines.append(f"| {shards:,} | {documents:,} | {idx_mb:.0f} / {bin_mb:.0f} | {name} | "
                         f"{g['start_kib'] / 1024:.0f} | {g['peak_kib'] / 1024:.0f} | "
                         f"{g['wall_s']:.1f} |")
    big, small = rows[-1][4], rows[0][4]
    lines += ["", f"From {rows[0][0]:,} shards of {rows[0][1]:,} documents to {rows[-1][0]:,} of "
              f"{rows[-1][1]:,}, the old merge's peak grows by "
              f"{(big['old']['peak_kib'] - small['old']['peak_kib']) / 1024:.0f} MiB, the "
              f"streaming merge's by "
              f"{(big['new']['peak_kib'] - small['new']['peak_kib']) / 1024:.0f} MiB. With all "
              f"the documents in one input the streaming merge's peak is "
              f"{rows[1][4]['new']['peak_kib'] / 1024:.0f} MiB: the arrays of one chunk of "
              f"merge.CHUNK_ITEMS index entries, whatever the input's size; the old merge's "
              f"{rows[1][4]['old']['peak_kib'] / 1024:.0f} MiB."]
    if "s3" in rows[-1][4]:
        lines.append("The s3:// row is the whole CLI: its peak includes boto3 and the storage's "
                     "thread pool; its time is mostly requests to a local `rclone serve s3` on "
                     "the same 2 cores: about 5 per shard to open the inputs (concurrently), 2 "
                     "to fetch each shard whole (the next while one merges: "
                     "merge.PRELOAD_BYTES; 119 s before that, at 9 requests per shard one after "
                     "another), then the upload.")
    body = "\n".join(lines)
    print(body)
    if args.write:
        write_section("merge", body)


if __name__ == "__main__":
    main()

"""One preprocessing run (data_tools/preprocess_data.py is its command line): the inputs and the
tokenizer checked, the outputs' temporaries, the pool, the ordered stream of this run's chunks
(all the input, or one shard's pieces), the datasets and their sidecars moved into place, the bad
lines' report and the summary. Returns the tool's exit status; prints its messages to stderr.

`settings` is the tool's argparse namespace (any object with its flag attributes, `tokenizer`
resolved, and `shard`: a sharding.ShardChoice or None).
"""

from __future__ import annotations

import collections
import os
import signal
import sys
import time
from typing import List

import numpy as np

from megatron.data.preprocess.jsonl import BadLine, expand_inputs, read_chunks
from megatron.data.preprocess.pipeline import (
    Progress,
    discard,
    keep_report,
    remove_stale_temporaries,
    stream_chunks,
)
from megatron.data.preprocess.sentence_splitter import make_splitter
from megatron.data.preprocess.sharding import progress_starts, read_piece_chunks, shard_plan
from megatron.data.preprocess.workers import Interrupted, on_sigterm, sigterm_held, start_pool
from megatron.data.storage.data_meta import DatasetMeta, meta_file_path, tokenizer_identity
from megatron.data.storage.indexed_dataset import (
    IndexedDatasetBuilder,
    data_file_path,
    index_file_path,
    optimal_dtype,
)
from megatron.data.tokenizers.tokenizer import build_tokenizer


def run(args) -> int:
    """Preprocess; returns the exit code."""
    try:
        paths, tokenizer = _inputs(args)
    except _Refused as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    level = "sentence" if args.split_sentences else "document"
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    prefixes = [f"{args.output_prefix}_{key}_{level}" for key in args.json_keys]
    report_path = f"{args.output_prefix}_bad_lines.tsv"
    finals = [f(p) for f in (data_file_path, index_file_path, meta_file_path) for p in prefixes]
    remove_stale_temporaries(finals + [report_path])
    if args.partitions > 1:
        print(f"note: --partitions {args.partitions} is not needed (input is streamed); "
              "output is identical; to split the work over tasks use --num-shards/--shard-index",
              file=sys.stderr)

    chunk_bytes = int(args.chunk_mb * (1 << 20))
    shard = getattr(args, "shard", None)
    if shard is None:
        # Where each file starts in the concatenated input, for the progress bar.
        file_starts = np.concatenate([[0], np.cumsum([os.path.getsize(p) for p in paths])])
        total_bytes = int(file_starts[-1])
        chunks = read_chunks(paths, chunk_bytes=chunk_bytes)
    else:
        pieces = shard_plan(paths, shard.count)[shard.index]
        file_starts = progress_starts(pieces, len(paths))
        total_bytes = sum(p.nbytes for p in pieces)
        chunks = read_piece_chunks(pieces, chunk_bytes=chunk_bytes)
        print(f"{shard.describe()}: {total_bytes} bytes of input in {len(pieces)} pieces",
              file=sys.stderr)
    progress = Progress(total_bytes, args.log_interval, enabled=not args.no_progress)
    stats = collections.Counter()
    start = time.time()
    report_tmp = f"{report_path}.tmp-{os.getpid()}"
    builders: List[IndexedDatasetBuilder] = []
    report = None
    pool = stop = None
    # The handler is in place before the first file exists, so that no signal can leave one.
    old_term = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        report = open(report_tmp, "w", encoding="utf-8")
        report.write("file\tline\treason\n")
        dtype = optimal_dtype(tokenizer.vocab_size)
        for prefix in prefixes:
            builders.append(IndexedDatasetBuilder(data_file_path(prefix), dtype=dtype))
        with sigterm_held():
            pool, stop = start_pool(args, tokenizer)
        stream_chunks(args, paths, chunks, pool, builders, report, stats, progress, file_starts)
        pool.close()
        pool.join()
        pool = None
        if stats["documents"] == 0 and not (shard is not None and total_bytes == 0):
            # (a shard given no input, fewer compressed files than shards, writes an empty
            # dataset so that the set is complete)
            raise BadLine("no usable document in the input")
        meta = DatasetMeta(
            tokenizer={"type": args.tokenizer.tokenizer_type,
                       "model": os.path.basename(args.tokenizer.path),
                       "vocab_size": int(tokenizer.vocab_size),
                       **tokenizer_identity(tokenizer)},
            eod_id=int(tokenizer.eod), eod_appended=bool(args.append_eod), dtype=str(dtype),
            documents=0, sequences=0, tokens=0)  # the builder sets dtype and counts
        for builder, prefix in zip(builders, prefixes):
            builder.finalize(index_file_path(prefix), meta)
        report.close()
        keep_report(stats["bad"] > 0, report_tmp, report_path)
    except (BadLine, OSError, ValueError, Interrupted, KeyboardInterrupt) as e:
        progress.close()
        discard(pool, stop, builders, report, report_tmp)
        interrupted = isinstance(e, (Interrupted, KeyboardInterrupt))
        what = "interrupted" if interrupted else f"error: {e}"
        print(f"{what}; no output was written", file=sys.stderr)
        return 130 if interrupted else 1
    except BaseException:
        progress.close()
        discard(pool, stop, builders, report, report_tmp)
        print("no output was written", file=sys.stderr)
        raise
    finally:
        signal.signal(signal.SIGTERM, old_term)
    progress.close()
    _summary(args, stats, progress, time.time() - start, len(paths), report_path, prefixes)
    return 0


class _Refused(Exception):
    """A flag or input that cannot run (exit 2); str() names it."""


def _inputs(args):
    """(the input files, the tokenizer), each checked before any worker starts.

    Raises:
        _Refused: an input that matches nothing, a tokenizer or punkt file that cannot load."""
    try:
        paths = expand_inputs(args.input)
    except FileNotFoundError as e:
        raise _Refused(str(e)) from None
    flag = "--vocab-file" if args.vocab_file is not None else "--tokenizer-model"
    try:
        tokenizer = build_tokenizer(args.tokenizer, extra_ids=args.vocab_extra_ids)
    except (ValueError, ImportError) as e:
        raise _Refused(f"{flag}: {e}") from None
    warm_up = getattr(tokenizer, "warm_up", None)  # CPM-2's: jieba, once, before the fork
    if warm_up is not None:
        warm_up()
    if args.split_sentences:
        try:
            make_splitter(args.punkt_params)  # fail here, not in every worker
        except ValueError as e:
            raise _Refused(f"--punkt-params: {e}") from None
    return paths, tokenizer


def _summary(args, stats, progress, elapsed: float, files: int, report_path: str,
             prefixes) -> None:
    mb = stats["bytes"] / 1e6
    sentences = f"{stats['sequences']} sentences, " if args.split_sentences else ""
    print(f"done in {elapsed:.1f} s: {stats['documents']} documents, {sentences}"
          f"{stats['tokens']} tokens from {stats['lines']} lines ({mb:.1f} MB, "
          f"{mb / max(elapsed, 1e-9):.2f} MB/s)", file=sys.stderr)
    steady = progress.steady_rate()
    if steady is not None:
        print(f"steady state: {steady:.2f} MB/s", file=sys.stderr)
    if stats["bom"]:
        print(f"removed the UTF-8 byte order mark (BOM) that began {stats['bom']} of "
              f"{files} input files", file=sys.stderr)
    if stats["bad"]:
        print(f"skipped {stats['bad']} bad lines, listed in {report_path}", file=sys.stderr)
    for prefix in prefixes:
        print(f"wrote {prefix}.bin/.idx", file=sys.stderr)

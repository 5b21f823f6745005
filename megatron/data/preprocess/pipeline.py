"""The main-process side of preprocessing: hand chunks to the workers, append their results in
input order, progress, and the temporary files a failed run removes (data_tools/preprocess_data.py
is the command line over it)."""

from __future__ import annotations

import collections
import os
import sys
import time
from typing import Optional, Sequence, Tuple

from megatron.data.preprocess.jsonl import BadLine
from megatron.data.preprocess.workers import ChunkResult, process_chunk, stop_pool
from megatron.data.storage.indexed_dataset import IndexedDatasetBuilder


class Progress:
    """A tqdm bar on a terminal, plain lines every --log-interval documents otherwise."""

    def __init__(self, total_bytes: int, log_interval: int, enabled: bool) -> None:
        self.start = time.time()
        self.first: Optional[Tuple[float, int]] = None
        self.last = self.start
        self.docs = 0
        self.bytes = 0
        self.log_interval = log_interval
        self._next_log = log_interval
        self._bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024,
                             desc="preprocess", dynamic_ncols=True)
        self._quiet = not enabled

    def update(self, nbytes: int, docs: int, disk_offset: int) -> None:
        if self.first is None:  # the pipeline is full from here on: steady state starts
            self.first = (time.time(), nbytes)
        self.last = time.time()
        self.docs += docs
        self.bytes += nbytes
        if self._bar is not None:
            self._bar.update(disk_offset - self._bar.n)
            rate = self.docs / max(time.time() - self.start, 1e-9)
            self._bar.set_postfix_str(f"{self.docs} docs, {rate:.0f} docs/s", refresh=False)
        elif not self._quiet and self.docs >= self._next_log:
            elapsed = max(time.time() - self.start, 1e-9)
            print(f"processed {self.docs} documents ({self.docs / elapsed:.0f} docs/s, "
                  f"{self.bytes / elapsed / 1e6:.2f} MB/s)", file=sys.stderr, flush=True)
            self._next_log = (self.docs // self.log_interval + 1) * self.log_interval

    def steady_rate(self) -> Optional[float]:
        """MB/s from the first finished chunk to the last (start-up excluded)."""
        if self.first is None or self.last <= self.first[0] or self.bytes <= self.first[1]:
            return None  # a single chunk: no steady state to speak of
        return (self.bytes - self.first[1]) / 1e6 / (self.last - self.first[0])

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def remove_stale_temporaries(final_paths: Sequence[str]) -> None:
    """Remove `PATH.tmp-PID` files left by runs that were killed (their PID is gone)."""
    for path in final_paths:
        directory = os.path.dirname(path) or "."
        base = os.path.basename(path) + ".tmp-"
        for name in os.listdir(directory):
            if not name.startswith(base) or not name[len(base):].isdigit():
                continue
            pid = int(name[len(base):])
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os.unlink(os.path.join(directory, name))
            except PermissionError:
                pass


def discard(pool, stop, builders: Sequence[IndexedDatasetBuilder], report,
             report_tmp: str) -> None:
    """Remove every temporary output of this run, then stop the workers (they write no file)."""
    for builder in builders:
        builder.abort()
    if report is not None:
        report.close()
    if os.path.exists(report_tmp):
        os.unlink(report_tmp)
    if pool is not None:
        stop_pool(pool, stop)


def stream_chunks(args, paths, chunks, pool, builders, report, stats, progress,
            file_starts) -> None:
    """Feed the chunks to the workers (at most 2 x workers + 2 in flight: bounded memory) and
    append their results in input order."""
    pending: collections.deque = collections.deque()
    max_pending = 2 * args.workers + 2
    exhausted = False
    while True:
        while not exhausted and len(pending) < max_pending:
            chunk = next(chunks, None)
            if chunk is None:
                exhausted = True
                break
            lines = (chunk.first_line, chunk.first_line + len(chunk.lines) - 1)
            stats["bom"] += chunk.bom
            pending.append((chunk.file_index, lines, chunk.nbytes, chunk.end_offset,
                            pool.apply_async(process_chunk, (chunk,))))
        if not pending:
            return
        file_index, lines, nbytes, end_offset, async_result = pending.popleft()
        try:
            res: ChunkResult = async_result.get()
        except Exception:  # a bug, not bad input: say where, then show its traceback
            print(f"error: a worker failed on {paths[file_index]} lines {lines[0]}-{lines[1]}",
                  file=sys.stderr)
            raise
        for line_no, reason in res.bad:
            if args.strict:
                raise BadLine(f"{paths[file_index]}:{line_no}: {reason} (--strict)")
            report.write(f"{paths[file_index]}\t{line_no}\t{reason}\n")
        for builder, tokens, lengths, per_doc in zip(builders, res.tokens, res.lengths,
                                                     res.per_doc):
            builder.add_documents(tokens, lengths, per_doc)
        stats["lines"] += res.lines
        stats["bad"] += len(res.bad)
        stats["documents"] += res.documents
        stats["sequences"] += int(res.lengths[0].size) if res.lengths else 0
        stats["tokens"] += sum(int(t.size) for t in res.tokens)
        stats["bytes"] += nbytes
        progress.update(nbytes, res.documents, int(file_starts[file_index]) + end_offset)


def keep_report(any_bad: bool, report_tmp: str, report_path: str) -> None:
    if any_bad:
        os.replace(report_tmp, report_path)
        return
    os.unlink(report_tmp)
    if os.path.exists(report_path):
        os.unlink(report_path)  # a report of an earlier run would now mislead

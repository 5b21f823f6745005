"""The worker side of preprocessing and the pool that runs it (data_tools/preprocess_data.py).

Workers parse, split sentences and tokenize chunks of lines (`process_chunk`); the main process
hands them out and writes the results in input order (megatron/data/preprocess/pipeline.py).
`settings` is any object with the tool's flag attributes (tokenizer, vocab_extra_ids,
json_keys, append_eod, strict, split_sentences, punkt_params, keep_newlines, workers): the
tool's argparse namespace.

`worker_state` is the one piece of module state: a worker process's tokenizer and settings, set
once by `init_worker` in that process (never in the main process).
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import signal
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import numpy as np

from megatron.data.preprocess.jsonl import BadLine, Chunk, parse_line
from megatron.data.preprocess.sentence_splitter import make_splitter
from megatron.data.tokenizers.tokenizer import build_tokenizer

worker_state: Dict[str, object] = {}


def init_worker(args, stop, tokenizer=None) -> None:
    # A worker ignores SIGINT (the main process decides what an interrupt means) and dies on
    # SIGTERM, which is how Pool.terminate() would stop it; it must not inherit the main
    # process's handler. SIGTERM comes blocked (see sigterm_held): one sent before this point is
    # delivered now.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    # The main process's tokenizer: forked, it comes ready (CPM-2's with jieba's dictionary
    # loaded once for all workers); spawned, a pickled copy.
    if tokenizer is None:
        tokenizer = build_tokenizer(args.tokenizer, extra_ids=args.vocab_extra_ids)
    worker_state["tokenizer"] = tokenizer
    worker_state["keys"] = list(args.json_keys)
    worker_state["append_eod"] = args.append_eod
    worker_state["strict"] = args.strict
    worker_state["stop"] = stop  # shared with the main process; set: skip what is left (stop_pool)
    splitter = None
    if args.split_sentences:
        splitter = make_splitter(args.punkt_params, keep_newlines=args.keep_newlines)
    worker_state["splitter"] = splitter


@dataclass
class ChunkResult:
    lines: int
    bad: List[Tuple[int, str]]  # (line number, reason)
    documents: int
    # per key: tokens of all sequences back to back, the length of each sequence, and the number
    # of sequences of each document
    tokens: List[np.ndarray] = field(default_factory=list)
    lengths: List[np.ndarray] = field(default_factory=list)
    per_doc: List[np.ndarray] = field(default_factory=list)


def process_chunk(chunk: Chunk) -> ChunkResult:
    if worker_state["stop"].value:  # the run is over: its results would be thrown away
        return ChunkResult(lines=0, bad=[], documents=0)
    tokenizer = worker_state["tokenizer"]
    keys = worker_state["keys"]
    splitter = worker_state["splitter"]
    append_eod = worker_state["append_eod"]
    bad: List[Tuple[int, str]] = []
    docs: List[List[str]] = []
    for k, line in enumerate(chunk.lines):
        try:
            docs.append(parse_line(line, keys))
        except BadLine as e:
            bad.append((chunk.first_line + k, str(e)))
            if worker_state["strict"]:  # the run stops here: nothing of this chunk will be written
                return ChunkResult(lines=len(chunk.lines), bad=bad, documents=0)
    result = ChunkResult(lines=len(chunk.lines), bad=bad, documents=len(docs))
    dtype = tokenizer.token_dtype
    eod = tokenizer.eod
    for key_index in range(len(keys)):
        if splitter is None:
            pieces = [[doc[key_index]] for doc in docs]
        else:
            pieces = [splitter.split(doc[key_index]) for doc in docs]
        flat = list(itertools.chain.from_iterable(pieces))
        ids = tokenizer.encode_batch(flat, num_threads=1)
        lengths: List[int] = []
        per_doc: List[int] = []
        it = iter(ids)
        for doc_pieces in pieces:
            kept = 0
            for _ in doc_pieces:
                seq = next(it)
                if seq:  # a sentence that tokenizes to nothing is dropped, as Megatron does
                    lengths.append(len(seq))
                    kept += 1
            if append_eod:
                if kept:
                    lengths[-1] += 1
                else:
                    lengths.append(1)
                    kept = 1
            per_doc.append(kept)
        if append_eod:
            ids = _with_eod(ids, pieces, eod)
        total = sum(lengths)
        result.tokens.append(
            np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=total)
        )
        result.lengths.append(np.asarray(lengths, dtype=np.int32))
        result.per_doc.append(np.asarray(per_doc, dtype=np.int64))
    return result


def _with_eod(ids: List[List[int]], pieces: List[List[str]], eod: int) -> List[List[int]]:
    """`ids` with EOD appended after the last sequence of each document."""
    out: List[List[int]] = []
    it = iter(ids)
    for doc_pieces in pieces:
        for _ in doc_pieces:
            out.append(next(it))
        out.append([eod])
    return out


class Interrupted(BaseException):
    """SIGTERM, raised in the main thread wherever it is. A BaseException, like
    KeyboardInterrupt, so that no `except Exception` (ours around a worker's result, or a
    library's) takes it for an error."""


def on_sigterm(signum, frame):
    raise Interrupted(f"signal {signum}")


@contextlib.contextmanager
def sigterm_held():
    """SIGTERM blocked in the calling thread inside the block, and in the threads and processes
    made there; one that arrives meanwhile is taken on leaving the block. Start the pool in it
    (`pool, stop = start_pool(...)`): the signal then finds the pool assigned, to be stopped.

    The pool forks workers from its own thread as well, to replace any that exited, and does so
    even while terminate() runs, which stop_pool falls back to (a race in CPython's Pool: the
    task thread sends the workers their stop sentinel while the worker thread, already past its
    state check, refills the pool). A fork carries this process's Python SIGTERM handler, under
    which a SIGTERM that reaches the child before init_worker is lost, and terminate() then
    waits for that worker forever. With SIGTERM blocked until init_worker has restored the
    default action, it is only delayed.
    """
    if not hasattr(signal, "pthread_sigmask"):  # Windows: no fork, no inherited handler
        yield
        return
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def start_pool(args, tokenizer=None):
    """The worker pool and the flag, shared with its workers, that `stop_pool` sets. Call it
    inside `sigterm_held`."""
    ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    stop = ctx.RawValue("b", 0)
    pool = ctx.Pool(args.workers, initializer=init_worker, initargs=(args, stop, tokenizer))
    return pool, stop


def stop_pool(pool, stop) -> None:
    """Stop the workers the way a finished run does, close() then join(), after telling them to
    skip the chunks they have not started: they finish the ones in hand (a chunk's work at most).

    Not Pool.terminate() (CPython's multiprocessing/pool.py, read in 3.11): _help_stuff_finish
    takes the task pipe's read lock and drains the pipe only until it finds it empty, then keeps
    the lock and kills the workers; the pool's task thread may by then have taken the next
    chunk and be about to write it, and a chunk is bigger than the pipe holds, so that write
    never ends and terminate(), which joins the thread, waits forever (1 interrupted run in 120
    of the test here; 4 hangs in 1,908 trials of queue-then-terminate, none in 3,000 of
    queue-then-close-and-join). Only a second interrupt during the wait falls back to it.
    """
    stop.value = 1
    pool.close()
    try:
        pool.join()
    except (Interrupted, KeyboardInterrupt):  # asked twice: the outputs are already gone
        pool.terminate()

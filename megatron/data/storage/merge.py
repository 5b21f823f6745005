"""Concatenating `.bin/.idx` datasets in bounded memory (data_tools/merge_datasets.py).

The output is byte for byte what `indexed_dataset.merge_datasets` writes (an IndexedDatasetBuilder
fed every input by `add_index`): the sequences' tokens back to back, the lengths concatenated, the
pointers recomputed without gaps, the document indices shifted, and a sidecar when the inputs'
sidecars agree. That builder keeps every length and document index of the output in Python
arrays, so its memory grows with the corpus (tens of GB for billions of documents). Here each
input's index arrays are read in chunks of CHUNK_ITEMS items (plain reads of a file, ranged reads
of an object) and written at their place in the output index, whose size the inputs' headers give
before anything is written, and the tokens are copied in pieces of COPY_BYTES: memory is bounded
by the chunk sizes, whatever the number of documents or inputs. Small inputs on object storage
(PRELOAD_BYTES) are fetched whole, the next one while one merges: two of them in memory at most.

Inputs are checked as the C++ reader checks them: the headers of all of them (magic, version,
dtype, the index's size against its counts, the dtypes alike, the data present) before anything
is written; the arrays (lengths, pointers inside the data and not overlapping, document indices
monotone from 0 to N) as they stream, a bad one aborting the merge. Either way a MergeInputError
names the file, and nothing is left under the output's names (the files are written under
temporary names and renamed into place as the builder does, the .idx last).

Legacy TNTIDX inputs (CPM-2-era `--data-impl lazy`) are read through the C++ reader, which holds
their arrays in memory: only MMIDIDX inputs stream.

This module does not import torch.
"""

from __future__ import annotations

import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from megatron.data.storage import object_storage
from megatron.data.storage.data_meta import (
    DatasetMeta,
    meta_file_path,
    read_meta,
    write_meta_file,
)
from megatron.data.storage.indexed_dataset import (
    DTYPE_CODES,
    IndexedDataset,
    data_file_path,
    index_file_path,
    publish_dataset,
    remove_quietly,
)
from megatron.data.storage.object_storage import ObjectStorage, ObjectStorageError

CHUNK_ITEMS = 1 << 18
"""Index entries read at a time: about 20 MB of arrays in flight (bench/RESULTS.md "merge"),
whatever the size of the inputs; larger chunks mean fewer ranged reads on object storage."""
COPY_BYTES = 8 << 20
"""Bytes of tokens copied at a time."""
PRELOAD_BYTES = 16 << 20
"""An input on object storage whose .idx and .bin together are no larger is fetched whole, two
requests, while the input before it is merged (a shard of a large set is typically small: its
many small requests, one after another, would dominate the time)."""

_MMAP_MAGIC = b"MMIDIDX\x00\x00"
_LEGACY_MAGIC = b"TNTIDX\x00\x00"
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, N sequences, D document entries
_CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


class MergeInputError(ValueError):
    """An input that cannot be merged; the message names the file and what is wrong."""


@dataclass(frozen=True)
class MergeSummary:
    inputs: int
    documents: int
    sequences: int
    tokens: int


class _Source:
    """A file or an object read by byte ranges. A file is opened while in use only (`close`
    between uses), so that a merge of thousands of inputs does not hold thousands of them."""

    def __init__(self, path: str, storage: Optional[ObjectStorage]) -> None:
        self.path = path
        self._storage = storage
        self._fd: Optional[int] = None
        self._held: Optional[bytes] = None  # the whole object, when `hold` fetched it
        try:
            if storage is not None:
                self.size, _ = storage.head(path)
            else:
                self._fd = os.open(path, os.O_RDONLY)
                self.size = os.fstat(self._fd).st_size
        except ObjectStorageError as e:
            missing = "no such" in str(e) or "404" in str(e)
            raise MergeInputError(f"{path}: {'does not exist' if missing else e}") from None
        except OSError as e:
            raise MergeInputError(f"{path}: {e.strerror or e}") from None

    def read(self, start: int, end: int) -> bytes:
        """Bytes [start, end), all of them or a MergeInputError (the file changed under us)."""
        if end <= start:
            return b""
        if self._held is not None:
            return self._held[start:end]
        if self._storage is not None:
            return self._storage.read_range(self.path, start, end)
        fd = self._open()
        data = os.pread(fd, end - start, start)
        while len(data) < end - start:
            more = os.pread(fd, end - start - len(data), start + len(data))
            if not more:
                raise MergeInputError(f"{self.path}: ended at byte {start + len(data)} while "
                                      f"reading to {end} (truncated while merging?)")
            data += more
        return data

    @property
    def remote(self) -> bool:
        return self._storage is not None

    def _open(self) -> int:
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_RDONLY)
            except OSError as e:
                raise MergeInputError(f"{self.path}: {e.strerror or e}") from None
        return self._fd

    def array(self, dtype: str, offset: int, start: int, stop: int) -> np.ndarray:
        """Items [start, stop) of the array of `dtype` at byte `offset`."""
        size = np.dtype(dtype).itemsize
        return np.frombuffer(self.read(offset + start * size, offset + stop * size), dtype=dtype)

    def copy_to(self, out_fd: int, start: int, end: int) -> None:
        """Bytes [start, end) appended to the file `out_fd`, COPY_BYTES at a time (from object
        storage, up to 8 pieces fetched together: 64 MiB in flight at most)."""
        if self._held is not None:
            _write_all(out_fd, memoryview(self._held)[start:end])
            return
        if self._storage is not None:
            batch = max(1, min(8, self._storage.settings.max_connections)) * COPY_BYTES
            for first in range(start, end, batch):
                last = min(end, first + batch)
                pieces = [(a, min(last, a + COPY_BYTES)) for a in range(first, last, COPY_BYTES)]
                for data in self._storage.read_ranges(self.path, pieces):
                    _write_all(out_fd, data)
            return
        while start < end:
            step = min(COPY_BYTES, end - start)
            if self._storage is None and hasattr(os, "copy_file_range"):
                try:  # in the kernel: no copy through this process's memory
                    done = os.copy_file_range(self._open(), out_fd, step, start)
                except OSError:
                    done = 0
                if done > 0:
                    start += done
                    continue
            _write_all(out_fd, self.read(start, start + step))
            start += step

    def hold(self) -> None:
        """Fetch the whole object into memory for the reads that follow (until `close`)."""
        self._held = self._storage.read_range(self.path, 0, self.size) if self.size else b""

    def close(self) -> None:
        self._held = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


@dataclass
class MergeInput:
    """One input, its header read and checked (`open_input`)."""
    prefix: str
    dtype: np.dtype
    sequences: int
    document_entries: int  # D: documents + 1
    idx: _Source
    bin: _Source
    legacy: Optional[IndexedDataset] = None  # a TNTIDX input, read through the C++ reader
    meta: Optional[DatasetMeta] = None  # its sidecar, if it has one

    def close(self) -> None:
        self.idx.close()
        self.bin.close()

    def preload(self) -> None:
        """On object storage, a small input's .idx and .bin fetched whole (PRELOAD_BYTES)."""
        if self.idx.remote and self.legacy is None and \
                self.idx.size + self.bin.size <= PRELOAD_BYTES:
            self.idx.hold()
            self.bin.hold()

    def arrays(self, name: str, start: int, stop: int) -> np.ndarray:
        """Items [start, stop) of 'lengths' (int32), 'pointers' or 'documents' (int64)."""
        if self.legacy is not None:
            whole = {"lengths": self.legacy.sequence_lengths,
                     "pointers": self.legacy.sequence_pointers,
                     "documents": self.legacy.document_indices}[name]
            return np.asarray(whole[start:stop])
        n = self.sequences
        offset, dtype = {"lengths": (_HEADER.size, "<i4"),
                         "pointers": (_HEADER.size + 4 * n, "<i8"),
                         "documents": (_HEADER.size + 12 * n, "<i8")}[name]
        return self.idx.array(dtype, offset, start, stop)


def _corrupt(path: str, field: str, what: str) -> MergeInputError:
    return MergeInputError(f"{path}: corrupt index field '{field}': {what}")


def open_input(prefix: str, storage: Optional[ObjectStorage] = None) -> MergeInput:
    """PREFIX's .idx header read and checked against the sizes of the .idx and .bin (an s3://
    prefix through `storage`, None: the default settings).

    Raises:
        MergeInputError: a file is missing, or the header is not a valid index's."""
    remote = object_storage.is_remote(prefix)
    if remote and storage is None:
        storage = ObjectStorage()
    reader = storage if remote else None
    idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
    idx = _Source(idx_path, reader)
    try:
        bin_ = _Source(bin_path, reader)
    except MergeInputError:
        idx.close()
        raise
    try:
        head = idx.read(0, min(idx.size, _HEADER.size))
        idx.close()  # reopened when the merge reaches this input
        bin_.close()
        if head[:8] == _LEGACY_MAGIC:
            return _open_legacy(prefix, idx, bin_, storage)
        if head[:9] != _MMAP_MAGIC:
            raise _corrupt(idx_path, "magic", "not a Megatron index (expected MMIDIDX\\x00\\x00 "
                           "or legacy TNTIDX\\x00\\x00)")
        if len(head) < _HEADER.size:
            raise _corrupt(idx_path, "header", f"needs {_HEADER.size} bytes but the file has "
                           f"only {idx.size} (truncated?)")
        _, version, code, n, d = _HEADER.unpack(head)
        if version != 1:
            raise _corrupt(idx_path, "version", f"is {version}, only version 1 is supported")
        if code not in _CODE_DTYPES:
            raise _corrupt(idx_path, "dtype_code", f"is {code}, expected 1..8")
        expected = _HEADER.size + 12 * n + 8 * d
        if expected != idx.size:
            if expected + n == idx.size:
                raise _corrupt(idx_path, "sequence_modes", "this is a multimodal index "
                               "(per-sequence modes), which is not supported")
            raise _corrupt(idx_path, "sequence_count", f"N={n} and D={d} need a file of "
                           f"{expected} bytes but it has {idx.size} (truncated or not an index)")
        if d == 0:
            raise _corrupt(idx_path, "document_indices", "is empty, expected at least [0]")
        return MergeInput(prefix, _CODE_DTYPES[code], n, d, idx, bin_,
                          meta=read_meta(prefix, storage))
    except BaseException:
        idx.close()
        bin_.close()
        raise


def _open_legacy(prefix: str, idx: _Source, bin_: _Source,
                 storage: Optional[ObjectStorage]) -> MergeInput:
    try:
        ds = IndexedDataset(prefix, impl="infer", storage=storage)
    except ValueError as e:  # CorruptIndexError names the file and the field
        raise MergeInputError(str(e)) from None
    return MergeInput(prefix, ds.dtype, len(ds), len(ds.document_indices), idx, bin_, ds,
                      read_meta(prefix, storage))


def open_inputs(prefixes: Sequence[str],
                storage: Optional[ObjectStorage] = None) -> List[MergeInput]:
    """Every input opened (`open_input`; those on object storage concurrently, through
    `storage`'s thread pool, as their requests wait on the network), refused together if their
    dtypes differ. The first bad input in the given order raises."""
    if not prefixes:
        raise MergeInputError("nothing to merge: no input prefixes")
    if any(object_storage.is_remote(p) for p in prefixes):
        storage = storage if storage is not None else ObjectStorage()
        inputs = list(storage.pool().map(lambda p: open_input(p, storage), prefixes))
    else:
        inputs = [open_input(p, storage) for p in prefixes]
    if len({i.dtype for i in inputs}) > 1:
        listing = ", ".join(f"{i.prefix} ({i.dtype})" for i in inputs)
        raise MergeInputError(f"token dtypes differ, cannot merge: {listing}")
    return inputs


def _chunks(count: int) -> Iterator[Tuple[int, int]]:
    for start in range(0, count, CHUNK_ITEMS):
        yield start, min(count, start + CHUNK_ITEMS)


class _IndexWriter:
    """The output .idx written in place: header first, then each array at its offset."""

    def __init__(self, path: str, dtype: np.dtype, sequences: int, entries: int) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._at = {"lengths": _HEADER.size, "pointers": _HEADER.size + 4 * sequences,
                    "documents": _HEADER.size + 12 * sequences}
        os.pwrite(self.fd, _HEADER.pack(_MMAP_MAGIC, 1, DTYPE_CODES[dtype], sequences, entries),
                  0)
        self.append("documents", np.zeros(1, dtype="<i8"))

    def append(self, name: str, values: np.ndarray) -> None:
        data = values.tobytes()
        at = self._at[name]
        while data:
            written = os.pwrite(self.fd, data, at)
            at += written
            data = data[written:]
        self._at[name] = at

    def close(self) -> None:
        os.fsync(self.fd)
        os.close(self.fd)


@dataclass
class _Run:
    """Bytes [start, end) of the current input's .bin still to copy (merged across chunks)."""
    start: int = 0
    end: int = 0


def _stream_sequences(item: MergeInput, out: _IndexWriter, bin_fd: int, out_bytes: int) -> int:
    """Lengths, recomputed pointers and tokens of `item` appended; returns the output's byte
    size after them. Raises MergeInputError for lengths or pointers the C++ reader refuses."""
    path, bin_path = index_file_path(item.prefix), data_file_path(item.prefix)
    size = item.dtype.itemsize
    end_of_previous = 0
    run = _Run()
    for start, stop in _chunks(item.sequences):
        lengths = item.arrays("lengths", start, stop)
        pointers = item.arrays("pointers", start, stop)
        if (lengths < 0).any():
            i = int(np.argmax(lengths < 0))
            raise _corrupt(path, "sequence_lengths", f"[{start + i}]={lengths[i]} < 0")
        nbytes = lengths.astype(np.int64) * size
        ends = pointers + nbytes
        previous = np.concatenate(([end_of_previous], ends[:-1]))
        bad = (pointers < previous) | (pointers % size != 0) | (ends > item.bin.size)
        if bad.any():
            i = int(np.argmax(bad))
            raise _corrupt(path, "sequence_pointers", f"[{start + i}]={pointers[i]} with length "
                           f"{lengths[i]} overlaps the previous sequence, is not a multiple of "
                           f"the {size}-byte item size, or ends past the end of {bin_path} "
                           f"({item.bin.size} bytes; truncated?)")
        end_of_previous = int(ends[-1])
        out.append("lengths", lengths)
        offsets = np.empty(len(lengths), dtype="<i8")
        offsets[0] = out_bytes
        np.cumsum(nbytes[:-1], out=offsets[1:])
        offsets[1:] += out_bytes
        out.append("pointers", offsets)
        out_bytes += int(nbytes.sum())
        # Contiguous sequences are copied as one range (the whole .bin for the writer's data).
        breaks = np.flatnonzero(pointers[1:] != ends[:-1]) + 1
        for lo, hi in zip(np.concatenate(([0], breaks)), np.concatenate((breaks, [len(lengths)]))):
            first, last = int(pointers[lo]), int(ends[hi - 1])
            if first != run.end:
                item.bin.copy_to(bin_fd, run.start, run.end)
                run.start = first
            run.end = last
    item.bin.copy_to(bin_fd, run.start, run.end)
    return out_bytes


def _stream_documents(item: MergeInput, out: _IndexWriter, offset: int) -> None:
    """Document indices [1:] of `item`, shifted by `offset` sequences, appended; raises
    MergeInputError for indices the C++ reader refuses."""
    path, n, d = index_file_path(item.prefix), item.sequences, item.document_entries
    if d == 1 and n > 0 and item.legacy is None:
        raise _corrupt(path, "document_indices", f"is [0] although the index holds {n} "
                       "sequences: the writer never ended a document (CPM-2's builder does "
                       "this); merge it after rewriting it with documents")
    last = None
    for start, stop in _chunks(d):
        docs = item.arrays("documents", start, stop)
        if last is None:
            if docs[0] != 0:
                raise _corrupt(path, "document_indices", f"[0] is {docs[0]}, expected 0")
            last = 0
        falls = np.flatnonzero(np.diff(np.concatenate(([last], docs))) < 0)
        if len(falls):
            j = int(falls[0])
            raise _corrupt(path, "document_indices", f"[{start + j}]={docs[j]} is below the "
                           "previous entry (not monotone)")
        last = int(docs[-1])
        out.append("documents", (docs[1:] if start == 0 else docs) + offset)
    if last != n:
        raise _corrupt(path, "document_indices", f"ends at {last}, expected N={n}")


def _temporary_path(path: str) -> str:
    return f"{path}.tmp-{os.getpid()}"


def merge_streaming(inputs: Sequence[MergeInput], output_prefix: str,
                    storage: Optional[ObjectStorage] = None,
                    progress: Optional[Callable[[int, MergeInput], None]] = None) -> MergeSummary:
    """Concatenate `inputs` (from `open_inputs`) into the local `output_prefix`: the same bytes
    as indexed_dataset.merge_datasets, the .bin, the sidecar (when every input has one and they
    agree on the tokenizer and EOD; otherwise an old one under the output's name is removed)
    and the .idx moved into place in that order. `progress(i, input)` is called before each.

    Raises:
        MergeInputError: an input's arrays are corrupt (nothing is left under the output's
            names); OSError or ObjectStorageError for failing reads or writes."""
    dtype = inputs[0].dtype
    sequences = sum(i.sequences for i in inputs)
    entries = 1 + sum(i.document_entries - 1 for i in inputs)
    metas = [i.meta for i in inputs]
    keys = {(json.dumps(m.tokenizer, sort_keys=True), m.eod_id, m.eod_appended)
            for m in metas if m is not None}
    meta = metas[0] if None not in metas and len(keys) == 1 else None
    bin_path, idx_path = data_file_path(output_prefix), index_file_path(output_prefix)
    meta_path = meta_file_path(output_prefix)
    tmp_bin, tmp_idx, tmp_meta = (_temporary_path(p) for p in (bin_path, idx_path, meta_path))
    try:
        bin_fd = os.open(tmp_bin, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            index = _IndexWriter(tmp_idx, dtype, sequences, entries)
        except BaseException:
            os.close(bin_fd)
            raise
        try:
            out_bytes, offset = 0, 0
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="merge-ahead") as ahead:
                fetched = ahead.submit(inputs[0].preload)
                for number, item in enumerate(inputs):
                    fetched.result()  # its preload's errors raise here
                    if number + 1 < len(inputs):  # the next input fetched while this one merges
                        fetched = ahead.submit(inputs[number + 1].preload)
                    if progress is not None:
                        progress(number, item)
                    out_bytes = _stream_sequences(item, index, bin_fd, out_bytes)
                    _stream_documents(item, index, offset)
                    item.close()
                    offset += item.sequences
            os.fsync(bin_fd)
        finally:
            os.close(bin_fd)
            index.close()
        tokens = out_bytes // dtype.itemsize
        if meta is not None:
            write_meta_file(tmp_meta, replace(meta, dtype=str(dtype), documents=entries - 1,
                                              sequences=sequences, tokens=tokens))
        publish_dataset(tmp_bin, bin_path, tmp_idx, idx_path,
                        tmp_meta if meta is not None else None, meta_path)
    except BaseException:
        for path in (tmp_idx, tmp_bin, tmp_meta):
            remove_quietly(path)
        raise
    return MergeSummary(len(inputs), entries - 1, sequences, tokens)


__all__ = ["CHUNK_ITEMS", "COPY_BYTES", "MergeInput", "MergeInputError", "MergeSummary",
           "merge_streaming", "open_input", "open_inputs"]

"""Megatron's indexed dataset (`PREFIX.bin` + `PREFIX.idx`): reader and writer.

The format is Megatron's MMIDIDX v1, byte for byte, so data made by Megatron-LM, megatron-core or
Megatron-DeepSpeed reads here and data made here reads there:

    .idx  magic b"MMIDIDX\\x00\\x00" | u64 version=1 | u8 dtype code | u64 N | u64 D |
          int32 sequence_lengths[N] | int64 sequence_pointers[N] (bytes) | int64 document_indices[D]
    .bin  the tokens of all sequences back to back

A sequence is one document (`_document` data) or one sentence (`_sentence` data); the document
indices say where each document's sequences start and end with N. The legacy TNTIDX format of
CPM-2-era Megatron (`--data-impl lazy|cached`) is read too. Reading goes through the C++ helper,
which validates the whole index before anything is handed out and returns zero-copy, read-only
numpy views of the memory-mapped files: a reader holds O(index) memory, never O(data).

A prefix `s3://bucket/key` is read from object storage through the `ObjectStorage` it is opened
with (megatron/data/storage/object_storage.py; default settings when none is given): the index
from a node-local copy, mapped as a local one and checked against the object's size, the tokens
by ranged reads through a bounded cache (read-only numpy arrays over the fetched bytes).
`reads` and `slice_reads` say which byte ranges of the object a read takes, without reading
(the read-ahead plans from them).

This module does not import torch: the offline tools use it and must start fast.
"""

from __future__ import annotations

import array
import json
import os
import struct
from dataclasses import replace
from typing import Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from megatron.data import _helpers

from megatron.data.storage import object_storage
from megatron.data.storage.object_storage import ObjectStorage, RemoteBin
from megatron.data.storage.data_meta import (
    DatasetMeta,
    EodDecision,
    decide_eod,
    meta_file_path,
    read_meta,
    write_meta_file,
)

CorruptIndexError = _helpers.CorruptIndexError

Read = Tuple[RemoteBin, int, int]
"""Bytes [start, end) of a data object on object storage: what a read takes (`reads`)."""

_MMAP_MAGIC = b"MMIDIDX\x00\x00"
_LEGACY_MAGIC = b"TNTIDX\x00\x00"
_VERSION = 1
IMPLS = ("mmap", "lazy", "cached", "infer")

DTYPE_CODES = {
    np.dtype(np.uint8): 1,
    np.dtype(np.int8): 2,
    np.dtype(np.int16): 3,
    np.dtype(np.int32): 4,
    np.dtype(np.int64): 5,
    np.dtype(np.float64): 6,
    np.dtype(np.float32): 7,
    np.dtype(np.uint16): 8,
}


def optimal_dtype(vocab_size: Optional[int]) -> type:
    """Token dtype for a vocabulary: uint16 below 65500 ids (Megatron's rule), else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def data_file_path(path_prefix: str) -> str:
    return path_prefix + ".bin"


def index_file_path(path_prefix: str) -> str:
    return path_prefix + ".idx"


def _storage(storage: Optional[ObjectStorage]) -> ObjectStorage:
    return storage if storage is not None else ObjectStorage()


def dataset_exists(path_prefix: str, storage: Optional[ObjectStorage] = None) -> bool:
    """True when both PREFIX.idx and PREFIX.bin exist (objects, for an s3:// prefix, looked
    up through `storage`: an error other than a missing bucket or key, refused credentials
    say, raises ObjectStorageError)."""
    if object_storage.is_remote(path_prefix):
        storage = _storage(storage)
        return storage.exists(index_file_path(path_prefix)) and \
            storage.exists(data_file_path(path_prefix))
    return os.path.isfile(index_file_path(path_prefix)) and os.path.isfile(
        data_file_path(path_prefix)
    )


def local_index_path(path_prefix: str, storage: Optional[ObjectStorage] = None) -> str:
    """PREFIX.idx, or for an s3:// prefix its node-local copy (downloaded once per node)."""
    path = index_file_path(str(path_prefix))
    return _storage(storage).local_copy(path) if object_storage.is_remote(path) else path


def index_identity(path_prefix: str, name: Optional[str] = None,
                   storage: Optional[ObjectStorage] = None) -> dict:
    """What names a dataset's index in the index caches' descriptions: the absolute path, size
    and modification time of a local index; the URL, size and ETag of an object. name: the
    prefix to name instead of `path_prefix` (CPM-2's, of its three datasets)."""
    name = str(path_prefix if name is None else name)
    if object_storage.is_remote(path_prefix):
        size, etag = _storage(storage).head(index_file_path(path_prefix))
        return {"prefix": name, "idx_size": size, "idx_etag": etag}
    path = index_file_path(path_prefix)
    return {"prefix": os.path.abspath(name), "idx_size": os.path.getsize(path),
            "idx_mtime_ns": os.stat(path).st_mtime_ns}


def default_cache_dir(path_prefix: str, data_cache_path: "Optional[str]" = None) -> str:
    """Where a dataset's index caches go: --data-cache-path, else PREFIX_cache beside local data
    and a node-local folder for data on object storage."""
    if object_storage.is_remote(path_prefix):
        return object_storage.local_cache_dir(str(path_prefix), data_cache_path)
    return data_cache_path or f"{path_prefix}_cache"


def infer_dataset_impl(path_prefix: str, storage: Optional[ObjectStorage] = None) -> str:
    """'mmap' or 'lazy' (legacy TNTIDX), from the magic of PREFIX.idx."""
    with open(local_index_path(path_prefix, storage), "rb") as f:
        magic = f.read(9)
    if magic == _MMAP_MAGIC:
        return "mmap"
    if magic[:8] == _LEGACY_MAGIC:
        return "lazy"
    raise CorruptIndexError(
        f"{index_file_path(path_prefix)}: corrupt index field 'magic': not a Megatron index "
        "(expected MMIDIDX\\x00\\x00 or legacy TNTIDX\\x00\\x00)"
    )


class IndexedDataset:
    """Random access to the sequences of a `.bin/.idx` pair.

    Args:
        path_prefix: the path without `.bin`/`.idx`.
        impl: 'mmap' (MMIDIDX), 'lazy' or 'cached' (legacy TNTIDX; both are memory-mapped here), or
            'infer' (choose by the magic). A file in the other format than the one asked for is an
            error that says which format it has.
        sequences_are_documents: accept an index whose document list is just [0] (written by a
            builder that never ends documents, as CPM-2's) and treat each sequence as a document.
        storage: what an s3:// prefix is read through (None: ObjectStorage() with the default
            settings); unused for local files.

    Raises:
        FileNotFoundError: a file is missing.
        CorruptIndexError (a ValueError): the index is malformed or does not match the .bin; the
            message names the file and the field.
    """

    def __init__(self, path_prefix: str, impl: str = "mmap",
                 sequences_are_documents: bool = False,
                 storage: Optional[ObjectStorage] = None) -> None:
        if impl not in IMPLS:
            raise ValueError(f"unknown dataset impl {impl!r}: choose one of {', '.join(IMPLS)}")
        self.path_prefix = str(path_prefix)
        self._requested_impl = impl
        self._sequences_are_documents = sequences_are_documents
        self._remote: Optional[RemoteBin] = None
        self.storage = storage
        if object_storage.is_remote(self.path_prefix):
            self.storage = storage = _storage(storage)
            self._remote = RemoteBin.open(storage, data_file_path(self.path_prefix))
            self._bin = _helpers.IndexedBin(
                local_index_path(self.path_prefix, storage), data_file_path(self.path_prefix),
                sequences_are_documents, bin_size=self._remote.size)
        else:
            self._bin = _helpers.IndexedBin(
                index_file_path(self.path_prefix), data_file_path(self.path_prefix),
                sequences_are_documents,
            )
        found = "lazy" if self._bin.legacy else "mmap"
        if impl != "infer" and (found == "mmap") != (impl == "mmap"):
            kind = "a legacy TNTIDX ('lazy'/'cached')" if self._bin.legacy else "an MMIDIDX ('mmap')"
            raise ValueError(
                f"{index_file_path(self.path_prefix)} is {kind} index but --data-impl {impl} was "
                f"given; pass --data-impl {found if found == 'mmap' else 'lazy'} or infer"
            )
        self.impl = found
        # Views keep the mapping alive through their base; cache them for cheap attribute access.
        self._sequence_lengths = self._bin.sequence_lengths
        self._document_indices = self._bin.document_indices
        self._pointers = self._bin.sequence_pointers
        self._eod = {}  # (eos id, --data-append-eod) -> EodDecision: decided once per object

    # Pickling reopens the files, so DataLoader workers and spawned processes can receive a dataset.
    def __getstate__(self):
        return {"path_prefix": self.path_prefix, "impl": self._requested_impl,
                "sequences_are_documents": self._sequences_are_documents,
                "storage": self.storage}

    def __setstate__(self, state):
        self.__init__(state["path_prefix"], state["impl"], state["sequences_are_documents"],
                      state["storage"])

    def __len__(self) -> int:
        return self._bin.num_sequences

    def __getitem__(self, idx: Union[int, np.integer, slice]):
        """Sequence `idx` as a read-only numpy array, or a list of them for a contiguous slice."""
        if isinstance(idx, (int, np.integer)):
            if self._remote is not None:
                return self.get(int(idx))
            return self._bin.get(int(idx))
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("slices into an IndexedDataset must be contiguous (step 1)")
            if self._remote is not None:
                return self._remote_slice(start, max(start, stop))
            return self._bin.get_range(start, max(start, stop))
        raise TypeError(f"unexpected index type {type(idx).__name__}: use an int or a slice")

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence `idx` (to its end when length is None)."""
        if self._remote is not None:
            return self._remote_get(int(idx), int(offset), length)
        return self._bin.get(int(idx), int(offset), -1 if length is None else int(length))

    def reads(self, idx: int, offset: int = 0, length: Optional[int] = None) -> List[Read]:
        """The byte range of the data object that `get(idx, offset, length)` reads, without
        reading it ([] for local files); raises as `get` does for a range out of bounds."""
        if self._remote is None:
            return []
        return [(self._remote, *self._get_bytes(int(idx), int(offset), length))]

    def slice_reads(self, start: int, stop: int) -> List[Read]:
        """The byte range of the data object that `self[start:stop]` reads, without reading
        it ([] for local files and empty slices)."""
        if self._remote is None:
            return []
        start, stop, _ = slice(start, stop).indices(len(self))
        bounds = self._slice_bytes(start, max(start, stop))
        return [] if bounds is None else [(self._remote, *bounds)]

    # Data on object storage: the byte range of the tokens asked for, then the same checks and
    # the same read-only arrays as the C++ reader's.
    def _get_bytes(self, idx: int, offset: int, length: Optional[int]) -> Tuple[int, int]:
        n = len(self)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(f"sequence index {idx} out of range for {n} sequences in "
                             f"{index_file_path(self.path_prefix)}")
        size = int(self._sequence_lengths[idx])
        length = size - offset if length is None or length < 0 else length
        if offset < 0 or offset > size or length < 0 or length > size - offset:
            raise IndexError(f"offset {offset} and length {length} out of range for sequence "
                             f"{idx} of length {size}")
        item = self.dtype.itemsize
        start = int(self._pointers[idx]) + offset * item
        return start, start + length * item

    def _slice_bytes(self, start: int, stop: int) -> Optional[Tuple[int, int]]:
        if start < 0 or stop < start or stop > len(self):
            raise IndexError(f"range [{start}, {stop}) out of range for {len(self)} sequences")
        if stop == start:
            return None
        item = self.dtype.itemsize
        first = int(self._pointers[start])
        return first, int(self._pointers[stop - 1]) + int(self._sequence_lengths[stop - 1]) * item

    def _remote_get(self, idx: int, offset: int, length: Optional[int]) -> np.ndarray:
        return self._remote_tokens(*self._get_bytes(idx, offset, length))

    def _remote_slice(self, start: int, stop: int) -> List[np.ndarray]:
        bounds = self._slice_bytes(start, stop)
        if bounds is None:
            return []
        item = self.dtype.itemsize
        first = bounds[0]
        block = self._remote_tokens(*bounds)
        return [block[(int(self._pointers[i]) - first) // item:
                      (int(self._pointers[i]) - first) // item + int(self._sequence_lengths[i])]
                for i in range(start, stop)]

    def _remote_tokens(self, start: int, end: int) -> np.ndarray:
        return np.frombuffer(self._remote.read(start, end), dtype=self.dtype)

    def eod_decision(self, eos_id: int, append_eod: str = "auto") -> EodDecision:
        """Whether the documents end with `eos_id` (data_meta.decide_eod: the sidecar and a
        bounded sample of document ends, or `append_eod` "yes"/"no"), decided once for this
        object: the splits made from it share the answer and its reads.

        Raises:
            data_meta.DataMetaError (a ValueError): "auto" cannot tell (the message names the
                prefix and --data-append-eod)."""
        key = (int(eos_id), append_eod)
        if key not in self._eod:
            self._eod[key] = decide_eod(self, int(eos_id), append_eod)
        return self._eod[key]

    def identity(self) -> dict:
        """What names this dataset's index in the index caches (`index_identity`); a shard set
        (shard_set.ShardSet) names its shards'."""
        return index_identity(self.path_prefix, storage=self.storage)

    @property
    def remote(self) -> Optional[RemoteBin]:
        """The data object's reader for an s3:// prefix (None for local files)."""
        return self._remote

    @property
    def sequence_lengths(self) -> np.ndarray:
        """int32[N]: tokens per sequence."""
        return self._sequence_lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        """int64[N]: byte offset of each sequence in the .bin."""
        return self._pointers

    @property
    def document_indices(self) -> np.ndarray:
        """int64[documents + 1]: first sequence of each document, then N."""
        return self._document_indices

    # Names used by older Megatron code.
    sizes = sequence_lengths
    doc_idx = document_indices

    @property
    def num_documents(self) -> int:
        return self._bin.num_documents

    @property
    def num_tokens(self) -> int:
        return self._bin.num_tokens

    @property
    def dtype(self) -> np.dtype:
        return self._bin.dtype

    def document(self, doc: int) -> List[np.ndarray]:
        """The sequences (sentences) of document `doc`."""
        if not 0 <= doc < self.num_documents:
            raise IndexError(f"document {doc} out of range for {self.num_documents} documents")
        return self[int(self._document_indices[doc]):int(self._document_indices[doc + 1])]

    @staticmethod
    def exists(path_prefix: str, storage: Optional[ObjectStorage] = None) -> bool:
        return dataset_exists(path_prefix, storage)


def make_dataset(path_prefix: str, impl: str = "infer",
                 storage: Optional[ObjectStorage] = None) -> IndexedDataset:
    """Megatron-style factory: open PREFIX with --data-impl `impl`."""
    return IndexedDataset(path_prefix, impl, storage=storage)


def _temporary_path(path: str) -> str:
    return f"{path}.tmp-{os.getpid()}"


class IndexedDatasetBuilder:
    """Writes a `.bin/.idx` pair in MMIDIDX v1; nothing appears under the final names until
    `finalize`, which renames the finished files into place (the .idx last).

    Args:
        bin_path: the final `.bin` path.
        dtype: token dtype (see `optimal_dtype`).

    Use as a context manager, or call `abort()` on failure, to remove the temporary files.
    """

    def __init__(self, bin_path: str, dtype: type = np.int32) -> None:
        self.dtype = np.dtype(dtype)
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"unsupported token dtype {self.dtype}")
        self.bin_path = str(bin_path)
        self._tmp_bin = _temporary_path(self.bin_path)
        self._file = open(self._tmp_bin, "wb")
        self._lengths = array.array("i")
        self._document_indices = array.array("q", [0])
        if np.issubdtype(self.dtype, np.integer):
            info = np.iinfo(self.dtype)
            self._limits = (int(info.min), int(info.max))
        else:
            self._limits = None

    def __enter__(self) -> "IndexedDatasetBuilder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()

    def _as_tokens(self, tokens) -> np.ndarray:
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"a sequence must be 1-D, got shape {arr.shape}")
        if arr.dtype != self.dtype:
            if self._limits is not None and arr.size:
                lo, hi = int(arr.min()), int(arr.max())
                if lo < self._limits[0] or hi > self._limits[1]:
                    raise ValueError(
                        f"token ids in [{lo}, {hi}] do not fit the dataset dtype {self.dtype}"
                    )
            arr = arr.astype(self.dtype)
        return arr

    def add_item(self, tokens) -> None:
        """Append one sequence (a 1-D array, list or tensor of token ids)."""
        arr = self._as_tokens(tokens)
        self._file.write(arr.tobytes(order="C"))
        self._lengths.append(arr.size)

    def add_document(self, tokens, lengths: Sequence[int]) -> None:
        """Append one document: `tokens` holds its sequences back to back, `lengths` their sizes."""
        self.add_documents(tokens, lengths, [len(lengths)])

    def add_documents(self, tokens, lengths, sequences_per_document) -> None:
        """Append many documents at once: all their sequences' tokens back to back, the length of
        each sequence, and how many sequences each document has."""
        arr = self._as_tokens(tokens)
        lengths = np.asarray(lengths, dtype=np.int64)
        per_doc = np.asarray(sequences_per_document, dtype=np.int64)
        if int(lengths.sum()) != arr.size or int(per_doc.sum()) != lengths.size:
            raise ValueError("tokens, lengths and sequences_per_document do not add up")
        self._file.write(arr.tobytes(order="C"))
        self._lengths.extend(lengths.astype(np.int32).tolist())
        ends = len(self._lengths) - lengths.size + np.cumsum(per_doc)
        self._document_indices.extend(ends.tolist())

    def end_document(self) -> None:
        """Close the current document (its sequences are those added since the previous one)."""
        self._document_indices.append(len(self._lengths))

    def add_index(self, path_prefix: str) -> None:
        """Append every document of the dataset at `path_prefix` (its dtype must match)."""
        other = IndexedDataset(path_prefix, impl="infer")
        if other.dtype != self.dtype:
            raise ValueError(
                f"cannot append {path_prefix}: its dtype is {other.dtype}, this dataset's is "
                f"{self.dtype}"
            )
        if len(self._document_indices) > 1 and self._document_indices[-1] != len(self._lengths):
            raise ValueError("end the current document before appending another dataset")
        lengths = other.sequence_lengths
        offset = len(self._lengths)
        expected = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=expected[1:])
        if np.array_equal(other.sequence_pointers, expected):
            nbytes = int(lengths.astype(np.int64).sum()) * self.dtype.itemsize
            with open(data_file_path(path_prefix), "rb") as src:
                _copy_bytes(src, self._file, nbytes)
        else:  # sequences with gaps between them: copy one by one
            for i in range(len(other)):
                self._file.write(other[i].tobytes())
        self._lengths.extend(lengths.tolist())
        self._document_indices.extend((other.document_indices[1:] + offset).tolist())

    def finalize(self, idx_path: str, meta: "Optional[DatasetMeta]" = None) -> None:
        """Write the index and move the files into place: the .bin, then the sidecar
        PREFIX.meta.json when `meta` is given (its dtype and counts are set here from what was
        written; without `meta`, a sidecar left by earlier data under this name is removed),
        then the .idx, which, last, marks a complete dataset."""
        if self._document_indices[-1] != len(self._lengths):
            self.end_document()  # the last document was not closed: close it rather than drop it
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        tmp_idx = _temporary_path(str(idx_path))
        prefix = str(idx_path)[:-len(".idx")] if str(idx_path).endswith(".idx") else None
        meta_path = meta_file_path(prefix) if prefix is not None else None
        tmp_meta = _temporary_path(meta_path) if meta_path is not None else None
        try:
            lengths = np.frombuffer(self._lengths, dtype=np.int32)
            pointers = np.zeros(len(lengths), dtype=np.int64)
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
            with open(tmp_idx, "wb") as f:
                f.write(_MMAP_MAGIC)
                f.write(struct.pack("<Q", _VERSION))
                f.write(struct.pack("<B", DTYPE_CODES[self.dtype]))
                f.write(struct.pack("<Q", len(lengths)))
                f.write(struct.pack("<Q", len(self._document_indices)))
                f.write(lengths.tobytes())
                f.write(pointers.tobytes())
                f.write(np.frombuffer(self._document_indices, dtype=np.int64).tobytes())
                f.flush()
                os.fsync(f.fileno())
            if meta is not None and meta_path is not None:
                write_meta_file(tmp_meta, replace(
                    meta, dtype=str(self.dtype), documents=len(self._document_indices) - 1,
                    sequences=len(lengths), tokens=int(lengths.astype(np.int64).sum())))
            publish_dataset(self._tmp_bin, self.bin_path, tmp_idx, str(idx_path),
                            tmp_meta if meta is not None else None, meta_path)
        except BaseException:
            for path in (tmp_idx, self._tmp_bin, tmp_meta):
                remove_quietly(path)
            raise

    def abort(self) -> None:
        """Drop everything written so far (the final paths are never touched)."""
        if not self._file.closed:
            self._file.close()
        remove_quietly(self._tmp_bin)


def _copy_bytes(src, dst, nbytes: int, chunk: int = 16 << 20) -> None:
    while nbytes > 0:
        buf = src.read(min(chunk, nbytes))
        if not buf:
            raise CorruptIndexError(f"{src.name}: ended early while copying")
        dst.write(buf)
        nbytes -= len(buf)


def remove_quietly(path: Optional[str]) -> None:
    if path is None:
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def publish_dataset(tmp_bin: str, bin_path: str, tmp_idx: str, idx_path: str,
                    tmp_meta: Optional[str], meta_path: Optional[str]) -> None:
    """Move a dataset written under temporary names into place: an old .idx first removed (it
    must not pair with the new .bin for even a moment), the .bin, the sidecar (`tmp_meta`; None:
    an old sidecar at `meta_path` is removed, as it would describe other data), the .idx last,
    which marks a complete dataset. On failure the temporaries are removed, and a sidecar
    already moved (no .idx: no dataset for it to describe)."""
    moved_meta = False
    try:
        remove_quietly(idx_path)
        os.replace(tmp_bin, bin_path)
        if meta_path is not None:
            if tmp_meta is not None:
                os.replace(tmp_meta, meta_path)
                moved_meta = True
            else:
                remove_quietly(meta_path)
        os.replace(tmp_idx, idx_path)
    except BaseException:
        for path in (tmp_idx, tmp_bin, tmp_meta, meta_path if moved_meta else None):
            remove_quietly(path)
        raise


def merge_datasets(prefixes: Iterable[str], output_prefix: str) -> IndexedDataset:
    """Concatenate datasets of one dtype into `output_prefix` (atomically) and open the result.
    When every input has a sidecar (PREFIX.meta.json) and they agree on the tokenizer and EOD,
    the output gets one too; otherwise none (its EOD is then sampled at open)."""
    prefixes = list(prefixes)
    if not prefixes:
        raise ValueError("nothing to merge: no input prefixes")
    first = IndexedDataset(prefixes[0], impl="infer")
    metas = [read_meta(p) for p in prefixes]
    keys = {(json.dumps(m.tokenizer, sort_keys=True), m.eod_id, m.eod_appended)
            for m in metas if m is not None}
    meta = metas[0] if None not in metas and len(keys) == 1 else None
    with IndexedDatasetBuilder(data_file_path(output_prefix), dtype=first.dtype) as builder:
        for prefix in prefixes:
            builder.add_index(prefix)
        builder.finalize(index_file_path(output_prefix), meta)
    return IndexedDataset(output_prefix)


__all__ = [
    "CorruptIndexError",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "dataset_exists",
    "infer_dataset_impl",
    "make_dataset",
    "merge_datasets",
    "optimal_dtype",
]

"""A shard set read as one dataset: `--data-path DIR/NAME_text_document` where only the shards
`DIR/NAME-iiiii-of-nnnnn_text_document.{bin,idx}` and the manifest
`DIR/NAME_text_document.shards.json` exist (preprocess_data.py --num-shards; the manifest's
format: megatron/data/preprocess/manifest.py).

`ShardSet` is the shards concatenated in index order, behind the interface of `IndexedDataset`:
its documents, sequences and tokens are those the merged file (merge_datasets.py) would have, in
the same order, so the split, the sample index caches (built once, for the whole set, by the
same cache machinery as any prefix) and the samples are the merged file's. Each shard's token
reads go to that shard's own file or object; the concatenated lengths and document bounds are
held in memory (4 bytes a sequence, 8 a document; a merged file maps them instead).

On s3:// the shards' `.idx` objects are fetched (and every shard opened) by a pool of
`StorageSettings.max_connections` threads. A shard the manifest lists whose files are absent is
a `ShardSetError` naming it.

Where ranks could share more of the work (not done yet): every process opens every shard (a
stat and two mmaps each locally; on s3:// two HEADs each, the `.idx` downloads being once per
node already) and holds its own copy of the concatenated index. One rank could build that index
as an index-cache entry (index_cache.cached_arrays, as the sample indices are) that the others
map, opening a shard only when a sample reads from it; on s3:// the ranks of a node could split
the shards' requests among them.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional, Sequence, Tuple

import numpy as np

from megatron.data.storage import object_storage
from megatron.data.storage.data_meta import FLAG, EodDecision, SAMPLE_DOCUMENTS, decide_eod
from megatron.data.storage.indexed_dataset import (
    IndexedDataset,
    Read,
    dataset_exists,
    index_file_path,
    index_identity,
)
from megatron.data.storage.object_storage import ObjectStorage

MANIFEST_SUFFIX = ".shards.json"
MANIFEST_FORMAT = "t5-pretrain-shard-set"
MANIFEST_VERSION = 1


class ShardSetError(ValueError):
    """A shard set that cannot be opened; str() names the manifest or the shard."""


def manifest_path(dataset_prefix: str) -> str:
    """PREFIX_text_document.shards.json for the set named PREFIX_text_document."""
    return str(dataset_prefix) + MANIFEST_SUFFIX


def _storage(storage: Optional[ObjectStorage]) -> ObjectStorage:
    return storage if storage is not None else ObjectStorage()


def is_shard_set(prefix: str, storage: Optional[ObjectStorage] = None) -> bool:
    """True when PREFIX names a shard set: its manifest exists and PREFIX has no `.idx` of its
    own (a merged file beside its shards is read as the file)."""
    path = manifest_path(prefix)
    if object_storage.is_remote(path):
        storage = _storage(storage)
        return storage.exists(path) and not storage.exists(index_file_path(prefix))
    return os.path.isfile(path) and not os.path.isfile(index_file_path(prefix))


def read_manifest(prefix: str, storage: Optional[ObjectStorage] = None) -> dict:
    """The manifest of the set PREFIX (on s3://, from a node-local copy).

    Raises:
        ShardSetError: unreadable, or not this format's version."""
    path = manifest_path(prefix)
    try:
        local = _storage(storage).local_copy(path) if object_storage.is_remote(path) else path
        with open(local, encoding="utf-8") as f:
            body = json.load(f)
        if body.get("format") != MANIFEST_FORMAT or body.get("version") != MANIFEST_VERSION:
            raise ValueError(f"not a {MANIFEST_FORMAT} version {MANIFEST_VERSION} file")
        shards = [str(s["prefix"]) for s in body["shards"]]
        if len(shards) != int(body["num_shards"]) or not shards:
            raise ValueError(f"{len(shards)} shards listed, num_shards {body['num_shards']}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ShardSetError(f"{path}: unreadable shard-set manifest ({e}); rewrite it with "
                            "merge_datasets.py --manifest-only") from None
    return body


def shard_prefixes(prefix: str, manifest: dict) -> List[str]:
    """The shards' dataset prefixes, in index order (the manifest lists them relative to its
    folder)."""
    folder = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
    return [f"{folder}/{s['prefix']}" if folder else s["prefix"] for s in manifest["shards"]]


def missing_shards(prefix: str, storage: Optional[ObjectStorage] = None,
                   manifest: Optional[dict] = None) -> List[str]:
    """The shards the manifest lists whose `.bin` or `.idx` is absent (looked up in parallel on
    s3://)."""
    storage = _storage(storage)
    members = shard_prefixes(prefix, manifest or read_manifest(prefix, storage))
    with _pool(prefix, storage, len(members)) as pool:
        present = list(pool.map(lambda m: dataset_exists(m, storage), members))
    return [m for m, ok in zip(members, present) if not ok]


def _pool(prefix: str, storage: ObjectStorage, n: int) -> ThreadPoolExecutor:
    """Threads for per-shard work: the connection limit on s3:// (the work waits on requests);
    a few locally (opening is a stat and an mmap, the index check holds the GIL)."""
    if object_storage.is_remote(prefix):
        workers = storage.settings.max_connections
    else:
        workers = min(4, os.cpu_count() or 1)
    return ThreadPoolExecutor(max_workers=max(1, min(workers, n)))


def _open_shard(member: str, impl: str, storage: ObjectStorage) -> Optional[IndexedDataset]:
    """The shard opened, or None when its files are absent (looked up only when the open failed:
    on s3:// every request counts, and a shard's open already asks for both objects)."""
    try:
        return IndexedDataset(member, impl, storage=storage)
    except (OSError, ValueError):
        if not dataset_exists(member, storage):
            return None
        raise


class ShardSet:
    """The shards of a set, concatenated, read as one `IndexedDataset` (module docstring).

    Raises:
        ShardSetError: an unreadable manifest, a missing shard (named), shards of different
            dtypes or formats, or counts that are not the manifest's.
        CorruptIndexError (a ValueError): a shard's index is malformed (the shard named).
    """

    def __init__(self, path_prefix: str, impl: str = "infer",
                 storage: Optional[ObjectStorage] = None) -> None:
        self.path_prefix = str(path_prefix)
        self._impl = impl
        self.storage = storage = _storage(storage)
        manifest = read_manifest(self.path_prefix, storage)
        members = shard_prefixes(self.path_prefix, manifest)
        with _pool(self.path_prefix, storage, len(members)) as pool:
            opened = list(pool.map(lambda m: _open_shard(m, impl, storage), members))
        missing = [m for m, ds in zip(members, opened) if ds is None]
        if missing:
            raise ShardSetError(
                f"shard {missing[0]} of the set {self.path_prefix} is missing ({len(missing)} of "
                f"{len(members)} are; {manifest_path(self.path_prefix)} lists them): run its "
                "preprocessing task again")
        self.shards: List[IndexedDataset] = opened
        self._check(manifest)
        seqs = np.array([len(s) for s in self.shards], dtype=np.int64)
        self._first_sequence = np.concatenate([[0], np.cumsum(seqs)])  # [shards + 1]
        self._sequence_lengths = np.concatenate([s.sequence_lengths for s in self.shards])
        self._document_indices = np.concatenate(
            [self.shards[0].document_indices[:1]]
            + [s.document_indices[1:] + self._first_sequence[k]
               for k, s in enumerate(self.shards)]).astype(np.int64)
        self._eod = {}

    def _check(self, manifest: dict) -> None:
        first = self.shards[0]
        for shard, listed in zip(self.shards, manifest["shards"]):
            if shard.dtype != first.dtype or shard.impl != first.impl:
                raise ShardSetError(f"{shard.path_prefix} holds {shard.impl} {shard.dtype} "
                                    f"tokens, {first.path_prefix} {first.impl} {first.dtype}: "
                                    "the shards of a set are written by one tokenizer; rerun it")
            found = (shard.num_documents, len(shard), shard.num_tokens)
            said = (listed.get("documents"), listed.get("sequences"), listed.get("tokens"))
            if found != said:
                raise ShardSetError(
                    f"{shard.path_prefix} has (documents, sequences, tokens) {found} but "
                    f"{manifest_path(self.path_prefix)} lists {said}: the shard was rewritten "
                    "after the manifest; rewrite it with merge_datasets.py --manifest-only")

    def __getstate__(self):  # loader workers reopen the set (the shards' caches are warm)
        return {"path_prefix": self.path_prefix, "impl": self._impl, "storage": self.storage}

    def __setstate__(self, state):
        self.__init__(state["path_prefix"], state["impl"], state["storage"])

    # --- where a sequence lives ---------------------------------------------------------------

    def _locate(self, idx: int) -> Tuple[IndexedDataset, int]:
        n = len(self)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(f"sequence index {idx} out of range for {n} sequences in the set "
                             f"{self.path_prefix}")
        k = int(np.searchsorted(self._first_sequence, idx, side="right")) - 1
        return self.shards[k], idx - int(self._first_sequence[k])

    def _pieces(self, start: int, stop: int) -> List[Tuple[IndexedDataset, int, int]]:
        """(shard, its first, its end) sequence ranges that [start, stop) covers."""
        if start < 0 or stop < start or stop > len(self):
            raise IndexError(f"range [{start}, {stop}) out of range for {len(self)} sequences")
        out = []
        while start < stop:
            shard, local = self._locate(start)
            take = min(stop - start, len(shard) - local)
            out.append((shard, local, local + take))
            start += take
        return out

    # --- IndexedDataset's interface -----------------------------------------------------------

    def __len__(self) -> int:
        return int(self._first_sequence[-1])

    def __getitem__(self, idx):
        if isinstance(idx, (int, np.integer)):
            shard, local = self._locate(int(idx))
            return shard[local]
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("slices into a shard set must be contiguous (step 1)")
            return [seq for shard, a, b in self._pieces(start, max(start, stop))
                    for seq in shard[a:b]]
        raise TypeError(f"unexpected index type {type(idx).__name__}: use an int or a slice")

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        shard, local = self._locate(int(idx))
        return shard.get(local, offset, length)

    def reads(self, idx: int, offset: int = 0, length: Optional[int] = None) -> List[Read]:
        shard, local = self._locate(int(idx))
        return shard.reads(local, offset, length)

    def slice_reads(self, start: int, stop: int) -> List[Read]:
        start, stop, _ = slice(start, stop).indices(len(self))
        return [r for shard, a, b in self._pieces(start, max(start, stop))
                for r in shard.slice_reads(a, b)]

    def eod_decision(self, eos_id: int, append_eod: str = "auto") -> EodDecision:
        """As IndexedDataset.eod_decision, for the set: each shard decided by its sidecar and
        a sample of its document ends (SAMPLE_DOCUMENTS spread over the shards, at least one
        each); shards that disagree are refused, naming both."""
        key = (int(eos_id), append_eod)
        if key in self._eod:
            return self._eod[key]
        if append_eod != "auto":
            decision = decide_eod(self.shards[0], int(eos_id), append_eod)
        else:
            per_shard = max(1, -(-SAMPLE_DOCUMENTS // len(self.shards)))
            with _pool(self.path_prefix, self.storage, len(self.shards)) as pool:
                decisions = list(pool.map(
                    lambda s: s.eod_decision(int(eos_id), "auto") if per_shard >= SAMPLE_DOCUMENTS
                    else decide_eod(s, int(eos_id), "auto", per_shard), self.shards))
            for shard, d in zip(self.shards, decisions):
                if d.appended != decisions[0].appended:
                    raise ShardSetError(
                        f"the set {self.path_prefix} mixes shards with and without EOD: "
                        f"{self.shards[0].path_prefix} ({decisions[0].source}: "
                        f"{'appended' if decisions[0].appended else 'not appended'}) and "
                        f"{shard.path_prefix} ({d.source}); rerun the odd shards with the same "
                        f"--append-eod, or pass {FLAG} yes|no")
            decision = EodDecision(decisions[0].appended,
                                   f"the {len(self.shards)} shards of {self.path_prefix} "
                                   f"({decisions[0].source}, ...)")
        self._eod[key] = decision
        return decision

    def identity(self) -> dict:
        """What names the set in the index caches' descriptions: its shards' identities."""
        with _pool(self.path_prefix, self.storage, len(self.shards)) as pool:
            shards = list(pool.map(lambda s: index_identity(s.path_prefix, storage=self.storage),
                                   self.shards))
        return {"prefix": self.path_prefix if object_storage.is_remote(self.path_prefix)
                else os.path.abspath(self.path_prefix), "shards": shards}

    @property
    def impl(self) -> str:
        return self.shards[0].impl

    @property
    def remote(self):
        return None  # each shard has its own; reads() names it

    @property
    def sequence_lengths(self) -> np.ndarray:
        return self._sequence_lengths

    @property
    def document_indices(self) -> np.ndarray:
        return self._document_indices

    sizes = sequence_lengths
    doc_idx = document_indices

    @property
    def num_documents(self) -> int:
        return len(self._document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards)

    @property
    def dtype(self) -> np.dtype:
        return self.shards[0].dtype

    def document(self, doc: int) -> List[np.ndarray]:
        if not 0 <= doc < self.num_documents:
            raise IndexError(f"document {doc} out of range for {self.num_documents} documents")
        return self[int(self._document_indices[doc]):int(self._document_indices[doc + 1])]


def open_dataset(path_prefix: str, impl: str = "infer", storage: Optional[ObjectStorage] = None,
                 sequences_are_documents: bool = False):
    """PREFIX as a dataset: its `.bin/.idx`, or the shard set it names (`ShardSet`)."""
    if not dataset_exists(path_prefix, storage) and is_shard_set(path_prefix, storage):
        return ShardSet(path_prefix, impl, storage)
    return IndexedDataset(path_prefix, impl, sequences_are_documents, storage)


def sidecar_prefix(path_prefix: str, storage: Optional[ObjectStorage] = None) -> str:
    """The prefix whose `.meta.json` describes PREFIX's tokenizer: PREFIX's own, or for a shard
    set its first shard's (the shards' tokenizers agree: the manifest is written only then)."""
    if dataset_exists(path_prefix, storage) or not is_shard_set(path_prefix, storage):
        return path_prefix
    return shard_prefixes(path_prefix, read_manifest(path_prefix, storage))[0]


def exists(path_prefix: str, storage: Optional[ObjectStorage] = None) -> bool:
    """A `.bin/.idx` pair or a shard set's manifest (its shards are checked at open)."""
    return dataset_exists(path_prefix, storage) or is_shard_set(path_prefix, storage)


__all__: Sequence[str] = ("ShardSet", "ShardSetError", "is_shard_set", "open_dataset", "exists",
                          "read_manifest", "missing_shards", "manifest_path")

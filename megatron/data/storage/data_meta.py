"""What a `.bin/.idx` dataset says about itself, and whether its documents end with EOD.

`data_tools/preprocess_data.py` writes, beside `PREFIX.bin` and `PREFIX.idx`, a small JSON
sidecar `PREFIX.meta.json` (moved into place after the `.bin` and before the `.idx`, and uploaded
in that order to s3://):

    {"format": "t5-pretrain-dataset-meta", "version": 1,
     "tokenizer": {"type": "SentencePieceTokenizer", "model": "t5.model", "vocab_size": 32100,
                   "pieces": 32000, "pieces_sha256": "..."},
     "eod_id": 1, "eod_appended": true, "dtype": "uint16",
     "documents": 1000, "sequences": 1000, "tokens": 250000}

Span corruption packs documents back to back and needs EOD between them: a document that does not
end with EOD gets one, virtually. Which documents end with it is decided at open without reading
the data (`decide_eod`):

- `--data-append-eod yes|no` settles it: nothing of the `.bin` is read;
- `auto` (the default) takes the sidecar, checked against a bounded random sample of document
  ends (SAMPLE_DOCUMENTS last tokens, a few bytes each): a sidecar that the sample contradicts,
  or whose counts are not its index's, is refused (one about another EOD id than the run's
  tokenizer's EOS says nothing of it: the sample decides);
- `auto` without a sidecar (Megatron-LM's preprocess, older outputs): the same sample decides;
  one whose documents both do and do not end with EOD is refused, naming the flag.

Training refuses data whose sidecar names another tokenizer than the run's
(`tokenizer_mismatch`: the run's first pieces must be the data's, as the SHA-256 of their text
says, so an extension of the data's tokenizer reads it; sidecars written before that was
recorded are held to their tokenizer type only).

So opening a prefix reads its `.idx`, its sidecar and at most SAMPLE_DOCUMENTS tokens of its
`.bin` (one ranged read each on object storage, one `pread` each on a file system), however
large the corpus. This module does not import torch.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from typing import Optional, Tuple

import numpy as np

from megatron.data.storage import object_storage

META_SUFFIX = ".meta.json"
META_FORMAT = "t5-pretrain-dataset-meta"
META_VERSION = 1
APPEND_EOD_MODES = ("auto", "yes", "no")
SAMPLE_DOCUMENTS = 64
"""Document ends read to decide (or check the sidecar's word on) whether EOD was appended."""
_SAMPLE_SEED = 0xE0D  # fixed: every rank samples the same documents and decides the same
FLAG = "--data-append-eod"


def meta_file_path(path_prefix: str) -> str:
    """PREFIX.meta.json: the sidecar of dataset PREFIX."""
    return str(path_prefix) + META_SUFFIX


class DataMetaError(ValueError):
    """A sidecar that cannot be read or contradicts its data, or documents that disagree on EOD;
    the message names the file and the flag that settles it."""


@dataclass(frozen=True)
class DatasetMeta:
    """The sidecar's fields (module docstring)."""

    tokenizer: dict
    eod_id: int
    eod_appended: bool
    dtype: str
    documents: int
    sequences: int
    tokens: int

    def to_json(self) -> str:
        return json.dumps({"format": META_FORMAT, "version": META_VERSION, **asdict(self)},
                          indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str) -> "DatasetMeta":
        """Raises DataMetaError naming `where` for anything but this format's version 1."""
        try:
            data = json.loads(text)
            if data.get("format") != META_FORMAT or data.get("version") != META_VERSION:
                raise ValueError(f"not a {META_FORMAT} version {META_VERSION} file")
            return cls(tokenizer=dict(data["tokenizer"]), eod_id=int(data["eod_id"]),
                       eod_appended=bool(data["eod_appended"]), dtype=str(data["dtype"]),
                       documents=int(data["documents"]), sequences=int(data["sequences"]),
                       tokens=int(data["tokens"]))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise DataMetaError(f"{where}: unreadable dataset metadata ({e}); delete it (the "
                                f"data is then sampled) or pass {FLAG} yes|no") from None


def write_meta_file(path: str, meta: DatasetMeta) -> None:
    """`meta` into `path`, synced: the caller writes a temporary name and renames it into place
    with the dataset's other files (IndexedDatasetBuilder.finalize)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(meta.to_json())
        f.flush()
        os.fsync(f.fileno())


def read_meta(path_prefix: str,
              storage: "Optional[object_storage.ObjectStorage]" = None) -> Optional[DatasetMeta]:
    """The sidecar of PREFIX (a file, or an object beside an s3:// prefix, read through
    `storage`: None, the default settings), None if absent."""
    path = meta_file_path(path_prefix)
    if object_storage.is_remote(path):
        if storage is None:
            storage = object_storage.ObjectStorage()
        if not storage.exists(path):
            return None
        size, _ = storage.head(path)
        text = storage.read_range(path, 0, size).decode("utf-8", errors="replace")
    else:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except FileNotFoundError:
            return None
    return DatasetMeta.from_json(text, path)


def tokenizer_identity(tokenizer) -> dict:
    """What the sidecar records of the tokenizer besides its type, file name and size: its
    ordinary pieces (every id below the first sentinel: T5's sentinels follow the SentencePiece
    pieces, CPM-2's `<s_N>` close its vocabulary), their count and the SHA-256 of their text in
    id order. Data made with it reads the same under any tokenizer whose first `pieces` ids
    are the same pieces: itself with another --vocab-extra-ids, or an extension of it
    (data_tools/train_tokenizer.py --extend), and no other."""
    count = min(tokenizer.sentinel_ids, default=tokenizer.vocab_size)
    return {"pieces": int(count), "pieces_sha256": _pieces_digest(tokenizer, count)}


def _pieces_digest(tokenizer, count: int) -> str:
    digest = hashlib.sha256()
    for i in range(count):
        digest.update(tokenizer.id_to_piece(i).encode("utf-8") + b"\n")
    return digest.hexdigest()


def tokenizer_mismatch(meta: DatasetMeta, where: str, tokenizer, tokenizer_type: str,
                       named: str) -> Optional[str]:
    """Why data whose sidecar (at `where`) is `meta` cannot be read with `tokenizer` (the run's,
    of `tokenizer_type`, `named` as its flag and path), or None. Where the sidecar records the
    pieces (tokenizer_identity), the run's first pieces must be those; an older sidecar is only
    held to its tokenizer type (its size alone cannot tell an extension from another one)."""
    said = meta.tokenizer
    count = said.get("pieces")
    if said.get("pieces_sha256") is None or not isinstance(count, int):
        if said.get("type") in (None, tokenizer_type):
            return None
    elif min(tokenizer.sentinel_ids, default=tokenizer.vocab_size) >= count and \
            _pieces_digest(tokenizer, count) == said["pieces_sha256"]:
        return None
    what = f"its first {count} pieces" if isinstance(count, int) else "its pieces"
    return (f"{where} says the data was tokenized with {said.get('model')} "
            f"({said.get('type')}, {said.get('vocab_size')} ids) but {named} "
            f"({tokenizer_type}, {tokenizer.vocab_size} ids) is another tokenizer: {what} do "
            f"not have the same ids there, so the data's ids would mean other pieces. Give the "
            f"tokenizer the data was made with (or an extension of it: train_tokenizer.py "
            f"--extend), or preprocess the data again with this one")


@dataclass(frozen=True)
class EodDecision:
    """Whether a dataset's documents end with EOD, and how that was found out.

    appended: documents end with EOD (no virtual one is added).
    source: what settled it, for messages (the flag, the sidecar, the sample).
    read_ranges: the (byte offset, bytes) of the `.bin` read to decide: at most
        SAMPLE_DOCUMENTS, whatever the size of the corpus.
    """

    appended: bool
    source: str
    read_ranges: Tuple[Tuple[int, int], ...] = ()

    def needs_eos(self, ds) -> np.ndarray:
        """bool[documents]: the documents that get a virtual EOS: all of them when EOD was not
        appended, else those without a last token (empty documents, as before)."""
        if not self.appended:
            return np.ones(ds.num_documents, dtype=bool)
        return ~_has_last_token(ds)


def decide_eod(ds, eos_id: int, mode: str = "auto",
               sample_documents: int = SAMPLE_DOCUMENTS) -> EodDecision:
    """Whether the documents of `ds` (an IndexedDataset; its sidecar is read through its
    `storage`) end with `eos_id` (module docstring).

    Raises:
        DataMetaError: the sample disagrees with itself or with the sidecar, or the sidecar's
            counts are not this dataset's.
    """
    if mode not in APPEND_EOD_MODES:
        raise DataMetaError(f"{FLAG} {mode!r}: choose one of {', '.join(APPEND_EOD_MODES)}")
    if mode != "auto":
        return EodDecision(mode == "yes", f"{FLAG} {mode}")
    prefix = ds.path_prefix
    meta = read_meta(prefix, getattr(ds, "storage", None))
    note = ""
    if meta is not None:
        _check_meta_matches(meta, ds)
        if meta.eod_id != eos_id:  # it says nothing of this EOS: the sample decides, as the
            # scan it replaces did (a tokenizer other than the data's is the caller's choice)
            note = (f" ({meta_file_path(prefix)} is about EOD id {meta.eod_id}, not this "
                    f"tokenizer's EOS)")
            meta = None
    ranges, ends = _sample_document_ends(ds, sample_documents)
    with_eod = int((ends == eos_id).sum())
    described = (f"{with_eod} of {len(ends)} documents sampled from {prefix} end with EOD (id "
                 f"{eos_id})")
    if meta is not None:
        where = meta_file_path(prefix)
        if len(ends) and with_eod != (len(ends) if meta.eod_appended else 0):
            said = "appended" if meta.eod_appended else "not appended"
            raise DataMetaError(
                f"{where} says EOD was {said} but {described}: the sidecar does not describe "
                f"this data; delete it, or pass {FLAG} yes (documents end with EOD) or "
                f"{FLAG} no (each gets one)")
        return EodDecision(meta.eod_appended, where, ranges)
    if 0 < with_eod < len(ends):
        raise DataMetaError(
            f"{described}, the others do not: cannot tell whether EOD was appended. Pass {FLAG} "
            f"yes if documents end with EOD (the others are packed without a separator) or "
            f"{FLAG} no to add one after every document")
    return EodDecision(len(ends) > 0 and with_eod == len(ends),
                       f"a sample: {described}{note}", ranges)


def _check_meta_matches(meta: DatasetMeta, ds) -> None:
    where = meta_file_path(ds.path_prefix)
    found = {"documents": ds.num_documents, "sequences": len(ds), "tokens": ds.num_tokens,
             "dtype": str(np.dtype(ds.dtype))}
    said = {k: getattr(meta, k) for k in found}
    if said != found:
        wrong = ", ".join(f"{k} {said[k]} (the index has {found[k]})" for k in found
                          if said[k] != found[k])
        raise DataMetaError(f"{where} describes another dataset: {wrong}; it is left from "
                            f"other data: delete it, or pass {FLAG} yes|no")


def _has_last_token(ds) -> np.ndarray:
    """bool[documents]: the document has tokens and its last sequence is not empty (where its
    last token is: documents made by our tools and Megatron's never end with an empty one)."""
    bounds = np.asarray(ds.document_indices, dtype=np.int64)
    lengths = np.asarray(ds.sequence_lengths, dtype=np.int64)
    out = bounds[1:] > bounds[:-1]
    last = np.maximum(bounds[1:] - 1, 0)
    out[out] = lengths[last[out]] > 0
    return out


def _sample_document_ends(ds, count: int) -> Tuple[Tuple[Tuple[int, int], ...], np.ndarray]:
    """((byte offset, bytes) read, the last tokens) of at most `count` documents drawn with a
    fixed seed from those that have a last token."""
    candidates = np.flatnonzero(_has_last_token(ds))
    if len(candidates) > count:
        rng = np.random.default_rng(_SAMPLE_SEED)
        candidates = np.sort(rng.choice(candidates, size=count, replace=False))
    last_seq = np.asarray(ds.document_indices, dtype=np.int64)[candidates + 1] - 1
    item = np.dtype(ds.dtype).itemsize
    offsets = (np.asarray(ds.sequence_pointers, dtype=np.int64)[last_seq]
               + (np.asarray(ds.sequence_lengths, dtype=np.int64)[last_seq] - 1) * item)
    offsets = np.sort(offsets)
    ranges = tuple((int(o), item) for o in offsets)
    if not len(offsets):
        return ranges, np.zeros(0, dtype=np.int64)
    if ds.remote is not None:  # one small ranged read each, concurrently, past the cache
        raw = ds.remote.items(offsets, item, gap=0)
    else:  # pread: only the pages holding these tokens are touched
        fd = os.open(str(ds.path_prefix) + ".bin", os.O_RDONLY)
        try:
            if hasattr(os, "posix_fadvise"):  # no read-ahead around each token
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            raw = b"".join(os.pread(fd, item, int(o)) for o in offsets)
        finally:
            os.close(fd)
    return ranges, np.frombuffer(raw, dtype=ds.dtype).astype(np.int64)

"""The manifest of a shard set: `PREFIX_{key}_{level}.shards.json` beside the shards.

It lists the shards' prefixes (relative to its folder) in index order with their documents,
sequences and tokens, the number of shards and the tokenizer. The shard that finds every other
shard's `.idx` in place after writing its own writes it (`write_manifest_if_complete`); two
shards that finish at once both write the same bytes through a temporary name, so either rename
leaves a complete, identical file. `write_manifest` does it after the fact
(`merge_datasets.py --manifest-only`).
"""

from __future__ import annotations

import json
import os
import re
from typing import List, Optional

from megatron.data.preprocess.sharding import shard_prefix
from megatron.data.storage import object_storage
from megatron.data.storage.data_meta import read_meta
from megatron.data.storage.indexed_dataset import IndexedDataset, index_file_path
# the format is the reader's (the set read as one --data-path)
from megatron.data.storage.shard_set import (  # noqa: F401 - names of this module too
    MANIFEST_FORMAT,
    MANIFEST_SUFFIX,
    MANIFEST_VERSION,
    manifest_path,
)

_SHARD_NAME = re.compile(r"^(?P<base>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})_(?P<rest>.+)\.idx$")


class ManifestError(ValueError):
    """A shard set that cannot be listed; str() names the shard or file."""


def set_member(output_prefix: str, suffix: str, index: int, count: int) -> str:
    """The dataset prefix of shard `index` of `count` of the set OUTPUT_PREFIX{suffix}
    (suffix: `_text_document`)."""
    return shard_prefix(output_prefix, index, count) + suffix


def _exists(path: str, storage) -> bool:
    if object_storage.is_remote(path):
        return storage.exists(path)
    return os.path.isfile(path)  # a folder of that name is no shard


def missing_shards(output_prefix: str, suffix: str, count: int, storage=None) -> List[str]:
    """The dataset prefixes of the set whose `.idx` is not (yet) in place."""
    storage = _storage_for(output_prefix, storage)
    return [m for m in (set_member(output_prefix, suffix, i, count) for i in range(count))
            if not _exists(index_file_path(m), storage)]


def _storage_for(prefix: str, storage):
    if storage is None and object_storage.is_remote(prefix):
        return object_storage.ObjectStorage()
    return storage


def manifest_text(output_prefix: str, suffix: str, count: int, storage=None) -> str:
    """The manifest of the complete set, as JSON text (the same bytes whoever builds it).

    Raises:
        ManifestError: a missing shard (named), or shards written with different tokenizers.
    """
    storage = _storage_for(output_prefix, storage)
    missing = missing_shards(output_prefix, suffix, count, storage)
    if missing:
        raise ManifestError(f"shard {missing[0]} is missing ({len(missing)} of {count} are); "
                            "run its task again")
    shards, tokenizer, dtype = [], None, None
    for i in range(count):
        member = set_member(output_prefix, suffix, i, count)
        meta = read_meta(member, storage)
        if meta is not None:
            counts = (meta.documents, meta.sequences, meta.tokens)
            this_tokenizer, this_dtype = meta.tokenizer, meta.dtype
        else:  # a shard written without a sidecar: count from its index
            ds = IndexedDataset(member, impl="infer")
            counts = (ds.num_documents, len(ds), ds.num_tokens)
            this_tokenizer, this_dtype = None, str(ds.dtype)
        if i == 0:
            tokenizer, dtype = this_tokenizer, this_dtype
        elif this_tokenizer != tokenizer or this_dtype != dtype:
            raise ManifestError(f"{member} was written with another tokenizer or dtype than "
                                f"{set_member(output_prefix, suffix, 0, count)}; rerun it")
        shards.append({"prefix": os.path.basename(member), "documents": counts[0],
                       "sequences": counts[1], "tokens": counts[2]})
    body = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "num_shards": count,
            "tokenizer": tokenizer, "dtype": dtype,
            "documents": sum(s["documents"] for s in shards),
            "tokens": sum(s["tokens"] for s in shards), "shards": shards}
    return json.dumps(body, indent=1, sort_keys=True) + "\n"


def write_manifest(output_prefix: str, suffix: str, count: int, storage=None) -> str:
    """Write the manifest of the complete set atomically (a temporary name, then a rename; on
    s3:// one PUT); returns its path.

    Raises:
        ManifestError: as manifest_text.
        OSError: the file cannot be written.
    """
    storage = _storage_for(output_prefix, storage)
    text = manifest_text(output_prefix, suffix, count, storage)
    path = manifest_path(output_prefix + suffix)
    if object_storage.is_remote(path):
        import tempfile

        with tempfile.NamedTemporaryFile("w", suffix=MANIFEST_SUFFIX, encoding="utf-8",
                                         delete=False) as f:
            f.write(text)
        try:
            storage.upload(f.name, path)
        finally:
            os.unlink(f.name)
        return path
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def write_manifest_if_complete(output_prefix: str, suffix: str, count: int,
                               storage=None) -> Optional[str]:
    """After a shard's own files are in place: the manifest's path if every shard's `.idx` is
    there (and the manifest now written), else None."""
    storage = _storage_for(output_prefix, storage)
    if missing_shards(output_prefix, suffix, count, storage):
        return None
    return write_manifest(output_prefix, suffix, count, storage)


def find_set(dataset_prefix: str) -> tuple:
    """(OUTPUT_PREFIX, suffix, count) of the local shard set named DIR/NAME_text_document: the
    shards DIR/NAME-iiiii-of-nnnnn_text_document.idx found beside it.

    Raises:
        ManifestError: no shard of that name, or shards of different counts.
    """
    folder = os.path.dirname(dataset_prefix) or "."
    name = os.path.basename(dataset_prefix)
    counts, found = set(), None
    try:
        entries = sorted(os.listdir(folder))
    except OSError as e:
        raise ManifestError(f"{dataset_prefix}: cannot list {folder}: {e}") from None
    for entry in entries:
        m = _SHARD_NAME.match(entry)
        if m and f"{m['base']}_{m['rest']}" == name:
            counts.add(int(m["count"]))
            found = (os.path.join(folder, m["base"]), "_" + m["rest"])
    if found is None:
        raise ManifestError(f"{dataset_prefix}: no shard NAME-iiiii-of-nnnnn_... beside it")
    if len(counts) > 1:
        raise ManifestError(f"{dataset_prefix}: shards of sets of different sizes "
                            f"({', '.join(map(str, sorted(counts)))}) share this name; remove "
                            "the stale ones")
    return found[0], found[1], counts.pop()


def write_manifest_of_set(dataset_prefix: str) -> str:
    """Write the manifest of the local shard set named DIR/NAME_text_document (its shards found
    beside it, `find_set`); returns its path. For `merge_datasets.py --manifest-only`.

    Raises:
        ManifestError: no shard of that name, a missing shard, shards that disagree.
    """
    base, suffix, count = find_set(dataset_prefix)
    return write_manifest(base, suffix, count)

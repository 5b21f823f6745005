"""Whole checkpoints on object storage for the offline tools (`convert_checkpoint.py --load
s3://...`, `--inspect s3://...`, `--to megatron s3://...`, `python -m megatron.generate --load
s3://... --prompt-load s3://...`): the tools read local folders, so a checkpoint is downloaded
whole into a node-local staging folder laid out as a local one, and a converted folder is
built locally and then uploaded. The trainer's side (one rank's files, the save's commit) is
remote.py and remote_saver.py; this module reuses their RemoteFolder.

- `find_checkpoint`: before anything starts, the tracker's iteration (or the one asked for),
  its meta.json and a HEAD of every object of meta.json's manifest (`file_sizes`): a missing or
  truncated object, a missing tracker and refused credentials are found here, each one message
  naming the key (the tools exit 2). A checkpoint without a manifest (a weights checkpoint of
  convert_checkpoint.py, or a folder copied up by hand) is taken as its folder's listing.
- `download`: that iteration's objects in parallel (the data's ranged GETs, each file to a
  temporary name, then renamed), each checked against its size in the manifest, with meta.json
  and the tracker as they are on the server; `download_checkpoint` does both.
- `upload_checkpoint`: a local checkpoint folder to s3://BUCKET/PREFIX as the trainer commits
  a save: every file uploaded and confirmed (HEAD, its size), then meta.json with the manifest,
  then the tracker objects last, so a failed upload changes nothing --load reads.
- `Staged`: the folders a tool downloaded or built, removed when it ends.

Credentials, endpoint and retries are the data's (the `--object-storage-*` flags and the AWS
environment: docs/checkpoints.md "Object storage").
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

from megatron.checkpoint.formats.meta import META
from megatron.checkpoint.io.completeness import MANIFEST
from megatron.checkpoint.io.remote import RemoteFolder, default_staging_path, staging_root
from megatron.checkpoint.layout import DEEPSPEED_LATEST, TRACKER, iteration_folder_name
from megatron.config.training import CheckpointStorage
from megatron.data.storage.object_storage import ObjectStorageError

Needed = Callable[[str], bool]
"""Whether a tool reads the file (a path inside the iteration folder); None: every file."""


@dataclass(frozen=True)
class RemoteCheckpoint:
    """One iteration of a checkpoint on object storage, its objects confirmed."""

    folder: RemoteFolder
    iteration: int
    sizes: Dict[str, int]
    """{path inside the iteration folder: bytes} of the files to download (meta.json aside)."""


def find_checkpoint(url: str, storage: CheckpointStorage, iteration: Optional[int] = None,
                    needed: Optional[Needed] = None) -> RemoteCheckpoint:
    """The checkpoint of `url` (s3://BUCKET/PREFIX, the trainer's --save) at `iteration` (None:
    the tracker's), every object to read confirmed present and of its saved size.

    Raises:
        ObjectStorageError: no checkpoint there, refused credentials, no such bucket, a missing
            or short object (each naming its key)."""
    folder = RemoteFolder(url, storage)
    try:
        if iteration is None:
            iteration = folder.read_tracker()
            if iteration is None:
                have = folder.iterations()
                hint = (f"; it has iteration folders {', '.join(map(str, have[-3:]))}: pass "
                        f"--iteration N to read one" if have else "")
                raise ObjectStorageError(f"{folder.url_of(TRACKER)} is missing: no checkpoint "
                                         f"saved there{hint}")
        tag = iteration_folder_name(iteration)
        text = folder.get_text(f"{tag}/{META}")
    except ValueError as e:  # a tracker naming no iteration
        raise ObjectStorageError(str(e)) from None
    if text is None:
        have = folder.iterations()
        raise ObjectStorageError(f"{folder.url_of(tag + '/' + META)} is missing; the "
                                 f"iterations saved there: {', '.join(map(str, have)) or 'none'}")
    try:
        meta = json.loads(text)
    except ValueError as e:
        raise ObjectStorageError(f"{folder.url_of(tag + '/' + META)}: not JSON ({e})") from None
    manifest = meta.get(MANIFEST)
    if isinstance(manifest, dict):
        sizes = {str(rel): int(size) for rel, size in manifest.items()}
        folder.confirm({f"{tag}/{rel}": size for rel, size in sizes.items()
                        if needed is None or needed(rel)})
    else:  # no manifest: what the listing holds is the checkpoint
        sizes = _listing(folder, tag)
    sizes = {rel: size for rel, size in sorted(sizes.items())
             if rel != META and (needed is None or needed(rel))}
    return RemoteCheckpoint(folder, iteration, sizes)


def _listing(folder: RemoteFolder, tag: str) -> Dict[str, int]:
    """{path inside the folder `tag`: bytes} of its objects."""
    start = len(folder.key(tag)) + 1
    return {key[start:]: size for key, size in folder.sizes(tag).items()}


def download(checkpoint: RemoteCheckpoint, root: Path) -> Path:
    """The checkpoint's files, meta.json and tracker into `root` (replaced), laid out as a
    local checkpoint folder; returns `root`.

    Raises:
        ObjectStorageError: an object that could not be read, or that was not of its saved
            size (naming its key)."""
    if root.exists():
        shutil.rmtree(root)
    tag = iteration_folder_name(checkpoint.iteration)
    local = root / tag
    files = [(f"{tag}/{rel}", local / rel) for rel in [*checkpoint.sizes, META]]
    checkpoint.folder.download_files(files)
    for rel, size in checkpoint.sizes.items():
        found = (local / rel).stat().st_size
        if found != size:  # changed on the server since find_checkpoint looked
            raise ObjectStorageError(f"{checkpoint.folder.url_of(tag + '/' + rel)} has {found} "
                                     f"bytes, the checkpoint's {META} says {size}")
    (root / TRACKER).write_text(f"{checkpoint.iteration}\n", encoding="utf-8")
    (root / DEEPSPEED_LATEST).write_text(tag, encoding="utf-8")
    return root


def download_checkpoint(url: str, storage: CheckpointStorage, iteration: Optional[int] = None,
                        root: Optional[Path] = None, needed: Optional[Needed] = None) -> Path:
    """The checkpoint of `url` at `iteration` (None: the tracker's), downloaded whole (or the
    files `needed` takes) into `root` (default: a folder of this process under
    --checkpoint-staging-path's); returns that local checkpoint folder.

    Raises:
        ObjectStorageError: as find_checkpoint and download."""
    checkpoint = find_checkpoint(url, storage, iteration, needed)
    return download(checkpoint, root or staging_root(storage, url, f"download-{os.getpid()}"))


def prefix_is_empty(url: str, storage: CheckpointStorage) -> bool:
    """Whether no object has a key under s3://BUCKET/PREFIX/ (one listing request).

    Raises:
        ObjectStorageError: the bucket cannot be listed (naming it)."""
    folder = RemoteFolder(url, storage)
    client = folder.objects.client()
    answer = folder._call(f"listing {folder.url}/", lambda: client.list_objects_v2(
        Bucket=folder.bucket, Prefix=folder.key(""), MaxKeys=1))
    return not answer.get("Contents")


def upload_checkpoint(local: Path, url: str, storage: CheckpointStorage,
                      replace: bool = False) -> int:
    """Upload the local checkpoint folder `local` (its tracker's iteration and every file
    beside it) to `url` as the trainer commits a save: the files, confirmed; meta.json with
    their sizes (the manifest --load s3:// checks); the tracker objects last. With `replace`,
    the objects of other iterations and stale objects of this one are deleted after the
    tracker moved. Returns the number of objects written.

    Raises:
        ObjectStorageError: an upload that failed or an object not of its size (naming its key;
            the tracker is then not written); OSError, ValueError: an unreadable local folder."""
    remote = RemoteFolder(url, storage)
    iteration = int((local / TRACKER).read_text(encoding="utf-8").strip())
    tag = iteration_folder_name(iteration)
    skip = {TRACKER, DEEPSPEED_LATEST, f"{tag}/{META}"}
    files = [(str(p), p.relative_to(local).as_posix()) for p in sorted(local.rglob("*"))
             if p.is_file() and p.relative_to(local).as_posix() not in skip]
    sizes = remote.upload_files(files)
    remote.confirm(sizes)
    meta = json.loads((local / tag / META).read_text(encoding="utf-8"))
    meta[MANIFEST] = {rel[len(tag) + 1:]: n for rel, n in sorted(sizes.items())
                      if rel.startswith(tag + "/")}
    staged_meta = local / tag / META
    staged_meta.write_text(json.dumps(meta, indent=1, sort_keys=True), encoding="utf-8")
    remote.upload_files([(str(staged_meta), f"{tag}/{META}")])
    remote.confirm({f"{tag}/{META}": staged_meta.stat().st_size})
    remote.write_tracker(iteration)  # last: the upload is now what --load reads
    if replace:
        remote.prune(1, iteration)
        keep = {remote.key(rel) for rel in [*sizes, f"{tag}/{META}"]}
        remote.delete_keys([k for k in remote._keys(tag) if k not in keep],
                           f"stale objects of {remote.url_of(tag)}/")
    return len(sizes) + 3


class Staged:
    """The node-local folders a tool downloaded checkpoints into or built one in
    (--checkpoint-staging-path), removed by `close` (a `with` block's end)."""

    def __init__(self) -> None:
        self.roots: List[Path] = []

    def folder(self, storage: CheckpointStorage, url: str, what: str) -> Path:
        """A fresh folder of this process for `url` (`what`: "download", "convert"):
        STAGING/WHAT-PID-N/BUCKET/PREFIX, STAGING/WHAT-PID-N removed at the end."""
        name = f"{what}-{os.getpid()}-{len(self.roots)}"
        top = Path(storage.staging_path or default_staging_path()) / name
        if top.exists():
            shutil.rmtree(top)
        root = staging_root(storage, url, name)
        root.parent.mkdir(parents=True, exist_ok=True)
        self.roots.append(top)
        return root

    def download(self, checkpoint: RemoteCheckpoint) -> Path:
        """`checkpoint` downloaded into a fresh folder (download); returns it."""
        remote = checkpoint.folder
        return download(checkpoint, self.folder(remote.storage, remote.url, "download"))

    def close(self) -> None:
        for root in self.roots:
            shutil.rmtree(root, ignore_errors=True)
        self.roots = []

    def __enter__(self) -> "Staged":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["RemoteCheckpoint", "Staged", "download", "download_checkpoint", "find_checkpoint",
           "prefix_is_empty", "upload_checkpoint"]

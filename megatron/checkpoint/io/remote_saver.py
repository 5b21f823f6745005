"""Saves to `--save s3://BUCKET/PREFIX`: the local Saver (saver.py) writing into a node-local
staging folder, with each rank uploading its own files once written and rank 0 publishing the
save (objects confirmed, meta.json, then the tracker) where the local one renames its folder.

Synchronously, a rank's files are uploaded right after they are written, before the ranks agree
on the save; with --async-save the writer thread uploads them after writing them, while training
goes on. Each rank removes its staged files once uploaded, so the staging folder holds one
iteration of a node's files at most. The storage side is remote.py.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch.distributed as dist

from megatron.checkpoint.formats.meta import META, write_meta
from megatron.checkpoint.io.async_save import Files, Writer
from megatron.checkpoint.io.checkpointing import write_atomic
from megatron.checkpoint.io.completeness import MANIFEST
from megatron.checkpoint.io.remote import RemoteFolder, staging_root
from megatron.checkpoint.io.saver import SaveFailed, Saver, _Pending
from megatron.checkpoint.layout import iteration_folder_name
from megatron.config.training import CheckpointStorage
from megatron.data.storage.object_storage import ObjectStorageError

TMP = ".tmp"


class _UploadingWriter(Writer):
    """The background writer, uploading a save's files after writing them (`upload`)."""

    def __init__(self, upload: Callable[[List[str]], None]) -> None:
        super().__init__()
        self._upload = upload

    def submit(self, files: Files) -> None:
        paths = [path for path, _ in files if path is not None]
        super().submit(files + [(None, lambda: self._upload(paths))])


class RemoteSaver(Saver):
    """A Saver whose checkpoints go to the object-storage folder `url` (every method is
    collective, as Saver's)."""

    FAILED_SAVE_LEFT = ("the tracker still names the previous checkpoint (the objects already "
                        "uploaded stay, unread)")

    def __init__(self, step, url: str, layout, device_type: str, flags, model=None,
                 keep_last: Optional[int] = None, async_save: bool = False,
                 timeout_s: float = 1800.0, watchdog=None, kind=None,
                 storage: CheckpointStorage = CheckpointStorage()) -> None:
        self._on_commit = None
        super().__init__(step, str(staging_root(storage, url, "save")), layout, device_type,
                         flags, model, None, async_save, timeout_s, watchdog, kind)
        self.keep_remote = keep_last
        self.remote = RemoteFolder(url, storage)
        self.destination = self.remote.url
        self.uploaded: Dict[int, Dict[str, int]] = {}
        """iteration -> {path inside its folder: bytes} this rank uploaded (not yet committed)."""
        if async_save:
            self.writer.close()
            self.writer = _UploadingWriter(self._upload)

    # the log line names the object folder, not the staging one
    @property
    def on_commit(self):
        return self._on_commit

    @on_commit.setter
    def on_commit(self, call) -> None:
        self._on_commit = None if call is None else (
            lambda path, totals: call(f"{self.remote.url}/{Path(path).name}", totals))

    # this rank's files -----------------------------------------------------------------------
    def _write(self, files, pause: float) -> Optional[str]:
        error = super()._write(files, pause)
        if error is None:
            try:
                self._upload([path for path, _ in files])
            except (ObjectStorageError, OSError) as e:
                return str(e)
        return error

    def _upload(self, paths: List[str]) -> None:
        """Upload this rank's written files of one save (paths under ROOT/iter_N.tmp/) to
        PREFIX/iter_N/, then remove them from the staging folder."""
        pairs, iteration = [], None
        for path in paths:
            parts = Path(path).relative_to(self.root).parts
            tag = parts[0][:-len(TMP)]
            iteration = int(tag[len("iter_"):])
            pairs.append((path, f"{tag}/{'/'.join(parts[1:])}"))
        if iteration is None:
            return
        sizes = self.remote.upload_files(pairs)
        tag = iteration_folder_name(iteration)
        self.uploaded[iteration] = {rel[len(tag) + 1:]: n for rel, n in sizes.items()}
        for path in paths:
            os.unlink(path)

    # the commit ------------------------------------------------------------------------------
    def _commit_agreed(self, pending: _Pending, barrier: bool = False):
        """Every rank's files are uploaded: rank 0 confirms them and moves the tracker (every
        rank learns whether it could); then the local bookkeeping of Saver."""
        gathered: List[Optional[Dict[str, int]]] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self.uploaded.pop(pending.iteration, {}),
                               group=self.group)
        sizes = {k: v for part in gathered for k, v in (part or {}).items()}
        problem: List[Optional[str]] = [None]
        tmp = self.root / (iteration_folder_name(pending.iteration) + TMP)
        if dist.get_rank() == 0:
            try:
                self._publish(tmp, pending, sizes)
            except (ObjectStorageError, OSError, ValueError) as e:
                problem[0] = str(e)
            shutil.rmtree(tmp, ignore_errors=True)
        dist.broadcast_object_list(problem, src=0, group=self.group)
        if problem[0] is not None:
            raise SaveFailed(f"saving iteration {pending.iteration} to {self.remote.url} failed "
                             f"({problem[0]}); the tracker still names the previous checkpoint")
        return super()._commit_agreed(pending, barrier)

    def _publish(self, tmp: Path, pending: _Pending, sizes: Dict[str, int]) -> None:
        tag = iteration_folder_name(pending.iteration)
        # files written beside DeepSpeed's checkpoint engine (the pipeline's layer table,
        # DeepSpeed's zero_to_fp32.py) by rank 0: every rank's own are uploaded and gone
        extras = [(str(p), f"{tag}/{p.relative_to(tmp).as_posix()}")
                  for p in sorted(tmp.rglob("*")) if p.is_file() and p.name != META]
        sizes = {**sizes, **{rel[len(tag) + 1:]: n
                             for rel, n in self.remote.upload_files(extras).items()}}
        # DeepSpeed's own scripts, which it copies beside the iteration folders (zero_to_fp32.py,
        # zero_to_torch.py): kept under PREFIX as in a local folder, not in the staging one
        scripts = [p for p in sorted(self.root.iterdir()) if p.is_file() and p.suffix == ".py"]
        self.remote.upload_files([(str(p), p.name) for p in scripts])
        for p in scripts:
            p.unlink()
        self.remote.confirm({f"{tag}/{rel}": n for rel, n in sizes.items()})
        meta = {**pending.meta, "saved_at": time.strftime("%Y-%m-%d %H:%M:%S"),
                MANIFEST: dict(sorted(sizes.items()))}
        tmp.mkdir(parents=True, exist_ok=True)
        write_meta(tmp, meta, self.kind, write=write_atomic)
        self.remote.upload_files([(str(tmp / META), f"{tag}/{META}")])
        self.remote.write_tracker(pending.iteration)  # last: the save is now the one loaded
        try:  # housekeeping: the save stands whatever happens here
            self.remote.abort_incomplete_uploads()
            if self.keep_remote is not None:
                self.remote.prune(self.keep_remote, pending.iteration)
        except (ObjectStorageError, OSError) as e:
            if self.on_warning is not None:
                self.on_warning(f"warning: iteration {pending.iteration} is saved, but removing "
                                f"old objects from {self.remote.url} failed ({e}); the next "
                                f"save tries again")

    def _commit(self, tmp: Path, final: Path, pending: _Pending) -> None:
        pass  # published by _commit_agreed; nothing stays in the staging folder

    def discard(self) -> List[int]:
        doomed = super().discard()
        for iteration in doomed:
            self.uploaded.pop(iteration, None)
        return doomed

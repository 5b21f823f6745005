"""`preprocess_data.py --output-prefix s3://bucket/key`: the destination checked writable before
any work, the outputs written to a local staging folder (`--staging-dir`) by the local run, then
uploaded (each `.bin`, then its `.meta.json` sidecar, then its `.idx`)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from typing import Callable, Optional

from megatron.data.storage import object_storage
from megatron.data.storage.object_storage import ObjectStorage


def run_to_object_storage(args: argparse.Namespace, run: Callable[[argparse.Namespace], int],
                          storage: Optional[ObjectStorage] = None) -> int:
    """--output-prefix s3://...: preprocess into a node-local staging folder (atomic as for
    local output), then upload each dataset's .bin, then its sidecar, then its .idx
    (multipart), so that a reader never finds an index without its data; the staging folder is
    removed either way, and a failed upload removes what it had put. The destination is checked
    writable before anything is tokenized. `storage`: what uploads (None: the default
    settings)."""
    storage = storage if storage is not None else ObjectStorage()
    remote = args.output_prefix
    try:
        object_storage.split_url(remote)
    except ValueError as e:
        print(f"error: --output-prefix {e}", file=sys.stderr)
        return 2
    root = args.staging_dir or os.path.join(object_storage.default_cache_path(), "staging")
    try:
        os.makedirs(root, exist_ok=True)
        staging = tempfile.mkdtemp(prefix="preprocess-", dir=root)
    except OSError as e:
        print(f"error: --staging-dir {root}: {e}", file=sys.stderr)
        return 2
    try:
        try:
            _check_writable(storage, remote, staging)
        except (object_storage.ObjectStorageError, OSError) as e:
            print(f"error: --output-prefix {remote} is not writable: {e}; nothing was done",
                  file=sys.stderr)
            return 2
        local = os.path.join(staging, os.path.basename(remote))
        code = run(argparse.Namespace(**{**vars(args), "output_prefix": local}))
        if code != 0:
            return code
        # every .bin, then the sidecars, then the indices (and the report): an .idx marks a
        # complete dataset
        names = sorted(os.listdir(staging), key=lambda n: (
            0 if n.endswith(".bin") else 1 if n.endswith(".meta.json") else 2, n))
        uploaded = []
        try:
            for name in names:
                target = remote + name[len(os.path.basename(remote)):]
                storage.upload(os.path.join(staging, name), target)
                uploaded.append(target)
                print(f"uploaded {target}", file=sys.stderr)
        except (object_storage.ObjectStorageError, OSError) as e:
            for target in reversed(uploaded):
                try:
                    storage.delete(target)
                except object_storage.ObjectStorageError:  # best effort: the error below
                    pass
            print(f"error: {e}; nothing was left under {remote}", file=sys.stderr)
            return 1
        return 0
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _check_writable(storage: ObjectStorage, remote: str, staging: str) -> None:
    """Put and delete an empty probe object beside `remote` (a missing bucket, refused
    credentials or a read-only key raise ObjectStorageError before any work)."""
    probe = os.path.join(staging, ".write-check")
    open(probe, "wb").close()
    target = f"{remote}.write-check-{os.getpid()}"
    try:
        storage.upload(probe, target)
        storage.delete(target)
    finally:
        os.unlink(probe)

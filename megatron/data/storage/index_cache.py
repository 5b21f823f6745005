"""Index caches: numpy arrays built once, memory-mapped by every rank afterwards.

A cache entry is a directory of `.npy` files plus `manifest.json`, named by a hash of everything
the arrays depend on (the `description`), so a change of any input gives a new entry instead of a
stale one. Many ranks on many nodes may start at once:

- the first takes a lock (a file created with O_EXCL, which works on NFS and Lustre, holding its
  host, pid and what it builds), builds under a temporary directory and renames it into place;
- the others wait, printing what they wait for, up to `timeout` seconds, then read the result;
- a lock left by a dead process on this host is broken; one from another host is broken after
  `stale_after` seconds without progress.

A manifest that does not match its files (truncated copy, partial rsync, old format) is detected
and the entry rebuilt. This module knows nothing of torch.distributed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import sys
import time
from typing import Callable, Dict, Optional

import numpy as np

FORMAT_VERSION = 1


class CacheTimeout(TimeoutError):
    """Waited too long for another process to build a cache entry."""


def description_hash(description: dict) -> str:
    text = json.dumps({"format": FORMAT_VERSION, **description}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:20]


def _load(entry: str) -> Optional[Dict[str, np.ndarray]]:
    """The arrays of a complete, consistent entry (memory-mapped), or None."""
    try:
        with open(os.path.join(entry, "manifest.json"), encoding="utf-8") as f:
            manifest = json.load(f)
        arrays = {}
        for name, meta in manifest["arrays"].items():
            path = os.path.join(entry, f"{name}.npy")
            if os.path.getsize(path) != meta["bytes"]:
                return None
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
            if list(arr.shape) != meta["shape"] or str(arr.dtype) != meta["dtype"]:
                return None
            arrays[name] = arr
        return arrays
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write(entry: str, arrays: Dict[str, np.ndarray], description: dict) -> None:
    tmp = f"{entry}.tmp-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        meta = {}
        for name, arr in arrays.items():
            path = os.path.join(tmp, f"{name}.npy")
            np.save(path, np.ascontiguousarray(arr), allow_pickle=False)
            meta[name] = {"shape": list(arr.shape), "dtype": str(arr.dtype),
                          "bytes": os.path.getsize(path)}
        with open(os.path.join(tmp, "manifest.json"), "w", encoding="utf-8") as f:
            json.dump({"description": description, "arrays": meta}, f, indent=1, default=str)
        shutil.rmtree(entry, ignore_errors=True)  # an inconsistent old entry
        os.rename(tmp, entry)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class _Lock:
    def __init__(self, path: str, what: str, timeout: float, stale_after: float, log) -> None:
        self.path, self.what, self.timeout, self.stale_after, self.log = (
            path, what, timeout, stale_after, log)

    def try_acquire(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump({"host": socket.gethostname(), "pid": os.getpid(), "what": self.what,
                       "since": time.time()}, f)
        return True

    def holder(self) -> dict:
        try:
            with open(self.path, encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def is_stale(self) -> bool:
        info = self.holder()
        if info.get("host") == socket.gethostname() and isinstance(info.get("pid"), int):
            try:
                os.kill(info["pid"], 0)
                return False
            except ProcessLookupError:
                return True
            except PermissionError:
                return False
        try:
            return time.time() - os.path.getmtime(self.path) > self.stale_after
        except OSError:
            return False

    def release(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def cached_arrays(cache_dir: str, name: str, description: dict,
                  build: Callable[[], Dict[str, np.ndarray]], timeout: float = 3600.0,
                  stale_after: float = 600.0, log=None) -> Dict[str, np.ndarray]:
    """The arrays `build()` makes for `description`, from the cache when possible.

    Args:
        cache_dir: where entries live (created if missing).
        name: a readable stem for the entry (e.g. the dataset name); the hash is appended.
        description: everything the arrays depend on (paths, sizes, mtimes, seeds, lengths).
        build: makes the arrays; runs in at most one process at a time per entry.
        timeout: seconds to wait for another process's build before raising CacheTimeout.
        stale_after: seconds after which a lock from another host counts as abandoned.
        log: callable for progress messages (default: print to stderr).

    Returns:
        name -> read-only memory-mapped array.
    """
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    os.makedirs(cache_dir, exist_ok=True)
    entry = os.path.join(cache_dir, f"{name}-{description_hash(description)}")
    arrays = _load(entry)
    if arrays is not None:
        return arrays
    lock = _Lock(entry + ".lock", f"{name} index cache", timeout, stale_after, log)
    start = last_note = time.time()
    while True:
        if lock.try_acquire():
            try:
                arrays = _load(entry)  # someone may have finished while we looked
                if arrays is None:
                    if os.path.isdir(entry):
                        log(f"index cache {entry} is incomplete or stale: rebuilding it")
                    t0 = time.time()
                    _write(entry, build(), description)
                    log(f"built index cache {entry} in {time.time() - t0:.1f} s")
                    arrays = _load(entry)
                    if arrays is None:
                        raise OSError(f"index cache {entry} could not be read back after writing")
                return arrays
            finally:
                lock.release()
        arrays = _load(entry)
        if arrays is not None:
            return arrays
        if lock.is_stale():
            log(f"breaking the abandoned lock {lock.path} ({lock.holder()})")
            lock.release()
            continue
        waited = time.time() - start
        if waited > timeout:
            raise CacheTimeout(
                f"waited {waited:.0f} s for {lock.path} (held by {lock.holder()}) to build the "
                f"index cache {entry}; raise the timeout, or prebuild with "
                "data_tools/build_indices.py")
        if time.time() - last_note > 30:
            log(f"waiting for {lock.holder() or 'another process'} to build {entry} "
                f"({waited:.0f} s so far)")
            last_note = time.time()
        time.sleep(0.1)

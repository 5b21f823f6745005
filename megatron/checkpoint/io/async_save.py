"""The files of a save, taken from DeepSpeed and written by us: synchronously, or in the background.

DeepSpeed's engine writes each checkpoint file through its checkpoint engine's `save(state_dict,
path)`, between barriers of its own. `Capture` stands in for that engine while a save runs and
keeps the (path, object) pairs instead of writing them; `Writer` then writes them (torch.save,
each file flushed and fsynced), so that:

- A failed write (ENOSPC, EIO) raises on the rank that saw it, outside DeepSpeed's barriers, and
  the ranks agree on it (checkpointing.py) instead of leaving the others waiting in a barrier.
- With `--async-save` the objects are snapshots (`snapshot`: every tensor copied off the
  device, into pinned host buffers kept from one save to the next on CUDA; a copy on CPU), the
  step returns once they are taken, and a persistent writer thread writes them while training
  goes on. A thread, not a process: the snapshot is already in host memory that a thread can
  read in place, where a process would need a second copy (or shared memory) of the whole
  state; torch.save spends its time writing tensor bytes, and the training thread spends its
  time in torch operators, which both release the GIL (bench/bench_checkpoint.py measures
  what the step still loses).
"""

from __future__ import annotations

import copy
import os
import queue
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

Files = List[Tuple[str, Any]]
"""(path, object to torch.save there), in the order DeepSpeed produced them."""


class Capture:
    """DeepSpeed's checkpoint-engine interface, keeping what it is asked to save.

    snapshot: copy every tensor (async saves; DeepSpeed is then told not to clone, since the
        snapshot is a compact copy already); without it the live objects are kept, to be written
        before training resumes (DeepSpeed clones views of flat buffers itself, as always)."""

    def __init__(self, real, snapshot_with: Optional[Callable[[Any], Any]] = None) -> None:
        self.real = real
        self.name = "megatron-capture"
        self.snapshot_with = snapshot_with
        self.files: Files = []

    def create(self, info) -> None:
        pass

    def save(self, state_dict, path: str) -> None:
        obj = self.snapshot_with(state_dict) if self.snapshot_with else state_dict
        self.files.append((str(path), obj))

    def makedirs(self, path, exist_ok=False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def load(self, path: str, map_location=None):
        return self.real.load(path, map_location=map_location)

    def commit(self, info) -> bool:
        return True

    def is_data_parallel_writer(self, dp_rank) -> bool:
        return self.real.is_data_parallel_writer(dp_rank)

    def is_decoupled(self) -> bool:
        return False

    def set_commit_info(self, info) -> None:
        pass

    def get_commit_info(self):
        return None

    def cleanup(self) -> None:
        pass

    def preserves_storage_sharing(self) -> bool:
        return self.snapshot_with is None


class HostBuffers:
    """Host copies of the state's tensors, reused from one save to the next: pinned for device
    tensors (the copies run at full bandwidth and need one synchronisation at the end); for host
    tensors (CPU training, offloaded optimizer states) a buffer already faulted in copies about
    twice as fast as a fresh allocation. They stay allocated between saves: one copy of the
    state in host memory."""

    def __init__(self) -> None:
        self._buffers: Dict[int, torch.Tensor] = {}
        self._next = 0

    def start(self) -> None:
        self._next = 0

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        key, self._next = self._next, self._next + 1
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype,
                                 pin_memory=tensor.device.type == "cuda")
            self._buffers[key] = buffer
        buffer.copy_(tensor, non_blocking=tensor.device.type == "cuda")
        return buffer


def snapshot(obj: Any, buffers: HostBuffers) -> Any:
    """`obj` with every tensor copied (containers rebuilt, other values deep-copied)."""
    if torch.is_tensor(obj):
        return buffers.copy(obj)
    if isinstance(obj, dict):
        return type(obj)((k, snapshot(v, buffers)) for k, v in obj.items())
    if isinstance(obj, list):
        return [snapshot(v, buffers) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(snapshot(v, buffers) for v in obj)
    return copy.deepcopy(obj)


class _Recorded:
    """A file whose first OSError is kept: torch's zip writer turns it into a RuntimeError that
    no longer says what happened ('unexpected pos ...'), so `write_file` raises the original."""

    def __init__(self, f) -> None:
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self.f.flush()


def write_file(path: str, obj: Any) -> int:
    """torch.save, flushed to the disk before returning; the file's size.

    Without the zip records' CRC-32s (torch.serialization.set_crc32_options(False)): computing
    them took a third of a save's writing time (bench/RESULTS.md, "checkpoint"); torch.load
    does not check them, and the files are fsynced; a file cut short is still found at --load
    by its zip directory (checkpointing.damaged_file).

    Raises:
        OSError: ENOSPC, EIO, ... as the file system said it (torch's own error otherwise)."""
    torch.serialization.set_crc32_options(False)
    with open(path, "wb") as f:
        recorded = _Recorded(f)
        try:
            torch.save(obj, recorded)
            f.flush()
        except RuntimeError:
            if recorded.error is not None:
                raise recorded.error from None
            raise
        os.fsync(f.fileno())
        return f.tell()


class Writer:
    """A persistent background thread writing one save's files at a time."""

    def __init__(self) -> None:
        self._jobs: "queue.Queue[Optional[Files]]" = queue.Queue()
        self._done = threading.Event()
        self._done.set()
        self.error: Optional[str] = None
        self.current: Optional[str] = None
        """The file being written (for the watchdog's message)."""
        self.bytes = 0
        self.seconds = 0.0
        """The last save's bytes and writing time (this rank)."""
        self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def submit(self, files: Files) -> None:
        if not self._done.is_set():
            raise RuntimeError("a save is still being written")
        self.error = None
        self._done.clear()
        self._jobs.put(files)

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self._done.wait(timeout)

    def _run(self) -> None:
        while True:
            files = self._jobs.get()
            if files is None:
                return
            start, self.bytes = time.monotonic(), 0
            for i, (path, obj) in enumerate(files):
                self.current = path
                try:
                    if path is None and callable(obj):  # a step after the files: the
                        self.current = "the upload to object storage"  # upload (remote_saver)
                        obj()
                        continue
                    if path is None:  # the tests' pause (checkpointing.TEST_PAUSE_ENV), as if
                        self.current = files[i + 1][0] if i + 1 < len(files) else None
                        time.sleep(obj)  # the next file's write were slow
                        continue
                    self.bytes += write_file(path, obj)
                except Exception as e:  # noqa: BLE001
                    self.error = f"{path}: {type(e).__name__}: {e}" if path else str(e)
                    break
            self.seconds = time.monotonic() - start
            self.current = None
            del files
            self._done.set()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)

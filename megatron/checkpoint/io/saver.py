"""Saving a run's checkpoints: synchronously, or with `--async-save` in the background.

The commit protocol is checkpointing.py's: every rank's files go to `iter_N.tmp/`, each file is
flushed to the disk, and only when every rank's files are durable does rank 0 write meta.json,
rename the folder to `iter_N` and move the tracker; `--keep-last` then removes older ones.

A save takes DeepSpeed's files as (path, object) pairs (async_save.Capture) and writes them
itself (async_save.Writer), so that:

- **Failures are agreed on.** A write that fails (ENOSPC, EIO, ...) on any rank fails the save on
  every rank: the partial `iter_N.tmp/` is removed, the previous checkpoint and the tracker are
  untouched, and `SaveFailed` is raised. The loop then goes on with a warning and tries again
  at the next interval; a failed final save (the end, an exit condition, a stop signal) ends the
  run with exit 1, since nothing would try again.
- **`--async-save`.** The save blocks only while the state is copied off the device; a
  persistent writer thread writes the files. At every step boundary `poll` asks, over a gloo
  group of its own (one small all-reduce; on GPUs the NCCL streams are not touched), whether
  every rank's writer is done, and commits when they are. The next save, the final save, an exit
  condition and a stop signal first `finish` the outstanding one. A writer stuck in I/O for
  longer than `--checkpoint-timeout-minutes` fails the run with a message naming the file.
- **Held saves.** With the divergence guard (divergence.py), a save made with `hold=True` is
  written and agreed on as usual but stays `iter_N.tmp/`, the tracker unmoved, until the loop
  calls `confirm` (the next step passed the guard's checks: the folder is renamed and the tracker
  moves, in order of iteration) or `discard` (the guard stopped the run: the held folders are
  removed). A process killed meanwhile leaves the tracker on the last confirmed checkpoint.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.checkpoint.formats.meta import CheckpointKind, write_meta
from megatron.checkpoint.io.async_save import HostBuffers, Writer, snapshot, write_file
from megatron.checkpoint.io.checkpointing import (
    CheckpointError,
    fsync_dir,
    pause_for_tests,
    prune,
    rng_state,
    write_atomic,
)
from megatron.checkpoint.io.completeness import MANIFEST, manifest
from megatron.checkpoint.layout import ITERATION_PREFIX, iteration_folder_name, write_tracker


class SaveFailed(CheckpointError):
    """A save that did not complete on some rank; the previous checkpoint stands."""


@dataclass
class _Pending:
    iteration: int
    meta: Dict[str, Any]
    started: float
    blocked_s: float = 0.0
    """How long the save held the training step (capture, copies; synchronous: the writing)."""
    waited_s: float = 0.0
    """How long it first waited for the outstanding asynchronous save."""
    capture_s: float = 0.0
    """DeepSpeed's state dicts taken (and, asynchronous, copied off the device)."""
    bytes: int = 0
    written_s: float = 0.0
    began: float = 0.0
    """When `save` was called (a synchronous save holds the step until its commit)."""
    confirmed: bool = True
    """False while the divergence guard has not yet passed the step after it (`hold`)."""
    totals: Optional[List[float]] = None
    """[bytes, writing seconds] summed over the ranks, once agreed."""
    held: bool = False
    """It waited, written, for `confirm`."""


class Saver:
    """Saves checkpoints of one run into `save_dir` (every method is collective)."""

    FAILED_SAVE_LEFT = ("the partial folder is removed and the previous checkpoint stays the one "
                        "the tracker names")
    """What a failed save's message says is left."""

    def __init__(self, step, save_dir: str, layout: Dict[str, int], device_type: str,
                 flags: Dict[str, Any], model: Optional[Dict[str, Any]] = None,
                 keep_last: Optional[int] = None, async_save: bool = False,
                 timeout_s: float = 1800.0, watchdog=None,
                 kind: Optional[CheckpointKind] = None) -> None:
        self.step, self.root, self.layout = step, Path(save_dir), layout
        self.destination = str(save_dir)
        """Where the checkpoints go, as the messages name it (remote_saver.py: the s3:// URL)."""
        self.kind = kind
        """What the checkpoints are (meta.json's "checkpoint" section; formats/meta.py)."""
        self.device_type, self.flags, self.model = device_type, flags, model
        self.keep_last, self.timeout_s, self.watchdog = keep_last, timeout_s, watchdog
        self.writer = Writer() if async_save else None
        self.buffers = HostBuffers() if async_save else None
        self.pending: Optional[_Pending] = None
        self.held: List[_Pending] = []
        """Saves written and agreed on, waiting for `confirm` (oldest first)."""
        self.on_commit = None
        """Called with the folder and `last` of each committed save (the log line)."""
        self.last: Optional[Dict[str, Any]] = None
        """The last committed save: iteration, bytes (all ranks), written_s (the ranks' mean
        time writing), blocked_s (rank 0's step held), waited_s, capture_s, async."""
        self.on_warning = None
        """Called with the message of an asynchronous save that failed (the log line)."""
        self.group = None
        if async_save:  # the commit agreement: gloo, whatever the training backend
            self.group = dist.new_group(backend="gloo") \
                if dist.get_backend() != "gloo" else dist.group.WORLD

    # the save ------------------------------------------------------------------------------
    def save(self, iteration: int, consumed_samples: int, lr_state: Dict[str, Any],
             hold: bool = False) -> Optional[Path]:
        """Save `iteration`: its folder once committed (synchronous), or None while its files are
        being written in the background (asynchronous; `poll` commits it) or while it is held
        (`hold`: committed by `confirm`, removed by `discard`). A save without `hold` (the
        final one) confirms the held ones first, so that the tracker never moves back.

        Raises:
            SaveFailed: this save failed on some rank (an earlier asynchronous one that failed
                is reported through `on_warning`, and this one goes ahead)."""
        began = time.monotonic()
        if not hold:
            self.confirm()
        try:
            self.finish()
        except SaveFailed as e:
            self._warn(e)
        waited = time.monotonic() - began
        rank = dist.get_rank()
        tmp = self.root / (iteration_folder_name(iteration) + ".tmp")
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            keep = {iteration_folder_name(p.iteration) + ".tmp" for p in self.held}
            for stale in self.root.glob(f"{ITERATION_PREFIX}*.tmp"):
                if stale.name not in keep:
                    shutil.rmtree(stale, ignore_errors=True)
        dist.barrier()
        snapshot_with = None
        if self.writer is not None:
            self.buffers.start()
            snapshot_with = lambda obj: snapshot(obj, self.buffers)  # noqa: E731
        captured = time.monotonic()
        files = self.step.capture(self.root, tmp.name, iteration, snapshot_with)
        (tmp / "rng").mkdir(parents=True, exist_ok=True)
        files.append((str(tmp / "rng" / f"rank_{rank:05d}.pt"), rng_state(self.device_type)))
        if self.writer is not None and self.device_type == "cuda":
            torch.cuda.synchronize()  # the copies into the pinned buffers
        meta = {"iteration": iteration, "consumed_samples": consumed_samples,
                "layout": self.layout, "world_size": dist.get_world_size(),
                "lr_schedule": lr_state, "flags": self.flags}
        if self.model is not None:
            meta["model"] = self.model
        self.pending = pending = _Pending(iteration, meta, time.monotonic(), waited_s=waited,
                                          capture_s=time.monotonic() - captured, began=began,
                                          confirmed=not hold)
        pause = pause_for_tests(iteration)
        if self.writer is not None:
            if pause:
                files.insert(0, (None, pause))
            self.writer.submit(files)
            pending.blocked_s = time.monotonic() - began
            return None
        written = time.monotonic()
        error = self._write(files, pause)
        pending.written_s = time.monotonic() - written
        return self._agree(error, not_done=False, group=None)

    def _write(self, files, pause: float) -> Optional[str]:
        for path, obj in files:
            try:
                if self.watchdog is not None:
                    with self.watchdog.watch(f"checkpoint I/O: writing {path}", self.timeout_s):
                        self.pending.bytes += write_file(path, obj)
                else:
                    self.pending.bytes += write_file(path, obj)
            except Exception as e:  # noqa: BLE001 - ENOSPC, EIO, ...: agreed on below
                return f"{path}: {type(e).__name__}: {e}"
        if pause:
            time.sleep(pause)
        return None

    # the asynchronous side -----------------------------------------------------------------
    def poll(self) -> Optional[Path]:
        """At a step boundary: commit the outstanding asynchronous save if every rank's files
        are written (its folder), else None; never waits for a writer. A failed save is
        reported through `on_warning` (the next save tries again)."""
        if self.pending is None or self.writer is None:
            return None
        stuck = not self.writer.done() and \
            time.monotonic() - self.pending.started > self.timeout_s
        try:
            return self._agree(self.writer.error, not self.writer.done(), self.group, stuck)
        except SaveFailed as e:
            self._warn(e)
            return None

    def _warn(self, error: SaveFailed) -> None:
        if self.on_warning is not None:
            self.on_warning(f"warning: {error}; trying again at the next save")

    def finish(self) -> Optional[Path]:
        """Wait for the outstanding asynchronous save and commit it (its folder, or None when
        there was none)."""
        if self.pending is None or self.writer is None:
            return None
        left = self.timeout_s - (time.monotonic() - self.pending.started)
        done = self.writer.wait(max(left, 0.0))
        return self._agree(self.writer.error, False, self.group, stuck=not done)

    # held saves ----------------------------------------------------------------------------
    def confirm(self) -> List[Path]:
        """The divergence guard passed the step after every save so far: commit the held ones
        (oldest first; the tracker ends on the newest) and let the outstanding asynchronous one
        commit when it is written. Returns the committed folders. Every rank calls it at the
        same step; the file operations are rank 0's."""
        if self.pending is not None:
            self.pending.confirmed = True
        done = []
        held, self.held = self.held, []
        for pending in held:
            done.append(self._commit_agreed(pending))
        return done

    def discard(self) -> List[int]:
        """The run stops at a divergence: the outstanding asynchronous save is finished (committed
        if confirmed), then every save that is not confirmed is removed; the tracker and the
        confirmed checkpoints are untouched. Returns the iterations removed. Collective (a
        barrier, so that no rank still writes into a folder rank 0 removes)."""
        try:
            self.finish()
        except SaveFailed as e:
            self._warn(e)
        doomed, self.held = self.held, []
        dist.barrier()
        if dist.get_rank() == 0:
            for p in doomed:
                shutil.rmtree(self.root / (iteration_folder_name(p.iteration) + ".tmp"),
                              ignore_errors=True)
        return [p.iteration for p in doomed]

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    # agreement and commit ------------------------------------------------------------------
    def _agree(self, error: Optional[str], not_done: bool, group, stuck: bool = False
               ) -> Optional[Path]:
        flags = torch.tensor([float(not_done), float(error is not None), float(stuck)],
                             device="cpu" if group is not None else _device(self.device_type))
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        not_done, failed, stuck = (bool(v) for v in flags.tolist())
        pending = self.pending
        if stuck:
            where = self.writer.current if self.writer is not None else None
            raise CheckpointError(
                f"saving iteration {pending.iteration} to {self.destination}: a rank's checkpoint "
                f"writer made no progress for {self.timeout_s / 60:g} minutes"
                + (f" (this rank: still writing {where})" if where and not self.writer.done()
                   else "") + " (--checkpoint-timeout-minutes)")
        if not_done:
            return None
        self.pending = None
        tmp = self.root / (iteration_folder_name(pending.iteration) + ".tmp")
        if failed:
            if dist.get_rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            mine = f" (this rank: {error})" if error else ""
            raise SaveFailed(f"saving iteration {pending.iteration} to {self.destination} failed "
                             f"on some rank{mine}; {self.FAILED_SAVE_LEFT}",
                             rank_local=error is not None)
        if self.writer is not None:
            pending.bytes, pending.written_s = self.writer.bytes, self.writer.seconds
        totals = torch.tensor([float(pending.bytes), pending.written_s], dtype=torch.float64,
                              device=flags.device)
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=group)
        pending.totals = totals.tolist()
        if not pending.confirmed:  # written everywhere; committed by confirm()
            if group is None:
                pending.blocked_s = time.monotonic() - pending.began
            pending.held = True
            self.held.append(pending)
            return None
        final = self._commit_agreed(pending, barrier=group is None)
        return final

    def _commit_agreed(self, pending: _Pending, barrier: bool = False) -> Path:
        """Rank 0 commits a save every rank has written (barrier: the others wait for it, and
        the step's hold time includes the commit)."""
        tmp = self.root / (iteration_folder_name(pending.iteration) + ".tmp")
        final = self.root / iteration_folder_name(pending.iteration)
        if dist.get_rank() == 0:
            self._commit(tmp, final, pending)
        if barrier:
            dist.barrier()
            pending.blocked_s = time.monotonic() - pending.began  # the commit held it too
        self.last = {"iteration": pending.iteration, "bytes": int(pending.totals[0]),
                     "written_s": pending.totals[1] / dist.get_world_size(),
                     "blocked_s": pending.blocked_s, "waited_s": pending.waited_s,
                     "capture_s": pending.capture_s,
                     "async": self.writer is not None, "held": pending.held}
        if self.on_commit is not None:
            self.on_commit(final, self.last)
        return final

    def _commit(self, tmp: Path, final: Path, pending: _Pending) -> None:
        # every rank's files are written: their sizes let a load name a file cut short later
        meta = {**pending.meta, "saved_at": time.strftime("%Y-%m-%d %H:%M:%S"),
                MANIFEST: manifest(tmp)}
        write_meta(tmp, meta, self.kind, write=write_atomic)
        for folder, _, _ in os.walk(tmp):  # the files are durable (each writer fsynced its
            fsync_dir(Path(folder))       # own); now their directory entries
        if final.exists():  # saving the same iteration again: keep the old one until the swap
            old = final.with_name(final.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        fsync_dir(self.root)
        write_tracker(self.root, pending.iteration, write=write_atomic)
        if self.keep_last is not None:
            prune(self.root, self.keep_last)


def _device(device_type: str) -> torch.device:
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

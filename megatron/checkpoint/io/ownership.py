"""One writer per checkpoint folder, and workers that do not outlive their launcher.

Found by trying it: SIGKILL to `torchrun` leaves its workers running (the elastic agent starts
each worker in a session of its own), and they go on training and saving into `--save` while a
resubmitted job writes the same folder. Two guards:

- `SaveLock`: the job holds `SAVE/writer.lock` (JSON: host, pid, the process's start time, job id,
  when it started) from before it loads until it ends; rank 0 takes it, and a heartbeat thread
  touches it every `HEARTBEAT_S` seconds. A second job that finds a live holder is refused before
  it starts (`lock_problems`, run by every rank with the other flag checks), naming the
  holder. A holder is dead when, on this host, its pid is gone or belongs to another process
  (start time), or, on another host, its heartbeat is older than `STALE_S`; the next job takes
  a dead holder's lock over with a warning.
- `watch_launcher`: a worker started by torchrun checks once a second that its parent is still
  the launcher; when the launcher is gone it exits at once (exit `EXIT_ORPHANED`), writing
  nothing more: a checkpoint it was writing stays an `iter_N.tmp` folder, which the next save
  removes, and the tracker still names the last complete one. (A worker started by srun is
  ended by slurmstepd itself; one started by hand from a shell is not watched, so that nohup
  and a closed terminal keep working as before.)
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

LOCK = "writer.lock"
HEARTBEAT_S = 30.0
STALE_S = 180.0
EXIT_ORPHANED = 4


class SaveLockError(RuntimeError):
    """Another live job holds the folder (the message names it)."""


def _start_time(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), which
    tells a reused pid from the holder; None where /proc has no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def job_id(env=os.environ) -> Optional[str]:
    for key in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "LSB_JOBID", "PBS_JOBID"):
        if env.get(key):
            return f"{key}={env[key]}"
    return None


def describe(holder: Dict[str, Any]) -> str:
    job = f", job {holder['job']}" if holder.get("job") else ""
    return (f"host {holder.get('host')}, pid {holder.get('pid')}{job}, since "
            f"{holder.get('started')}")


def read_holder(save_dir: os.PathLike) -> Optional[Dict[str, Any]]:
    """The lock's holder, with 'alive' (bool) and 'age_s' (seconds since its heartbeat); None
    without a lock. An unreadable lock file (a holder cut off while writing it) is dead."""
    path = Path(save_dir) / LOCK
    try:
        age = time.time() - path.stat().st_mtime
        holder = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(holder, dict):
            raise ValueError("not an object")
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        return {"alive": False, "age_s": 0.0, "host": "?", "pid": "?",
                "started": f"(unreadable lock: {e})"}
    if holder.get("host") == socket.gethostname():
        pid = holder.get("pid")
        start = _start_time(pid) if isinstance(pid, int) else None
        alive = start is not None and start == holder.get("pid_start")
    else:
        alive = age < STALE_S
    return {**holder, "alive": alive, "age_s": age}


def lock_problems(save_dir: Optional[str]) -> List[str]:
    """A live job holding `save_dir`. Checked with the other flags by every rank, before any
    process group exists, so that all ranks of a second job are refused at once, with the same
    message. (This job's own rank 0 takes the lock only after every rank has joined the process
    group, i.e. after every rank has passed this check.)"""
    if save_dir is None or not Path(save_dir).is_dir():
        return []
    holder = read_holder(save_dir)
    if holder is None or not holder["alive"]:
        return []
    return [f"--save {save_dir} is being written by another job ({describe(holder)}; "
            f"{Path(save_dir) / LOCK}): two jobs writing one checkpoint folder overwrite each "
            f"other's checkpoints; stop that job or give another --save"]


class SaveLock:
    """`SAVE/writer.lock`, held by this process until `release`."""

    def __init__(self, save_dir: os.PathLike) -> None:
        self.path = Path(save_dir) / LOCK
        self.mine = {"host": socket.gethostname(), "pid": os.getpid(),
                     "pid_start": _start_time(os.getpid()), "job": job_id(),
                     "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        self.took_over: Optional[Dict[str, Any]] = None
        """The dead holder whose lock this one replaced (None: the folder was free)."""
        self.created_folder = False
        """Whether `acquire` made the folder (`release` removes it again while it is empty)."""
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def acquire(self) -> "SaveLock":
        """Take the lock (creating the folder); a dead holder's lock is taken over.

        Raises:
            SaveLockError: a live holder, or another job that took it at the same moment."""
        self.created_folder = not self.path.parent.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        mine = self.path.with_name(f"{LOCK}.{self.mine['host']}.{os.getpid()}")
        mine.write_text(json.dumps(self.mine), encoding="utf-8")
        try:
            try:
                os.link(mine, self.path)  # atomic, and exclusive also on NFS
            except FileExistsError:
                holder = read_holder(self.path.parent)
                if holder is not None and holder["alive"]:
                    raise SaveLockError(lock_problems(str(self.path.parent))[0]) from None
                self.took_over = holder
                os.replace(mine, self.path)
                time.sleep(0.2)  # two jobs taking over at once: the last rename wins
                if self._current() != self.mine:
                    raise SaveLockError(f"{self.path}: another job took this folder at the "
                                        f"same moment ({describe(self._current() or {})})")
        finally:
            mine.unlink(missing_ok=True)
        self._thread = threading.Thread(target=self._beat, name="save-lock", daemon=True)
        self._thread.start()
        return self

    def _current(self) -> Optional[Dict[str, Any]]:
        try:
            return json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:  # the folder went away: the next save says so
                pass

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still this process's; remove the
        folder too when `acquire` made it and nothing was written into it (a run that failed
        before its first save leaves no trace)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._current() == self.mine:
            self.path.unlink(missing_ok=True)
            if self.created_folder:
                try:
                    self.path.parent.rmdir()  # only if empty
                except OSError:
                    pass


def watch_launcher(env=os.environ, poll_s: float = 1.0) -> Optional[threading.Thread]:
    """Under torchrun, end this worker (exit EXIT_ORPHANED) within `poll_s` of its launcher's
    death; returns the watching thread (None: not started by torchrun)."""
    if not env.get("TORCHELASTIC_RUN_ID"):
        return None
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                message = (f"\nrank {env.get('RANK', '?')}: the launcher (pid {parent}) is "
                           f"gone; exiting without saving (exit {EXIT_ORPHANED})\n")
                try:  # never block on a pipe nobody reads any more: exiting comes first
                    os.set_blocking(sys.stderr.fileno(), False)
                    os.write(sys.stderr.fileno(), message.encode())
                except (OSError, ValueError):
                    pass
                finally:
                    os._exit(EXIT_ORPHANED)

    thread = threading.Thread(target=watch, name="launcher-watch", daemon=True)
    thread.start()
    return thread

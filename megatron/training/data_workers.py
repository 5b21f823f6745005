"""The data loaders' worker processes: how they take the job's signals, and how a rank ends them.

A rank starts its DataLoader workers and must end them itself, on every path: when it is done,
after a save at a signal, after an error. Two facts make that necessary:

- the workers ignore the stop signals (`data_worker_init`: a SIGTERM or SIGUSR1 from the
  launcher is the rank's to handle, which saves first);
- at interpreter exit, multiprocessing's exit handler sends SIGTERM to every daemonic child
  still running and then joins it. A worker that ignores SIGTERM is never joined, and the rank
  hangs in that handler until the scheduler's time limit (a loader whose iterator was not shut
  down before exit: one held by a traceback, a persistent evaluation loader, DeepSpeed's
  pipeline engine holding the data iterator).

So `StoppableLoader.close` shuts its iterators' workers down the ordinary way (their index
queues get the end marker), and `end_processes` SIGKILLs and reaps whatever is left;
`reap_daemonic_children` does the same at exit for any worker nobody closed (the entry point
registers it with atexit, after multiprocessing's own handler was registered, so that it runs
first).
"""

from __future__ import annotations

import ctypes
import functools
import multiprocessing
import os
import signal
import sys
import weakref
from typing import Iterable, List

import torch

from megatron.training.signals import STOP_SIGNALS

JOIN_S = 5.0
"""How long a worker gets to leave after its end marker or a SIGKILL."""


def data_worker_init(worker_id: int, rank_pid: int) -> None:  # noqa: ARG001
    """`worker_init_fn` of the training data loaders (bind `rank_pid`, the rank's `os.getpid()`,
    with functools.partial): a stop signal is the rank's to handle.

    torchrun stops its workers with `killpg` (SIGTERM to the rank's whole process group) and
    Slurm signals every process of a job step, so the loader's worker processes receive the
    same SIGTERM / SIGUSR1 as their rank. By default they would die of it (torch's worker
    handler re-raises a SIGTERM that its parent did not send; SIGUSR1's default action ends a
    process), and the rank would fail with "DataLoader worker ... is killed by signal" before it
    could save. Here they ignore both and leave the decision to the rank, which saves at its
    next step boundary and then ends its workers (this module's docstring). A worker also dies
    with its rank (Linux: the parent-death signal), so that none outlives a rank that was killed
    outright. (A signal that arrives between the worker's start and this call stays pending:
    a StoppableLoader starts its workers with the stop signals blocked, and unblocks them after
    this call, when they are ignored.)
    """
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    _die_with(rank_pid)


def _init_then_unblock(init, worker_id: int) -> None:
    """A StoppableLoader worker's `worker_init_fn`: the loader's own (`data_worker_init` ignores
    the stop signals), then the stop signals unblocked (a pending one is then discarded if
    ignored, or acted on as before)."""
    try:
        if init is not None:
            init(worker_id)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def _die_with(parent: int) -> None:
    """SIGKILL this process when its parent exits (prctl PR_SET_PDEATHSIG; Linux only); exit at
    once if the parent is gone already. torch's workers notice a dead parent themselves too,
    but only every few seconds."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:
        os._exit(0)


def end_processes(processes: Iterable) -> None:
    """SIGKILL and reap each multiprocessing process of `processes` that is still running (a
    worker ignores SIGTERM, so `terminate` would not do)."""
    alive = [p for p in processes if p.is_alive()]
    for p in alive:
        try:
            p.kill()
        except (OSError, ValueError):  # gone meanwhile, or already closed
            pass
    for p in alive:
        p.join(JOIN_S)


def reap_daemonic_children() -> None:
    """End this process's daemonic multiprocessing children (DataLoader workers are; nothing
    else this project starts is a process). Registered with atexit by the entry point."""
    end_processes([p for p in multiprocessing.active_children() if p.daemon])


class StoppableLoader(torch.utils.data.DataLoader):
    """A DataLoader whose worker processes `close()` ends, whoever still holds its iterators."""

    def __init__(self, *args, **kwargs) -> None:
        if kwargs.get("num_workers", 0) > 0:  # (see __iter__)
            kwargs["worker_init_fn"] = functools.partial(_init_then_unblock,
                                                         kwargs.get("worker_init_fn"))
        super().__init__(*args, **kwargs)
        self._opened: List[weakref.ref] = []

    def __iter__(self):
        # Workers start with the stop signals blocked (a forked child inherits the mask) until
        # their `worker_init_fn` has run: torch's worker loop installs, before that function, a
        # SIGTERM handler that ends a worker for a signal its parent did not send, so the
        # launcher's SIGTERM to the process group, arriving while a loader starts its workers
        # (an evaluation loader at the first evaluation), would kill one and fail the rank
        # instead of letting it save. Blocked here only in this thread; the rank's handler
        # still gets the signal (another thread takes it, or this one once unblocked).
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            iterator = super().__iter__()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        self._opened.append(weakref.ref(iterator))
        return iterator

    def close(self) -> None:
        """Shut down every iterator's workers (torch's own shutdown: the end marker, a join),
        then kill and reap those that did not leave."""
        for ref in self._opened:
            iterator = ref()
            workers = list(getattr(iterator, "_workers", ()))
            shutdown = getattr(iterator, "_shutdown_workers", None)  # multi-process only
            if shutdown is not None:
                shutdown()
            end_processes(workers)
        self._opened.clear()
        self._iterator = None  # a persistent loader's cached iterator

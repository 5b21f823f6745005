"""Stop cleanly when the scheduler asks: SIGTERM (preemption, `scancel`) or SIGUSR1 (Slurm's
`--signal=USR1@120` warning before the time limit).

The handler only records the signal. The loop asks `stop_requested()` at each step boundary,
where one all-reduce (MAX over all ranks) makes every rank agree, so that all of them save the
same checkpoint and leave together; a rank that acted alone would leave its peers waiting in the
next collective.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Dict, Optional

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignals:
    """Installs the handlers on enter, restores the previous ones on exit."""

    def __init__(self, signals=STOP_SIGNALS) -> None:
        self.signals = signals
        self.received: Optional[int] = None
        self._previous: Dict[int, object] = {}

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - the signal module's signature
        if self.received is None:
            self.received = signum

    def __enter__(self) -> "StopSignals":
        for sig in self.signals:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (an embedding caller): signals stay theirs
                pass
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else ""



def data_worker_init(worker_id: int, rank_pid: int) -> None:  # noqa: ARG001
    """`worker_init_fn` of the training data loaders (bind `rank_pid`, the rank's `os.getpid()`,
    with functools.partial): a stop signal is the rank's to handle.

    torchrun stops its workers with `killpg` (SIGTERM to the rank's whole process group) and
    Slurm signals every process of a job step, so the loader's worker processes receive the
    same SIGTERM / SIGUSR1 as their rank. By default they would die of it (torch's worker
    handler re-raises a SIGTERM that its parent did not send; SIGUSR1's default action ends a
    process), and the rank would fail with "DataLoader worker ... is killed by signal" before it
    could save. Here they ignore both and leave the decision to the rank, which saves at its
    next step boundary and then ends its loaders. A worker also dies with its rank (Linux: the
    parent-death signal), so that none outlives a rank that was killed outright. (A signal that
    arrives between the worker's start and this call finds the rank's own handler, inherited
    through fork, which only records it.)
    """
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    _die_with(rank_pid)


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

"""Failures a run reports in one message and exit status 1, without a traceback.

A checkpoint that cannot be read or written, a step whose loss or gradient norm is not finite,
data that cannot feed the run: these are expected, and the user needs one line saying what to
do, not a traceback per rank. Most are found alike by every rank (they read the same files, or
agreed through a collective): rank 0 reports them for the job and the other ranks stay silent.
One that only some ranks found (`rank_local`: this rank's shard of a checkpoint is damaged, say)
is reported by each of those ranks, naming itself.
"""

from __future__ import annotations

import os
import sys
from typing import Optional


class RunFailure(RuntimeError):
    """An expected failure of a running job (see the module docstring)."""

    def __init__(self, message: str, rank_local: bool = False) -> None:
        super().__init__(message)
        self.rank_local = rank_local


class DataError(RunFailure):
    """The data cannot feed this run."""


def report_failure(error: RunFailure, rank: int, log_file: Optional[str] = None) -> None:
    """Say once what stopped the job: printed on stderr and appended to `log_file` by rank 0
    when every rank found it, by each finding rank, with its rank, when `error.rank_local`."""
    if error.rank_local:
        line = f"error (rank {rank}): {error}"
    elif rank == 0:
        line = f"error: {error}"
    else:
        return
    print(line, file=sys.stderr, flush=True)
    append_to_log(log_file, line)


def append_to_log(log_file: Optional[str], text: str, only_if_exists: bool = False) -> None:
    """Append `text` to the run's --log-file, a copy of what stderr said (`only_if_exists`: not
    where the file is not there yet: a job refused at start leaves no file behind, but a
    requeued run's log says why it stopped)."""
    if log_file is None or (only_if_exists and not os.path.isfile(log_file)):
        return
    try:
        with open(log_file, "a", encoding="utf-8") as f:
            f.write(text + "\n")
    except OSError:  # the message reached stderr; the log is a copy
        pass

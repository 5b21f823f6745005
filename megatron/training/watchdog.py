"""End a rank that stops making progress, saying what it waited for.

A dead or stopped peer leaves the others blocked in a collective; a stuck shared file system
blocks the data loader or a checkpoint write; none of these raise. The loop wraps each phase in
`watchdog.watch(what, seconds)`; a background thread checks the deadline once a second and, when
one passes, prints which rank waited for what and for how long, every thread's Python stack
(faulthandler), and ends the process with EXIT_HANG, so that the launcher (torchrun, srun
--kill-on-bad-exit) takes the whole job down instead of letting it idle until the time limit.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
from typing import Iterator, Optional

from megatron.failures import RunFailure

EXIT_HANG = 3


class Watchdog:
    def __init__(self, rank: int, poll_s: float = 1.0) -> None:
        self.rank = rank
        self.place = ""
        """Where the rank sits, once the groups exist (' (pipeline stage 1 of 4, ...)')."""
        self.poll_s = poll_s
        self._what: Optional[str] = None
        self._deadline = float("inf")
        self._timeout = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def watch(self, what: str, timeout_s: Optional[float]) -> Iterator[None]:
        """Within the block, `what` must finish in `timeout_s` seconds (None: no limit)."""
        with self._lock:
            outer = (self._what, self._deadline, self._timeout)
            if timeout_s is not None:
                self._what, self._timeout = what, timeout_s
                self._deadline = time.monotonic() + timeout_s
        try:
            yield
        except Exception as e:  # say which phase failed: a backend error names only a peer
            # (an expected failure is reported once, for the job: megatron/failures.py)
            if not getattr(e, "_phase_reported", False) and not isinstance(e, RunFailure):
                sys.stderr.write(f"rank {self.rank}{self.place}: failed while waiting for "
                                 f"{what}: {type(e).__name__}: {e}\n")
                sys.stderr.flush()
                with contextlib.suppress(AttributeError):
                    e._phase_reported = True
            raise
        finally:
            with self._lock:
                self._what, self._deadline, self._timeout = outer

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                expired = time.monotonic() > self._deadline
                what, timeout = self._what, self._timeout
            if expired:
                self._expire(what, timeout)

    def _expire(self, what: str, timeout: float) -> None:
        # Whatever happens to the output (a closed pipe, a full one nobody reads, a full disk),
        # the process must end: stderr is made non-blocking, so a write fails instead of waiting.
        try:
            os.set_blocking(sys.stderr.fileno(), False)
            sys.stderr.write(f"\nrank {self.rank}{self.place}: no progress for {timeout:g} s "
                             f"while waiting for {what}; ending this process (exit {EXIT_HANG}). Python "
                             f"stacks:\n")
            sys.stderr.flush()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
        except BaseException:  # noqa: BLE001
            pass
        finally:
            os._exit(EXIT_HANG)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class NoWatchdog:
    """The same interface, watching nothing (for callers that embed the loop)."""

    @contextlib.contextmanager
    def watch(self, what: str, timeout_s: Optional[float]) -> Iterator[None]:
        yield

    def close(self) -> None:
        pass

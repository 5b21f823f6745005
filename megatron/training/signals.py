"""Stop cleanly when the scheduler asks: SIGTERM (preemption, `scancel`) or SIGUSR1 (Slurm's
`--signal=USR1@120` warning before the time limit).

The handler only records the signal. The loop asks `stop_requested()` at each step boundary,
where one all-reduce (MAX over all ranks) makes every rank agree, so that all of them save the
same checkpoint and leave together; a rank that acted alone would leave its peers waiting in the
next collective.
"""

from __future__ import annotations

import signal
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


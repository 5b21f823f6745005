"""Standard output that holds one document only, so that `python -m megatron.plan --json | jq`
works: every other line a command prints belongs on stderr.

Our own notes already go there; the libraries a command imports are the risk. DeepSpeed's logger
writes to stdout through a handler it makes when deepspeed is imported
(deepspeed/utils/logging.py: `StreamHandler(stream=sys.stdout)`), and the import itself logs the
accelerator it picked (deepspeed/accelerator/real_accelerator.py: "Setting accelerator to CPU
..." on a machine without CUDA). Nothing is silenced here: such lines move to stderr.

    with logs_to_stderr():
        result = compute()          # imports, warnings, prints: all on stderr
    print(json.dumps(result))       # the document, alone on stdout
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Iterator, List


def _stream_handlers_on(stream) -> List[logging.StreamHandler]:
    loggers = [logging.getLogger()] + [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)]
    return [h for lg in loggers for h in lg.handlers
            if isinstance(h, logging.StreamHandler) and h.stream is stream]


@contextlib.contextmanager
def logs_to_stderr() -> Iterator[None]:
    """Inside the block, what is written to stdout goes to stderr: `print`, `sys.stdout.write`,
    the logging handlers already bound to stdout (moved back on leaving) and those made inside
    (they keep stderr: a library imported inside logs to stderr from then on).

    Python-level only: a C extension writing to file descriptor 1 is not redirected.
    """
    stdout = sys.stdout
    moved = _stream_handlers_on(stdout)
    for handler in moved:
        handler.setStream(sys.stderr)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        for handler in moved:
            handler.setStream(stdout)

"""`python -m megatron.torchrun ARGS`: torchrun (`torch.distributed.run`, the same ARGS) whose
exit status is its workers' (launch/torchrun.sh runs it).

torchrun itself ends in exit 1 whenever a worker fails, with a `ChildFailedError` traceback
and report, whatever status the worker chose: a refused command line (2) read as a crash (1).
Here the first failed worker's status is torchrun's (a worker killed by signal N: 128 + N, as a
shell says it), after one line naming the rank; the worker's own lines above say why
(docs/troubleshooting.md, "Exit statuses"). Everything else is torchrun's: its options, its
signal handling (a SIGTERM or Ctrl-C reaching torchrun still ends it in exit 1, which
docs/slurm.md describes), its restarts.
"""

from __future__ import annotations

import socket
import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    # torch is imported here: `python -m megatron.torchrun --help` is torchrun's own
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        run(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        status = failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
        how = f"exited with status {failure.exitcode}" if failure.exitcode > 0 else \
            f"was killed by signal {-failure.exitcode}"
        print(f"torchrun: rank {rank} (local rank {failure.local_rank} on {socket.gethostname()}) "
              f"{how}: the job ends with status {status} (the rank's own lines above say why)",
              file=sys.stderr, flush=True)
        return status
    return 0


if __name__ == "__main__":
    sys.exit(main())

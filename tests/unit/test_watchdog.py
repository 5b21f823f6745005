"""The watchdog ends a process that stops making progress, naming what it waited for, with every
thread's stack; and leaves one that keeps its deadlines alone."""

import subprocess
import sys
import time

from megatron.training.watchdog import EXIT_HANG, Watchdog

SCRIPT = """
import time
from megatron.training.watchdog import Watchdog
w = Watchdog(rank=5, poll_s=0.05)
with w.watch("the outer phase", 30):
    with w.watch("collective: a stuck all-reduce", 0.3):
        time.sleep(30)
print("not reached")
"""


def test_a_stuck_phase_ends_the_process_with_its_name_and_stacks():
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=60)
    assert time.monotonic() - start < 20
    assert proc.returncode == EXIT_HANG
    assert "rank 5: no progress for 0.3 s while waiting for collective: a stuck all-reduce" \
        in proc.stderr
    assert "Thread" in proc.stderr and "time.sleep" not in proc.stdout
    assert "not reached" not in proc.stdout


def test_deadlines_met_and_restored():
    w = Watchdog(rank=0, poll_s=0.01)
    try:
        with w.watch("outer", 5):
            for _ in range(3):
                with w.watch("inner", 0.5):
                    time.sleep(0.05)
            assert w._what == "outer"  # the outer deadline is back after the inner block
        with w.watch("unlimited", None):
            time.sleep(0.05)
        assert w._what is None
    finally:
        w.close()


def test_a_failing_phase_is_named_once(capsys):
    w = Watchdog(rank=2, poll_s=0.01)
    try:
        try:
            with w.watch("the outer phase", 5):
                with w.watch("collective: an all-reduce", 5):
                    raise RuntimeError("Connection closed by peer [10.0.0.2]:1234")
        except RuntimeError:
            pass
        else:
            raise AssertionError("the error must propagate")
    finally:
        w.close()
    err = capsys.readouterr().err
    assert err.count("rank 2: failed while waiting for") == 1
    assert "collective: an all-reduce: RuntimeError: Connection closed by peer" in err

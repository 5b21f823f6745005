"""A rank ends its data-loader workers itself (megatron/training/data_workers.py): they ignore
SIGTERM, so a loader nobody shut down held its rank in multiprocessing's exit handler forever."""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap

import torch

from megatron.training.data_workers import StoppableLoader, data_worker_init


class Numbers(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> int:
        return i


def loader(workers: int, persistent: bool = False) -> StoppableLoader:
    return StoppableLoader(Numbers(), batch_size=4, num_workers=workers,
                           persistent_workers=persistent,
                           worker_init_fn=functools.partial(data_worker_init,
                                                            rank_pid=os.getpid()))


def test_close_ends_workers_that_ignore_sigterm():
    data = loader(2)
    it = iter(data)
    # a batch from each worker: both have run data_worker_init
    assert [next(it).tolist(), next(it).tolist()] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    workers = list(it._workers)
    for w in workers:  # what multiprocessing's exit handler sends: ignored
        os.kill(w.pid, signal.SIGTERM)
    # Batches 0-5 were asked for before the signals (the loader keeps prefetch_factor = 2
    # batches a worker in flight), batches 6 and 7 (one a worker) after them: each worker
    # served a request it received after its signal.
    assert [next(it).tolist()[0] for _ in range(6)] == [8, 12, 16, 20, 24, 28]
    assert all(w.is_alive() for w in workers)
    data.close()  # the iterator is still held here, as a traceback or an engine would
    assert not any(w.is_alive() for w in workers)
    assert all(w.exitcode is not None for w in workers)  # reaped


def _init_when_told(worker_id: int, rank_pid: int, started, go) -> None:
    """data_worker_init once `go` is set; `started` gets the worker id first. Torch's own
    SIGTERM handler is in place from before this call."""
    started.put(worker_id)
    assert go.wait(timeout=120), "the test never said go"
    data_worker_init(worker_id, rank_pid)


def test_a_sigterm_while_the_workers_start_is_the_ranks():
    """The launcher's SIGTERM to the process group can reach a worker that has started but not
    yet run data_worker_init (an evaluation loader's first iter()): it must not end the worker
    (torch's handler would), and the rank's own signal mask is left as it was."""
    started, go = multiprocessing.Queue(), multiprocessing.Event()
    data = StoppableLoader(Numbers(), batch_size=4, num_workers=2,
                           worker_init_fn=functools.partial(_init_when_told, rank_pid=os.getpid(),
                                                            started=started, go=go))
    it = iter(data)
    assert not set(signal.pthread_sigmask(signal.SIG_BLOCK, [])) & {signal.SIGTERM,
                                                                    signal.SIGUSR1}
    assert sorted(started.get(timeout=120) for _ in it._workers) == [0, 1]  # both in their init
    for w in it._workers:
        os.kill(w.pid, signal.SIGTERM)
    go.set()
    assert [b.tolist()[0] for b in it] == list(range(0, 64, 4))  # every batch, no worker lost
    data.close()


def test_close_ends_a_persistent_loaders_workers_and_it_starts_anew():
    data = loader(1, persistent=True)
    assert [b.tolist()[0] for b in data][:2] == [0, 4]
    workers = list(data._iterator._workers)
    data.close()
    assert not any(w.is_alive() for w in workers)
    assert [b.tolist()[0] for b in data][:2] == [0, 4]  # a later epoch starts new workers
    data.close()


def test_a_process_with_an_open_loader_exits():
    """The hang itself, in a child process: an iterator left open at interpreter exit (held by
    a module global), whose workers ignore SIGTERM. With the rank's reaper registered as the
    entry point does, the process exits; without, multiprocessing's handler would join forever
    (bounded here by the timeout, which fails the test)."""
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_data_workers import loader
        from megatron.training.data_workers import reap_daemonic_children
        import atexit
        atexit.register(reap_daemonic_children)
        data = loader(2)
        held = iter(data)
        print(next(held).tolist(), flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[0, 1, 2, 3]"

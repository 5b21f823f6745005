"""Run a function on N real processes joined by a gloo process group, and collect results.

Workers are started with the 'forkserver' method, the heavy imports preloaded ('spawn' where
CUDA is: `_context`); each initializes torch.distributed over a rendezvous file, runs
`target(rank, world_size, *args)`, and sends back what it returns (or its traceback). The parent raises if any rank
failed, died or timed out, so assertions can live in the test and compare against a
single-process reference computed there.
"""

from __future__ import annotations

import io
import os
import queue
import socket
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    """A port nothing listens on now (the kernel's choice), for a launcher's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "numpy", "deepspeed",
           "megatron.pretrain_t5", "megatron.generate")
"""Imported once by the fork server (`_context`); each worker forks from it with them loaded
instead of importing them again (seconds of CPU per process, most of a small test's time).
torch._dynamo is imported by the first optimizer a process builds (torch.optim's
`_disable_dynamo`): 3.3 of a tiny 4-step training run's 4.3 s in a fresh process."""
_CONTEXT = None


def _context():
    """The 'forkserver' start method with PRELOAD loaded: a fresh interpreter's state (no
    inherited threads, locks or test-process globals), without the imports a 'spawn' repeats.
    With CUDA, 'spawn' as before: DeepSpeed's import probes the accelerator, and a process
    forked from one that touched the CUDA driver cannot use it."""
    global _CONTEXT
    if _CONTEXT is None:
        if torch.cuda.is_available():
            _CONTEXT = mp.get_context("spawn")
        else:
            _CONTEXT = mp.get_context("forkserver")
            _CONTEXT.set_forkserver_preload(list(PRELOAD))
    return _CONTEXT


def _entry(target, rank, world_size, init_file, args, results, environ=None):
    import torch.distributed as dist

    if environ is not None:  # the test's environment now, not the fork server's at its start
        os.environ.clear()
        os.environ.update(environ)
    torch.set_num_threads(1)
    # What torchrun would set; DeepSpeed reads them.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size)
        try:
            value = target(rank, world_size, *args)
        finally:
            from megatron import parallel_state
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
        # Tensors go through a queue as shared memory that dies with this process: send bytes.
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - the parent reports it
        results.put((rank, False, traceback.format_exc()))


def _collect(procs, results, timeout):
    out, failures = {}, []
    deadline = time.monotonic() + timeout
    while len(out) + len(failures) < len(procs):
        try:
            rank, ok, value = results.get(timeout=1.0)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:  # died without reporting (killed, or failed while starting)
                failures.append(f"ranks {dead} exited with codes "
                                f"{[procs[r].exitcode for r in dead]} without a result")
                break
            if time.monotonic() > deadline:
                failures.append(f"timed out after {timeout:.0f} s; finished: {sorted(out)}")
                break
            continue
        if ok:
            out[rank] = torch.load(io.BytesIO(value), weights_only=True)
        else:
            failures.append(f"rank {rank}:\n{value}")
    return out, failures


def run_workers(world_size: int, target, *args, timeout: float = 300.0) -> list:
    """[target's return value for rank 0, 1, ...]; raises AssertionError naming failed ranks."""
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_entry, args=(target, r, world_size, init_file, args,
                                                  results, dict(os.environ)), daemon=True)
                 for r in range(world_size)]
        for proc in procs:
            proc.start()
        try:
            out, failures = _collect(procs, results, timeout)
        finally:
            for proc in procs:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
    if failures:
        raise AssertionError("distributed workers failed:\n" + "\n".join(failures))
    return [out[r] for r in range(world_size)]

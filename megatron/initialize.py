"""Start the distributed job: read the launcher's environment, pick the device, join the process
group, make the tensor / pipeline / data groups and seed every generator.

Launchers: torchrun, `python -m torch.distributed.launch` and the deepspeed launcher set RANK,
WORLD_SIZE, LOCAL_RANK (or pass --local_rank / --local-rank), MASTER_ADDR and MASTER_PORT. `srun`
with one task per device sets SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID and SLURM_NODELIST: the
first host of the node list (from `scontrol show hostnames`) is the master, and the port is
derived from SLURM_JOB_ID so that jobs sharing a node do not collide. A plain `python -m` is a
world of one, and without MASTER_PORT its store listens on a port the kernel picks, so that two
such runs on one host never collide (`start_process_group`). A MASTER_PORT in use is one line
naming it (`PortInUse`), not a traceback.
"""

from __future__ import annotations

import datetime
import inspect
import os
import random
import subprocess
from typing import Dict, List, Mapping, MutableMapping, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from megatron import parallel_state
from megatron.config import ParallelConfig, RuntimeConfig
from megatron.tensor_parallel.random import model_parallel_seed


def distributed_env(env: MutableMapping[str, str], local_rank_flag=None) -> Dict[str, str]:
    """RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT for this process (MASTER_PORT 0:
    none given to a run without a launcher; its store takes a free one)."""
    out = {}
    if "RANK" in env and "WORLD_SIZE" in env:
        out.update(RANK=env["RANK"], WORLD_SIZE=env["WORLD_SIZE"])
        out["LOCAL_RANK"] = env.get("LOCAL_RANK", str(local_rank_flag or 0))
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        out.update(RANK=env["SLURM_PROCID"], WORLD_SIZE=env["SLURM_NTASKS"],
                   LOCAL_RANK=env.get("SLURM_LOCALID", "0"))
        if "MASTER_ADDR" not in env:
            out["MASTER_ADDR"] = first_slurm_host(env.get("SLURM_NODELIST", "localhost"))
        if "MASTER_PORT" not in env:
            out["MASTER_PORT"] = str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000)
    else:
        out.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK=str(local_rank_flag or 0))
        # 0: the store binds a port the kernel picks (start_process_group)
        out["MASTER_PORT"] = env.get("MASTER_PORT", "0")
    if local_rank_flag is not None:
        out["LOCAL_RANK"] = str(local_rank_flag)
    out.setdefault("MASTER_ADDR", env.get("MASTER_ADDR", "127.0.0.1"))
    out.setdefault("MASTER_PORT", env.get("MASTER_PORT", "29500"))
    return out


class PortInUse(RuntimeError):
    """MASTER_PORT is taken on this host: the message names it and says what to do."""


def launcher_of(env: Mapping[str, str]) -> str:
    """Who started this process: 'torchrun' (or torch.distributed.launch, or deepspeed's: RANK
    and WORLD_SIZE), 'srun', or '' (a plain `python`). Read before `distributed_env`'s values
    are put into the environment."""
    if "RANK" in env and "WORLD_SIZE" in env:
        return "torchrun"
    return "srun" if "SLURM_PROCID" in env and "SLURM_NTASKS" in env else ""


def start_process_group(backend: str, timeout: datetime.timedelta, launcher: str,
                        **extra) -> None:
    """torch's default process group for this process, from the environment
    `distributed_env` set (and, without a launcher or MASTER_PORT, sets here); `launcher`:
    `launcher_of` the environment before that.

    A plain `python` without MASTER_PORT: the store is made here on port 0, which the kernel
    binds to a free port in the same call (no window in which another process could take a
    port chosen before it is bound, as a probe of port 0 would leave); MASTER_PORT is then set
    to it, for what reads it later. Otherwise env://, which binds MASTER_PORT on rank 0 (or,
    under torchrun, joins the launcher's own store).

    Raises:
        PortInUse: rank 0 could not listen on MASTER_PORT.
    """
    env = os.environ
    if not launcher and env["MASTER_PORT"] == "0" and env["WORLD_SIZE"] == "1":
        store = dist.TCPStore(env.get("MASTER_ADDR", "127.0.0.1"), 0, 1, is_master=True,
                              timeout=timeout, wait_for_workers=False)
        env["MASTER_PORT"] = str(store.port)
        dist.init_process_group(backend=backend, store=store, rank=0, world_size=1,
                                timeout=timeout, **extra)
        return
    try:
        dist.init_process_group(backend=backend, init_method="env://", timeout=timeout,
                                **extra)
    except RuntimeError as e:
        if "EADDRINUSE" not in str(e) and "address already in use" not in str(e):
            raise
        how = {"": ", or unset it: a run without a launcher then takes a free one",
               "srun": " (without it, srun's ranks take 20000 + SLURM_JOB_ID % 20000)"
               }.get(launcher, "")
        raise PortInUse(f"MASTER_PORT {env['MASTER_PORT']} is in use on {env['MASTER_ADDR']} "
                        f"(another job or run listens there): set MASTER_PORT to a free "
                        f"port{how}") from None


def first_slurm_host(nodelist: str) -> str:
    try:
        hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True,
                               capture_output=True, text=True, timeout=60).stdout.split()
        return hosts[0] if hosts else "localhost"
    except (OSError, subprocess.SubprocessError):
        return nodelist.split(",")[0]


def choose_device(requested_backend: Optional[str]) -> Tuple[str, str, List[str]]:
    """(device type, process-group backend, warnings): CUDA with NCCL where a GPU is visible,
    else the CPU with gloo; `--distributed-backend nccl` without CUDA falls back to gloo."""
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if requested_backend is None:
        return device_type, "nccl" if device_type == "cuda" else "gloo", []
    if requested_backend == "nccl" and device_type == "cpu":
        return device_type, "gloo", ["--distributed-backend nccl: no CUDA device here; using gloo"]
    return device_type, requested_backend, []


def initialize_distributed(runtime: RuntimeConfig, parallel: ParallelConfig) -> bool:
    """`join_process_group`, then `join_deepspeed`: the whole start of a rank's distributed
    side. Returns what `join_process_group` returns."""
    created = join_process_group(runtime, parallel)
    join_deepspeed()
    return created


def join_process_group(runtime: RuntimeConfig, parallel: ParallelConfig) -> bool:
    """Join (or reuse) torch's process group and build the parallel groups; nothing costly.

    DeepSpeed is not involved yet (`join_deepspeed`): its communication backend builds (or
    loads) a compiled op first, which a job that is about to be refused (its --save is another
    job's, megatron/checkpoint/io/ownership.py) should not wait for.

    Returns:
        True when this call created the process group (the caller destroys it at exit).
    Raises:
        PortInUse: MASTER_PORT is taken (`start_process_group`).
        RuntimeError: the launcher started another number of processes than the flags were
            checked for.
    """
    created = False
    if not dist.is_initialized():
        launcher = launcher_of(os.environ)
        os.environ.update(distributed_env(os.environ, runtime.local_rank))
        extra = {}
        if runtime.device_type == "cuda":
            local = int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count()
            torch.cuda.set_device(local)
            # bound as DeepSpeed binds it (eager NCCL setup, groups split from the world's)
            if int(os.environ["WORLD_SIZE"]) > 1 and \
                    "device_id" in inspect.signature(dist.init_process_group).parameters:
                extra["device_id"] = torch.device("cuda", local)
        # The backend's own timeout is a backstop: the watchdog (same limit) fires first and
        # says what the rank waited for.
        minutes = 2 * runtime.distributed_timeout_minutes + 1
        start_process_group(runtime.distributed_backend,
                            datetime.timedelta(minutes=minutes), launcher, **extra)
        created = True
    if dist.get_world_size() != parallel.world_size:
        raise RuntimeError(f"the launcher started {dist.get_world_size()} processes but the "
                           f"flags were checked for {parallel.world_size}")
    parallel_state.initialize_model_parallel(parallel.tensor_model_parallel_size,
                                             parallel.pipeline_model_parallel_size,
                                             parallel.expert_model_parallel_size)
    return created


def join_deepspeed() -> None:
    """DeepSpeed's communication backend on the process group already joined (a no-op when it
    has one)."""
    # DeepSpeed is imported where it runs: its import takes seconds and logs on stdout
    import deepspeed

    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)


def set_seeds(seed: int, device_type: str) -> None:
    """The same seed on every rank for the default generators (so every rank draws the same
    initial weights); the tensor-parallel stream differs per tensor rank."""
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    model_parallel_seed(seed, device_type, parallel_state.get_tensor_model_parallel_rank())
    if device_type == "cuda":
        torch.cuda.manual_seed(seed)

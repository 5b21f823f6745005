"""The launch scripts under a real single-node Slurm (see conftest.py): sbatch -> srun -> torchrun
with two training processes, srun alone with one task per process, and a preemption warning
(SIGUSR1) that makes the trainer save, exit 0 and resume from the saved step."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Dict

import pytest

from launching import TINY, losses, read, reference_losses, tail

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "launch/slurm/pretrain_t5.sbatch"
SRUN = REPO / "launch/slurm/srun_per_device.sh"

pytestmark = pytest.mark.slow


def tiny_env(cluster, data, out: Path, **extra: str) -> Dict[str, str]:
    """launch/examples/tiny_cpu.sh's environment, pointed at the test cluster (one thread per
    process, as the reference runs of tests/launch/launching.py have)."""
    return {**cluster.env, "DATA": data.prefix, "TOKENIZER": data.spm,
            "MODEL_CONFIG": data.config, "OUT": str(out), "REPO": str(REPO),
            "OMP_NUM_THREADS": "1", **extra}


def submit_tiny(cluster, data, out: Path, *flags: str, **env: str) -> str:
    """sbatch launch/slurm/pretrain_t5.sbatch on one node with the tiny example's flags (two
    processes under torchrun); returns the job id."""
    launcher = (f"sbatch --parsable --nodes=1 --job-name=t5-tiny --output={out}/slurm-%j.out "
                f"{SBATCH}")
    proc = cluster.run("bash", str(TINY), *flags, env=tiny_env(cluster, data, out,
                                                                  LAUNCHER=launcher, **env))
    return proc.stdout.strip().split(";")[0]


def tracker(out: Path) -> str:
    return read(out / "ckpt/latest_checkpointed_iteration.txt").strip()


def test_sbatch_runs_torchrun_with_two_processes(slurm_cluster, tiny_data, tmp_path):
    out = tmp_path / "run"
    job_id = submit_tiny(slurm_cluster, tiny_data, out, NPROC_PER_NODE="2")
    slurm_out = out / f"slurm-{job_id}.out"

    def describe() -> str:
        return f"{tail(slurm_out)}\n{tail(out / 'log.txt')}"

    job = slurm_cluster.wait(job_id, timeout=240, describe=describe)
    assert (job.state, job.exit_code) == ("COMPLETED", "0:0"), describe()
    log = read(out / "log.txt")
    assert '"world_size": 2' in log, describe()
    steps = losses(log)
    assert sorted(steps) == list(range(1, 9)), describe()
    assert float(steps[8]) < float(steps[1]), f"the loss did not fall: {steps}"
    assert tracker(out) == "8"
    assert (out / "ckpt/iter_0000008").is_dir()
    assert f"master {slurm_cluster.node}:" in read(slurm_out), describe()
    assert "training step ended with exit status 0" in read(slurm_out), describe()


def test_srun_runs_one_task_per_process(slurm_cluster, tiny_data, tmp_path):
    out = tmp_path / "run"
    proc = slurm_cluster.run("bash", str(TINY), timeout=240, check=False, env=tiny_env(
        slurm_cluster, tiny_data, out, LAUNCHER=str(SRUN), NTASKS_PER_NODE="2"))
    describe = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{tail(out / 'log.txt')}"
    assert proc.returncode == 0, describe
    log = read(out / "log.txt")
    assert '"world_size": 2' in log, describe  # both tasks joined, from SLURM_* alone
    assert sorted(losses(log)) == list(range(1, 9)), describe
    assert tracker(out) == "8"


@pytest.mark.parametrize("to, workers", [("steps", 2), ("batch", 1)])
def test_sigusr1_saves_exits_zero_and_resumes(slurm_cluster, tiny_data, tmp_path, to, workers):
    """The preemption warning reaches every training process; they agree on a step, save, log
    why and exit 0, and torchrun, srun and the batch shell pass the 0 on. The same command line
    then resumes from that step, exactly: its losses are a straight run's. `steps`: Slurm
    signals every process of the job steps, as `#SBATCH --signal=USR1@120` does (the data-loader
    workers too, which must leave it to their rank); `batch`: only the batch shell, as
    `--signal=B:USR1@120` does, and the script passes it on through srun (to every process of
    the step again)."""
    out = tmp_path / "run"
    # Many steps, no periodic save or evaluation: only the signal can save (and stop) this run.
    long_run = ("--save-interval", "1000000", "--eval-interval", "0", "--num-workers",
                str(workers))
    job_id = submit_tiny(slurm_cluster, tiny_data, out, *long_run, NPROC_PER_NODE="2",
                         ITERS="1000000")
    slurm_out = out / f"slurm-{job_id}.out"

    def describe() -> str:
        return f"{tail(slurm_out)}\n{tail(out / 'log.txt')}"

    deadline = time.monotonic() + 180
    while max(losses(read(out / "log.txt")), default=0) < 3:
        if slurm_cluster.job(job_id).finished or time.monotonic() > deadline:
            slurm_cluster.run("scancel", job_id, check=False)
            pytest.fail(f"job {job_id} did not reach iteration 3\n{describe()}")
        time.sleep(0.2)
    slurm_cluster.run("scancel", "--signal=USR1", *(["--batch"] if to == "batch" else []),
                      job_id)

    job = slurm_cluster.wait(job_id, timeout=120, describe=lambda: (
        "the trainer did not stop on SIGUSR1 (torchrun ignores it; the training processes "
        f"must handle it)\n{describe()}"))
    assert (job.state, job.exit_code) == ("COMPLETED", "0:0"), describe()
    if to == "batch":
        assert "batch shell: SIGUSR1, passed on" in read(slurm_out), describe()
    assert "DataLoader worker" not in read(slurm_out), describe()
    log = read(out / "log.txt")
    match = re.search(r"exiting at iteration (\d+):[^\n]*SIGUSR1[^\n]*checkpoint saved", log)
    assert match, describe()
    stopped = int(match.group(1))
    assert stopped >= 3
    assert tracker(out) == str(stopped)
    assert (out / f"ckpt/iter_{stopped:07d}").is_dir()

    # The same command line again (as a requeue would run it), one more step and out.
    job_id = submit_tiny(slurm_cluster, tiny_data, out, *long_run, "--exit-interval", "1",
                         NPROC_PER_NODE="2", ITERS="1000000")
    slurm_out = out / f"slurm-{job_id}.out"
    job = slurm_cluster.wait(job_id, timeout=240, describe=describe)
    assert (job.state, job.exit_code) == ("COMPLETED", "0:0"), describe()
    log = read(out / "log.txt")
    assert f"resumed from {out / 'ckpt'} at iteration {stopped}" in log, describe()
    assert tracker(out) == str(stopped + 1), describe()
    assert losses(log) == reference_losses(tiny_data, tmp_path / "straight", stopped + 1,
                                           *long_run, ITERS="1000000")

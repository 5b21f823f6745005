"""Every run ends, and leaves no process behind: under a real torchrun, with 0, 1 and 2 data
workers, on each path out of a run (data parallel, pipeline with first, middle and last stages,
expert parallel, evaluation only, a save at a signal, an error), the launcher exits within a
bound and nothing of its process tree is left.

The data workers ignore SIGTERM (training/data_workers.py), and multiprocessing's exit handler
joins its daemonic children after a SIGTERM: a worker nobody ended held its rank in that handler
forever. Whether a loader was still open at exit was a race, so the slow tier repeats short runs
(`test_repeated_exits`; T5_EXIT_REPEATS sets how many per path, 1 by default: with the run of
`test_a_finished_run_exits_and_leaves_nothing` at 2 workers, each path ends twice per CI run).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Sequence

import pytest

from launching import REPO, TINY, free_port, losses, read, tail, tiny_env

pytestmark = pytest.mark.slow  # several torchrun launches each

EXIT_BOUND_S = 300
"""A run of a few tiny steps ends in seconds; this bound only separates an exit from a hang
on a loaded 2-core host (the hang it guards against lasted until the run was killed)."""
OUR_FRAME = re.compile(r'File ".*/(megatron|data_tools)/')
"""A traceback line in our code: a failure's report has none."""
SHORT = ("--eval-interval", "2", "--eval-iters", "1", "--save-interval", "1000000")


def session_processes(sid: int) -> List[str]:
    """'pid command' of every live process of session `sid` (zombies, already exited, are not
    counted: their parent reaps them)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        state, session = fields[0], int(fields[3])
        if session == sid and state != "Z":
            found.append(f"{entry} {cmdline.decode(errors='replace')[:200]}")
    return found


def assert_tree_gone(sid: int, describe: str) -> None:
    """No process of the run's session is left (a worker killed with its rank may take a
    moment to be reaped by init)."""
    deadline = time.monotonic() + 10
    while (left := session_processes(sid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, "processes left behind:\n" + "\n".join(left) + "\n" + describe


def run_to_exit(cmd: Sequence[str], env, log: Path, stop_at_step: int = 0, on_step=None,
                cwd=None):
    """Run `cmd` in its own session; once step `stop_at_step` is in `log` (0: never), call
    `on_step()`, or by default send SIGTERM to the run. Returns (exit status, output, a description for failures); fails if the run
    outlives EXIT_BOUND_S or leaves a process behind."""
    run = subprocess.Popen(list(cmd), env=env, cwd=cwd, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + EXIT_BOUND_S
        if stop_at_step:
            while max(losses(read(log)), default=0) < stop_at_step:
                assert run.poll() is None, run.stdout.read()[-3000:]
                assert time.monotonic() < deadline, "the step to stop at never came"
                time.sleep(0.2)
            if on_step is not None:
                on_step()
            else:
                os.kill(run.pid, signal.SIGTERM)  # tiny_cpu.sh and torchrun.sh exec: torchrun
        try:
            output, _ = run.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            left = "\n".join(session_processes(run.pid))
            pytest.fail(f"the run did not exit within {EXIT_BOUND_S} s; still running:\n{left}"
                        f"\n{tail(log)}", pytrace=False)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait(10)
    describe = f"{output[-4000:]}\n{tail(log)}"
    assert_tree_gone(run.pid, describe)
    return run.returncode, output, describe


def run_tiny(data, out: Path, flags: Sequence[str], nproc: int = 2, stop_at_step: int = 0,
             on_step=None, **env: str):
    """launch/examples/tiny_cpu.sh (torchrun) with `flags`, as run_to_exit runs it."""
    return run_to_exit(["bash", str(TINY), *flags],
                       tiny_env(data, out, NPROC_PER_NODE=str(nproc), **env), out / "log.txt",
                       stop_at_step, on_step)


def seed_cpm2_line(data, out: Path) -> List[str]:
    """The seed's CPM-2 command line (torch.distributed.launch, pretrain_enc_dec.py, ZeRO-3 from
    CPM-2's DeepSpeed JSON, data-parallel 2, the default --num-workers) at a tiny size."""
    out.mkdir(parents=True, exist_ok=True)
    ds = json.loads((REPO / "configs/deepspeed/cpm2_11b_zero3_fp32.json").read_text())
    ds["train_micro_batch_size_per_gpu"] = 2
    (out / "ds.json").write_text(json.dumps(ds))
    return [sys.executable, "-m", "torch.distributed.launch", "--nnodes", "1", "--node_rank",
            "0", "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port",
            str(free_port()), str(REPO / "pretrain_enc_dec.py"), "--model-config", data.config,
            "--model-parallel-size", "1", "--batch-size", "2", "--enc-seq-length", "64",
            "--dec-seq-length", "32", "--train-iters", "2", "--save", str(out / "ckpt"),
            "--log-file", str(out / "log.txt"), "--load", str(out / "ckpt"), "--data-path",
            data.prefix, "--data-cache-path", str(out / "cache"), "--data-impl", "mmap",
            "--split", "950,30,20", "--distributed-backend", "nccl", "--lr", "0.000002",
            "--lr-decay-style", "linear", "--weight-decay", "1e-2", "--clip-grad", "1.0",
            "--warmup", "0.01", "--tokenizer-model", data.spm, "--save-interval", "2",
            "--eval-interval", "2", "--eval-iters", "1", "--log-interval", "1",
            "--checkpoint-activations", "--deepspeed-activation-checkpointing", "--deepspeed",
            "--deepspeed_config", str(out / "ds.json")]


PATHS = {
    "data-parallel": ((), 2),
    "pipeline": (("--pipeline-model-parallel-size", "3"), 3),  # a middle stage reads no batch
    "expert-parallel": (("--num-experts", "2", "--expert-model-parallel-size", "2"), 2),
}


@pytest.mark.parametrize("workers", [0, 1, 2])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_finished_run_exits_and_leaves_nothing(path, workers, tiny_data, tmp_path):
    flags, nproc = PATHS[path]
    out = tmp_path / "run"
    status, output, describe = run_tiny(
        tiny_data, out, (*flags, "--num-workers", str(workers), *SHORT), nproc, ITERS="2")
    assert status == 0, describe
    assert sorted(losses(read(out / "log.txt"))) == [1, 2], describe
    assert "test loss at iteration 2" in read(out / "log.txt"), describe
    if path == "data-parallel":  # the same command again: resumes at the end, evaluates only
        status, output, describe = run_tiny(
            tiny_data, out, (*flags, "--num-workers", str(workers), *SHORT), nproc, ITERS="2")
        assert status == 0, describe
        log = read(out / "log.txt")
        assert f"resumed from {out / 'ckpt'} at iteration 2" in log, describe
        assert log.count("test loss at iteration 2") == 2, describe


@pytest.mark.parametrize("workers", [0, 2])
def test_a_signal_saves_exits_and_leaves_nothing(workers, tiny_data, tmp_path):
    out = tmp_path / "run"
    status, output, describe = run_tiny(
        tiny_data, out, ("--num-workers", str(workers), *SHORT), stop_at_step=2,
        ITERS="1000000")
    assert status == 1, describe  # torchrun's own status on SIGTERM; its ranks exit 0
    assert re.search(r"exiting at iteration \d+: signal SIGTERM \(checkpoint saved\)",
                     read(out / "log.txt")), describe


@pytest.mark.parametrize("workers", [0, 2])
def test_a_failed_run_says_one_line_exits_and_leaves_nothing(workers, tiny_data, tmp_path):
    # an absurd learning rate: the weights overflow and a guard stops the run
    out = tmp_path / "run"
    status, output, describe = run_tiny(
        tiny_data, out, ("--num-workers", str(workers), *SHORT, "--lr", "1e30",
                         "--lr-warmup-iters", "0"), ITERS="20")
    assert status != 0, describe
    assert not OUR_FRAME.search(output), describe  # torchrun's own traceback names none
    assert len(re.findall(r"^error: iteration \d+: ", output, re.M)) == 1, describe


def test_repeated_exits(tiny_data, tmp_path):
    """Short runs again and again on each path with 2 workers, and the seed's CPM-2 command line
    (`pretrain_enc_dec.py`, ZeRO-3, DP 2): each exits and leaves nothing."""
    repeats = int(os.environ.get("T5_EXIT_REPEATS", "1"))
    for i in range(repeats):
        for name, (flags, nproc) in sorted(PATHS.items()):
            out = tmp_path / f"{name}-{i}"
            status, _, describe = run_tiny(tiny_data, out,
                                           (*flags, "--num-workers", "2", *SHORT), nproc,
                                           ITERS="2")
            assert status == 0, f"{name}, run {i}:\n{describe}"
        out = tmp_path / f"cpm2-{i}"
        env = {k: v for k, v in tiny_env(tiny_data, out).items() if k != "MASTER_PORT"}
        status, _, describe = run_to_exit(seed_cpm2_line(tiny_data, out),
                                          {**env, "PYTHONPATH": str(REPO)}, out / "log.txt",
                                          cwd=out)
        assert status == 0, f"the seed's CPM-2 line, run {i}:\n{describe}"

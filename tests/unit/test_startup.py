"""The start of a job: who reports a command line that cannot run (before any process group, so
no rank can ask another), the data files checked with the flags, and the stand-in loader of a
pipeline stage that reads no batch."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from megatron.data.datasets.builder import data_file_problems
from megatron.data.storage.indexed_dataset import IndexedDatasetBuilder
from megatron.cli import startup_voice
from megatron.training.loaders import UnreadBatches


def test_rank_0_speaks_for_the_job_and_one_rank_of_every_other_node():
    # torchrun: RANK, LOCAL_RANK, GROUP_RANK (the node)
    assert startup_voice({"RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0"}) == ""
    assert startup_voice({"RANK": "1", "LOCAL_RANK": "1", "GROUP_RANK": "0"}) is None
    assert startup_voice({"RANK": "9", "LOCAL_RANK": "1", "GROUP_RANK": "1"}) is None
    other = startup_voice({"RANK": "8", "LOCAL_RANK": "0", "GROUP_RANK": "1"})
    assert other is not None and other.startswith(" (node 1, ")
    # srun, one task per device: SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID
    assert startup_voice({"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}) == ""
    assert startup_voice({"SLURM_PROCID": "3", "SLURM_LOCALID": "3",
                          "SLURM_NODEID": "0"}) is None
    assert startup_voice({"SLURM_PROCID": "4", "SLURM_LOCALID": "0",
                          "SLURM_NODEID": "1"}).startswith(" (node 1, ")
    assert startup_voice({}) == ""  # one process


def write_dataset(prefix: Path, documents) -> None:
    with IndexedDatasetBuilder(str(prefix) + ".bin", np.int32) as builder:
        for doc in documents:
            builder.add_item(np.asarray(doc, dtype=np.int32))
            builder.end_document()
        builder.finalize(str(prefix) + ".idx")


def test_data_files_are_opened_with_the_flags(tmp_path):
    good = tmp_path / "good"
    write_dataset(good, [[1, 2, 3], [4, 5], [6, 7, 8, 9]])
    assert data_file_problems([str(good)]) == []
    assert data_file_problems(["1", str(good), "2", str(good)]) == []
    cut = tmp_path / "cut"
    shutil.copy(str(good) + ".idx", str(cut) + ".idx")
    Path(str(cut) + ".bin").write_bytes(Path(str(good) + ".bin").read_bytes()[:20])
    problems = data_file_problems([str(good), str(cut)])
    assert len(problems) == 1
    assert problems[0].startswith(f"--data-path {cut}: ") and "cut.bin" in problems[0]
    missing = data_file_problems([str(tmp_path / "none")])
    assert len(missing) == 1 and str(tmp_path / "none") in missing[0]


def test_a_stage_that_reads_no_batch_gets_as_many_empty_ones():
    unread = UnreadBatches(3)
    assert len(unread) == 3
    assert list(unread) == [{}, {}, {}] and list(unread) == [{}, {}, {}]  # every epoch anew


def test_a_silent_rank_leaves_once_the_speaker_has_printed(agent_store):
    import threading
    import time

    from megatron.cli import announce_refusal, await_refusal

    store, env = agent_store(2)
    speaker = {**env, "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0"}
    silent = {**env, "RANK": "1", "LOCAL_RANK": "1", "GROUP_RANK": "0"}
    left = []

    def wait():
        await_refusal(silent, lambda: False, grace_s=600)
        left.append(time.monotonic())

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.5)
    assert not left  # still waiting: nothing said yet
    said = time.monotonic()
    announce_refusal(speaker)
    waiter.join(60)
    assert left and left[0] >= said  # left on the word, long before its grace


def test_a_silent_rank_without_a_launcher_store_leaves_at_a_signal():
    from megatron.cli import await_refusal

    # no agent store (srun, a plain python): the grace is cut short by the launcher's SIGTERM
    import threading

    waiter = threading.Thread(target=await_refusal, args=({"WORLD_SIZE": "2"}, lambda: True, 600),
                              daemon=True)
    waiter.start()
    waiter.join(60)
    assert not waiter.is_alive()


def test_a_refused_command_line_is_copied_into_an_existing_log(tmp_path, monkeypatch, capsys):
    """A requeued job whose checkpoint cannot be read says why in its run's --log-file too; a
    job refused with no log yet creates none (nothing left behind)."""
    from megatron.pretrain_t5 import main

    for key in ("RANK", "SLURM_PROCID", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    log = tmp_path / "run.log"
    assert main(["--log-file", str(log)]) == 2
    assert not log.exists()
    stderr = capsys.readouterr().err
    log.write_text("iteration 2 | loss 9.1\n")
    assert main(["--log-file", str(log)]) == 2
    assert "--data-path is required" in stderr
    assert log.read_text() == "iteration 2 | loss 9.1\n" + stderr


def test_a_failure_of_some_ranks_reaches_the_log_too(tmp_path, capsys):
    from megatron.failures import RunFailure, report_failure

    log = tmp_path / "run.log"
    report_failure(RunFailure("rng/rank_00001.pt is missing", rank_local=True), 1, str(log))
    report_failure(RunFailure("every rank saw it"), 1, str(log))  # rank 0 speaks for the job
    report_failure(RunFailure("every rank saw it"), 0, str(log))
    expected = "error (rank 1): rng/rank_00001.pt is missing\nerror: every rank saw it\n"
    assert capsys.readouterr().err == expected
    assert log.read_text() == expected


JOIN = """
import datetime, os, sys
from megatron.initialize import PortInUse, distributed_env, launcher_of, start_process_group
launcher = launcher_of(os.environ)
os.environ.update(distributed_env(os.environ))
try:
    start_process_group("gloo", datetime.timedelta(seconds=60), launcher)
except PortInUse as e:
    print(e, file=sys.stderr)
    sys.exit(2)
print(os.environ["MASTER_PORT"], flush=True)
sys.stdin.readline()  # holds its process group (and its store's port) until the test is done
"""


def _join(env):
    import os
    import subprocess
    import sys

    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "SLURM_",
                                  "TORCHELASTIC_"))}
    return subprocess.Popen([sys.executable, "-c", JOIN], env={**clean, **env}, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def test_single_process_runs_without_master_port_take_free_ports():
    """Two plain `python` runs on one host at once (both used to bind 29500, the second dying
    with EADDRINUSE): each store binds a port the kernel picks, and MASTER_PORT says which."""
    first, second = _join({}), _join({})
    try:
        ports = [int(p.stdout.readline() or 0) for p in (first, second)]
        assert all(ports) and ports[0] != ports[1], [p.stderr.read() for p in (first, second)]
    finally:
        for p in (first, second):
            p.communicate("\n", timeout=60)
    assert first.returncode == second.returncode == 0


def test_a_master_port_in_use_is_one_line_naming_it():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _join({"MASTER_PORT": str(port)})
        out, err = proc.communicate("\n", timeout=120)
    assert proc.returncode == 2, err
    assert err.splitlines() == [
        f"MASTER_PORT {port} is in use on 127.0.0.1 (another job or run listens there): set "
        f"MASTER_PORT to a free port, or unset it: a run without a launcher then takes a free "
        f"one"], err

"""Checkpoints on object storage when the server fails (issue 45 item 4), on the real S3 server
behind the fault proxy (tests/objectstore/fault_proxy.py):

- the server goes away mid-run: the interval save after that warns and training goes on, the
  final save fails the run, the tracker still names the last good iteration, and that loads;
- 503 answers and dropped connections during a save are retried (with backoff, a bounded number
  of times) and the save completes;
- a stalled server (requests that get no answer) fails the save after the request timeout and
  retries, naming the object's key, instead of hanging.

test_s3_checkpoints.py holds the rest: the tracker written last, stale multipart uploads aborted,
--keep-last, a truncated object at load."""

import sys
import threading
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "distributed"))  # the process harness
sys.path.insert(0, str(HERE.parent / "training"))  # its training workers

from harness import run_workers  # noqa: E402
from test_s3_checkpoints import FilesStep  # noqa: E402
from train_workers import base_argv, run_pretrain_until_error  # noqa: E402

from megatron.checkpoint.io.saver import SaveFailed  # noqa: E402

pytestmark = pytest.mark.slow


def test_a_server_gone_mid_run_warns_then_fails_the_final_save(
        s3_server, fault_proxy, train_data, tmp_path, monkeypatch):
    from megatron.checkpoint.io.remote import stage_for_load
    from megatron.config.training import CheckpointStorage
    from megatron.data.storage.object_storage import StorageSettings

    bucket = s3_server.make_bucket("ckpt-gone")
    for name, value in s3_server.env(fault_proxy.endpoint).items():
        monkeypatch.setenv(name, value)
    # the save of iteration 4 waits 3 s after writing its files, before uploading them: the
    # server goes away then (megatron/checkpoint/io/checkpointing.py TEST_PAUSE_ENV)
    monkeypatch.setenv("MEGATRON_CHECKPOINT_TEST_PAUSE_S", "4:3")
    url, on_disk = f"s3://{bucket}/run", s3_server.root / bucket / "run"
    log = tmp_path / "run.log"
    argv = base_argv(train_data, "--zero-stage", "1", "--save", url, "--save-interval", "2",
                     "--checkpoint-staging-path", str(tmp_path / "staging"),
                     "--object-storage-retries", "2", "--object-storage-timeout", "2",
                     "--log-file", str(log), iters=6)
    tracker = on_disk / "latest_checkpointed_iteration.txt"

    def stop_the_server_after_the_first_save():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if tracker.is_file() and tracker.read_text() == "2\n":
                fault_proxy.drop_next(10 ** 6)  # every connection from now on
                fault_proxy.reset()  # and the kept-alive ones
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=stop_the_server_after_the_first_save, daemon=True)
    watcher.start()
    results = run_workers(2, run_pretrain_until_error, [argv], timeout=600)
    watcher.join()
    fault_proxy.clear()
    for [result] in results:  # the final save failed the run, on every rank
        assert "SaveFailed" in result["error"] and "iteration 6" in result["error"], result
        assert "the tracker still names the previous checkpoint" in result["error"]
    text = log.read_text()
    assert "warning: saving iteration 4 to " + url in text, text[-3000:]
    assert "trying again at the next save" in text
    assert " iteration        6/       6 |" in text  # training went on after the failed save
    assert tracker.read_text() == "2\n"
    storage = CheckpointStorage(StorageSettings(retries=2, timeout_s=10, backoff_s=0.01),
                                str(tmp_path / "load"))
    every = lambda name, meta: True  # noqa: E731
    root = stage_for_load(url, storage, None, (0, 0, 0), every, lambda x: x)
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "2\n"
    assert sorted(p.name for p in (root / "iter_0000002").glob("*.pt")) == sorted(
        p.name for p in (on_disk / "iter_0000002").glob("*.pt"))


def _saver(s3_server, fault_proxy, tmp_path, monkeypatch, bucket, retries, timeout_s):
    from megatron.checkpoint.io.remote_saver import RemoteSaver
    from megatron.config.training import CheckpointStorage
    from megatron.data.storage.object_storage import StorageSettings

    s3_server.make_bucket(bucket)
    for name, value in s3_server.env(fault_proxy.endpoint).items():
        monkeypatch.setenv(name, value)
    storage = CheckpointStorage(StorageSettings(retries=retries, timeout_s=timeout_s,
                                                backoff_s=0.01),
                                str(tmp_path / "staging"), part_size_mb=5, upload_concurrency=4)
    return RemoteSaver(FilesStep(), f"s3://{bucket}/run", {}, "cpu", {}, storage=storage,
                       timeout_s=120)


@pytest.mark.parametrize("fault", ["503", "drop"])
def test_503s_and_dropped_connections_are_retried(s3_server, fault_proxy, one_process_group,
                                                  tmp_path, monkeypatch, fault):
    import torch

    saver = _saver(s3_server, fault_proxy, tmp_path, monkeypatch, f"ckpt-retry-{fault}",
                   retries=6, timeout_s=10)
    try:
        fault_proxy.reset()
        (fault_proxy.answer_503_next if fault == "503" else fault_proxy.drop_next)(3)
        saver.save(1, 4, {})
        saver.finish()
    finally:
        saver.close()
    assert fault_proxy.pending == 0  # every fault was met
    on_disk = s3_server.root / f"ckpt-retry-{fault}" / "run"
    assert (on_disk / "latest_checkpointed_iteration.txt").read_text() == "1\n"
    saved = torch.load(on_disk / "iter_0000001" / "model.pt", weights_only=True)
    assert saved["weights"].tolist() == [1.0] * 1000


def test_a_stalled_server_fails_the_save_naming_the_key(s3_server, fault_proxy,
                                                        one_process_group, tmp_path,
                                                        monkeypatch):
    saver = _saver(s3_server, fault_proxy, tmp_path, monkeypatch, "ckpt-stalled",
                   retries=2, timeout_s=1)
    try:
        fault_proxy.reset()
        fault_proxy.delay_next(10 ** 6, 60)  # no answer within a minute, to every request
        with pytest.raises(SaveFailed) as failed:
            saver.save(1, 4, {})
            saver.finish()
    finally:
        fault_proxy.clear()
        fault_proxy.reset()
        saver.close()
    message = str(failed.value)
    assert "s3://ckpt-stalled/run/iter_0000001/model.pt" in message, message
    assert "the tracker still names the previous checkpoint" in message
    assert not (s3_server.root / "ckpt-stalled" / "run" / "latest_checkpointed_iteration.txt"
                ).exists()


def test_a_job_killed_mid_upload_resumes_from_the_tracked_checkpoint(
        s3_server, fault_proxy, train_data, tmp_path):
    """SIGKILL of the job (`python -m megatron.pretrain_t5`, one process) while iteration 4's
    objects are being uploaded (the proxy slows each request then): the tracker still names
    iteration 2, iteration 4 has objects but no meta.json, and the next launch resumes from
    iteration 2 and saves on to the end."""
    import os
    import signal
    import subprocess

    bucket = s3_server.make_bucket("ckpt-killed")
    url, on_disk = f"s3://{bucket}/run", s3_server.root / bucket / "run"
    tracker, log = on_disk / "latest_checkpointed_iteration.txt", tmp_path / "run.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WORLD_SIZE", "RANK"))}
    env.update(s3_server.env(fault_proxy.endpoint), OMP_NUM_THREADS="1",
               PYTHONPATH=str(HERE.parents[1]))
    cmd = [sys.executable, "-m", "megatron.pretrain_t5",
           *base_argv(train_data, "--save", url, "--load", url, "--save-interval", "2",
                      "--checkpoint-staging-path", str(tmp_path / "staging"),
                      "--log-file", str(log), iters=6)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        killed, deadline = False, time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            if tracker.is_file() and tracker.read_text() == "2\n":
                fault_proxy.latency(0.3)  # iteration 4's upload: 0.3 s per request
            if any((on_disk / "iter_0000004").rglob("*.pt")):  # some of its objects are up
                os.killpg(proc.pid, signal.SIGKILL)
                killed = True
                break
            time.sleep(0.02)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(60)
        fault_proxy.clear()
    assert killed, f"the job ended before iteration 4's upload (rc {proc.returncode}): " + \
        proc.stderr.read()[-3000:]
    assert tracker.read_text() == "2\n"
    assert not (on_disk / "iter_0000004" / "meta.json").exists()
    again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    text = log.read_text()
    assert f"resumed from {url} at iteration 2" in text, text[-3000:]
    assert tracker.read_text() == "6\n"
    assert (on_disk / "iter_0000004" / "meta.json").is_file()  # saved again, whole

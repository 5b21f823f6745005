"""megatron/checkpoint/io/ownership.py: the writer lock of a --save folder (a live holder refuses, a
dead one is taken over) and the launcher watch. The real torchrun case (SIGKILL to the launcher,
a second launch on the same folder): tests/launch/test_ownership.py."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from megatron.checkpoint.io import ownership
from megatron.checkpoint.io.ownership import LOCK, SaveLock, SaveLockError, lock_problems, read_holder


def dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_live_holder_is_refused_and_named(tmp_path):
    lock = SaveLock(tmp_path).acquire()
    try:
        holder = json.loads((tmp_path / LOCK).read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        problems = lock_problems(str(tmp_path))
        assert len(problems) == 1
        assert f"pid {os.getpid()}" in problems[0] and "being written by another job" in \
            problems[0]
        with pytest.raises(SaveLockError, match=f"pid {os.getpid()}"):
            SaveLock(tmp_path).acquire()
    finally:
        lock.release()
    assert not (tmp_path / LOCK).exists()
    assert tmp_path.is_dir()  # the lock did not make it: stays
    assert lock_problems(str(tmp_path)) == []


def test_a_folder_the_lock_made_goes_with_it_while_empty(tmp_path):
    """A run that fails before its first save leaves no --save folder behind; one that wrote
    something keeps it."""
    save = tmp_path / "a/ckpt"
    SaveLock(save).acquire().release()
    assert not save.exists() and (tmp_path / "a").is_dir()
    lock = SaveLock(save).acquire()
    (save / "iter_0000001").mkdir()
    lock.release()
    assert (save / "iter_0000001").is_dir() and not (save / LOCK).exists()


def test_a_dead_holder_on_this_host_is_taken_over(tmp_path):
    (tmp_path / LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": dead_pid(),
                                             "pid_start": "1", "job": "SLURM_JOB_ID=5",
                                             "started": "then"}))
    assert read_holder(tmp_path)["alive"] is False and lock_problems(str(tmp_path)) == []
    lock = SaveLock(tmp_path).acquire()
    assert lock.took_over["job"] == "SLURM_JOB_ID=5"
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    lock.release()


def test_a_reused_pid_is_not_the_holder(tmp_path):
    """Our own pid, but another start time: the holder was an earlier process."""
    (tmp_path / LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                             "pid_start": "0"}))
    assert read_holder(tmp_path)["alive"] is False


def test_another_hosts_holder_lives_by_its_heartbeat(tmp_path):
    path = tmp_path / LOCK
    path.write_text(json.dumps({"host": "elsewhere.example", "pid": 1}))
    assert read_holder(tmp_path)["alive"] is True
    assert "host elsewhere.example" in lock_problems(str(tmp_path))[0]
    old = time.time() - ownership.STALE_S - 5
    os.utime(path, (old, old))
    assert read_holder(tmp_path)["alive"] is False


def test_an_unreadable_lock_is_dead_and_release_keeps_anothers(tmp_path):
    (tmp_path / LOCK).write_text("{\"host\": ")  # cut off while written
    assert read_holder(tmp_path)["alive"] is False
    lock = SaveLock(tmp_path).acquire()
    (tmp_path / LOCK).write_text(json.dumps({"host": "elsewhere.example", "pid": 1}))
    lock.release()  # no longer ours: left alone
    assert (tmp_path / LOCK).exists()


def test_the_heartbeat_touches_the_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(ownership, "HEARTBEAT_S", 0.05)
    lock = SaveLock(tmp_path).acquire()
    try:
        old = time.time() - 100
        os.utime(tmp_path / LOCK, (old, old))
        deadline = time.monotonic() + 30
        while read_holder(tmp_path)["age_s"] > 50:  # until the heartbeat touches it
            assert time.monotonic() < deadline, "the heartbeat never touched the lock"
            time.sleep(0.01)
    finally:
        lock.release()


def test_watch_launcher_only_under_torchrun(tmp_path):
    assert ownership.watch_launcher(env={}) is None
    ready = tmp_path / "watching"
    code = ("import os, pathlib, sys, time; sys.path.insert(0, %r); "
            "from megatron.checkpoint.io.ownership import watch_launcher; "
            "watch_launcher(env={'TORCHELASTIC_RUN_ID': 'x', 'RANK': '0'}, poll_s=0.05); "
            "print(os.getpid(), flush=True); pathlib.Path(%r).write_text('1'); "
            "time.sleep(30)") % (os.getcwd(), str(ready))
    # a parent that dies as soon as its child watches it: the child is orphaned and must exit
    # by itself
    parent = subprocess.run(
        ["bash", "-c", f"{sys.executable} -c \"{code}\" & "
                       f"until [ -s {ready} ]; do sleep 0.01; done; exit 0"],
        capture_output=True, text=True, timeout=60)
    # run() returned, so the orphan closed the pipes it shared: it ended, long before its sleep
    assert "the launcher (pid" in parent.stderr and "exiting without saving (exit 4)" in \
        parent.stderr
    pid = int(parent.stdout.split()[0])
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}") or \
        open(f"/proc/{pid}/stat").read().split(")")[1].split()[0] == "Z"

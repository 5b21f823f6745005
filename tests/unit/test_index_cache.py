"""Index caches: reuse, one builder among concurrent processes, stale and truncated entries."""

import json
import multiprocessing
import os
import socket
import time

import numpy as np
import pytest

from megatron.data.storage.index_cache import CacheTimeout, cached_arrays, description_hash


def make(counter_dir=None, delay=0.0):
    def build():
        if counter_dir:
            # Each build leaves a file, so the test can count how many processes built.
            open(os.path.join(counter_dir, f"built-{os.getpid()}-{time.time_ns()}"), "w").close()
        time.sleep(delay)
        return {"a": np.arange(1000, dtype=np.int64), "b": np.ones((10, 2), dtype=np.int32)}
    return build


def test_reuse_and_new_entry_on_change(tmp_path):
    counts = tmp_path / "counts"
    counts.mkdir()
    desc = {"prefix": "x", "seed": 1}
    first = cached_arrays(str(tmp_path / "c"), "x", desc, make(str(counts)), log=lambda m: None)
    again = cached_arrays(str(tmp_path / "c"), "x", desc, make(str(counts)), log=lambda m: None)
    assert len(os.listdir(counts)) == 1
    np.testing.assert_array_equal(first["a"], again["a"])
    assert isinstance(again["a"], np.memmap) and not again["a"].flags.writeable
    cached_arrays(str(tmp_path / "c"), "x", {**desc, "seed": 2}, make(str(counts)),
                  log=lambda m: None)
    assert len(os.listdir(counts)) == 2


@pytest.mark.parametrize("damage", ["truncate", "manifest", "missing"])
def test_damaged_entry_is_rebuilt(tmp_path, damage):
    desc = {"k": damage}
    cached_arrays(str(tmp_path), "x", desc, make(), log=lambda m: None)
    entry = tmp_path / f"x-{description_hash(desc)}"
    if damage == "truncate":
        with open(entry / "a.npy", "r+b") as f:
            f.truncate(100)
    elif damage == "manifest":
        manifest = json.loads((entry / "manifest.json").read_text())
        manifest["arrays"]["a"]["shape"] = [999]
        (entry / "manifest.json").write_text(json.dumps(manifest))
    else:
        os.unlink(entry / "b.npy")
    messages = []
    arrays = cached_arrays(str(tmp_path), "x", desc, make(), log=messages.append)
    np.testing.assert_array_equal(arrays["a"], np.arange(1000))
    assert any("rebuilding" in m for m in messages)


def _start_together(cache_dir, counter_dir, barrier, out):
    barrier.wait()
    arrays = cached_arrays(cache_dir, "x", {"k": "race"}, make(counter_dir, delay=0.5),
                           log=lambda m: None)
    out.put(int(arrays["a"].sum()))


def test_four_processes_build_once(tmp_path):
    counts = tmp_path / "counts"
    counts.mkdir()
    ctx = multiprocessing.get_context("fork")
    barrier, out = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_start_together, args=(str(tmp_path / "c"), str(counts), barrier,
                                                        out)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert sorted(out.get(timeout=5) for _ in range(4)) == [sum(range(1000))] * 4
    assert len(os.listdir(counts)) == 1  # exactly one builder


def test_dead_holder_lock_is_broken_and_live_one_times_out(tmp_path):
    desc = {"k": "lock"}
    entry = tmp_path / f"x-{description_hash(desc)}"
    proc = multiprocessing.get_context("fork").Process(target=lambda: None)
    proc.start()
    proc.join()  # a pid that no longer exists
    lock = {"host": socket.gethostname(), "pid": proc.pid, "what": "x", "since": 0}
    (tmp_path / f"{entry.name}.lock").write_text(json.dumps(lock))
    messages = []
    cached_arrays(str(tmp_path), "x", desc, make(), log=messages.append)
    assert any("abandoned" in m for m in messages)

    desc2 = {"k": "held"}
    lock["pid"] = os.getpid()  # alive: must be waited for
    (tmp_path / f"x-{description_hash(desc2)}.lock").write_text(json.dumps(lock))
    with pytest.raises(CacheTimeout, match="build_indices"):
        cached_arrays(str(tmp_path), "x", desc2, make(), timeout=0.5, log=lambda m: None)

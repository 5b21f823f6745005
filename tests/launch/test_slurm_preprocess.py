"""Preprocessing in shards under a real single-node Slurm (see conftest.py): the array job of
launch/slurm/preprocess.sbatch, the recovery of a failed task by resubmitting its index, and
shards from --num-shards under `srun -n 2` and from plain flags. The reference is one process's
run of data_tools/preprocess_data.py on the same input: the shards merged in index order by
data_tools/merge_datasets.py must be byte-identical to it, and the set the array wrote trains as
one --data-path with the losses of the one-process file."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List, Tuple

import pytest

from launching import tail

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "launch/slurm/preprocess.sbatch"
PREPROCESS = REPO / "data_tools/preprocess_data.py"
MERGE = REPO / "data_tools/merge_datasets.py"
FLAGS = ("--append-eod",)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def corpus(corpora_dir, spm_model, tmp_path_factory):
    """Two input files of unequal size (English, then Chinese; about 0.6 MB), so that 4 shards
    cut one mid-file and one of them spans the file boundary, and one process's output on them."""
    root = tmp_path_factory.mktemp("slurm_preprocess")
    inputs = root / "in"
    inputs.mkdir()
    for name, out in (("en_shakespeare.jsonl", "a.jsonl"), ("zh_cmrc2019_stories.jsonl",
                                                            "b.jsonl")):
        with open(corpora_dir / name, encoding="utf-8") as src, \
                open(inputs / out, "w", encoding="utf-8") as dst:
            dst.writelines(line for i, line in zip(range(120), src))
    reference = root / "one" / "all"
    proc = preprocess(f"{inputs}/*.jsonl", reference, spm_model, "--workers", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return SimpleNamespace(glob=f"{inputs}/*.jsonl", spm=str(spm_model),
                           reference=f"{reference}_text_document")


def preprocess(inputs: str, prefix: Path, spm, *flags: str, env=None, runner=()):
    """data_tools/preprocess_data.py as a user runs it (optionally under `runner`, e.g. srun)."""
    return subprocess.run([*runner, sys.executable, str(PREPROCESS), "--input", inputs,
                           "--output-prefix", str(prefix), "--tokenizer-model", str(spm),
                           "--no-progress", *FLAGS, *flags],
                          env=env, capture_output=True, text=True, timeout=300)


def shard_prefixes(prefix: Path, count: int) -> List[str]:
    return [f"{prefix}-{i:05d}-of-{count:05d}_text_document" for i in range(count)]


def assert_merge_is_reference(prefix: Path, count: int, reference: str, tmp: Path) -> None:
    """The shards merged in index order (merge_datasets.py as a command) equal one process's
    .bin and .idx byte for byte; the set's manifest lists the shards in order."""
    merged = tmp / "merged" / "all_text_document"
    proc = subprocess.run([sys.executable, str(MERGE), "--input", *shard_prefixes(prefix, count),
                           "--output-prefix", str(merged)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for ext in (".bin", ".idx"):
        assert Path(f"{merged}{ext}").read_bytes() == Path(f"{reference}{ext}").read_bytes(), \
            f"the {count} shards merged differ from one process's {ext}"
    manifest = Path(f"{prefix}_text_document.shards.json")
    assert manifest.is_file(), f"no manifest {manifest}"
    listed = json.loads(manifest.read_text())
    text = json.dumps(listed)
    positions = [text.find(Path(p).name) for p in shard_prefixes(prefix, count)]
    assert -1 not in positions and positions == sorted(positions), text[:2000]


def array_tasks(cluster, job_id: str) -> Dict[str, Tuple[str, str]]:
    """Every task of an array job: task id -> (state, exit code), as `scontrol` lists them (one
    record per task once started; pending tasks may share one record, "ArrayTaskId=1-3")."""
    text = cluster.run("scontrol", "show", "job", "--oneliner", job_id).stdout
    tasks = {}
    for line in text.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        if "JobState" in fields:
            tasks[fields.get("ArrayTaskId", "?")] = (fields["JobState"], fields.get("ExitCode"))
    return tasks


def wait_array(cluster, job_id: str, timeout: float, describe) -> Dict[str, Tuple[str, str]]:
    """Poll until every task of the array has ended (the same states as conftest.Job.finished)."""
    running = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED",
               "RESIZING", "SIGNALING")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tasks = array_tasks(cluster, job_id)
        if tasks and not any(state in running for state, _ in tasks.values()):
            return tasks
        time.sleep(1)
    cluster.run("scancel", job_id, check=False)
    pytest.fail(f"array job {job_id} not done after {timeout:.0f} s: {array_tasks(cluster, job_id)}"
                f"\n{describe()}\n{cluster.log_tails()}")


def submit(cluster, corpus, prefix: Path, array: str, out: Path, cpus: int = 1) -> str:
    """sbatch launch/slurm/preprocess.sbatch for a set of 4 shards, `cpus` CPUs (workers) a task;
    the settings travel in sbatch's environment, as the script's header says."""
    env = {"INPUT": corpus.glob, "OUTPUT_PREFIX": str(prefix), "TOKENIZER": corpus.spm,
           "NUM_SHARDS": "4", "REPO": str(REPO), "PREPROCESS_ARGS": " ".join(FLAGS)}
    return cluster.sbatch(f"--array={array}", f"--cpus-per-task={cpus}",
                          f"--output={out}/slurm-%A_%a.out", str(SCRIPT), env=env)


def logs(out: Path) -> str:
    return "\n".join(f"--- {p.name}\n{tail(p)}" for p in sorted(out.glob("slurm-*.out")))


def test_array_job_writes_shards_whose_merge_is_one_process_output(slurm_cluster, corpus,
                                                                   train_data, tmp_path):
    out = tmp_path / "logs"
    out.mkdir()
    prefix = tmp_path / "set" / "mix"
    job_id = submit(slurm_cluster, corpus, prefix, "0-3", out, cpus=2)
    tasks = wait_array(slurm_cluster, job_id, 240, lambda: logs(out))
    assert tasks == {str(i): ("COMPLETED", "0:0") for i in range(4)}, logs(out)
    for i in range(4):
        text = (out / f"slurm-{job_id}_{i}.out").read_text()
        assert f"shard {i} of 4 (from --num-shards/--shard-index)" in text, text[-2000:]
        assert "2 worker(s)" in text, text[-2000:]  # --workers from SLURM_CPUS_PER_TASK
    assert_merge_is_reference(prefix, 4, corpus.reference, tmp_path)
    # the set the array wrote trains as one --data-path, as the one-process file does
    sys.path[:0] = [str(REPO / "tests" / "distributed"), str(REPO / "tests" / "training")]
    from harness import run_workers
    from train_workers import base_argv, run_pretrain

    def argv(data_prefix, cache):
        data = SimpleNamespace(prefix=data_prefix, spm=corpus.spm, tiny=train_data.tiny,
                               cache=str(tmp_path / cache))
        return base_argv(data, "--split", "100,0,0", "--eval-interval", "0", iters=2)

    on_set, on_file = run_workers(1, run_pretrain, [argv(f"{prefix}_text_document", "a"),
                                                    argv(corpus.reference, "b")],
                                  timeout=300)[0]
    assert on_set["losses"] == on_file["losses"] and sorted(on_set["losses"]) == [1, 2]


def test_a_failed_task_is_redone_by_resubmitting_its_index(slurm_cluster, corpus, tmp_path):
    """Shard 2 cannot write its .bin (a folder is in the way, which stops root too) and fails;
    the others complete and no manifest is written. Once the path is cleared, resubmitting
    index 2 alone (an array of one task: the shard count comes from NUM_SHARDS) completes the
    set: the manifest appears and the merge equals one process's output."""
    out = tmp_path / "logs"
    out.mkdir()
    prefix = tmp_path / "set" / "mix"
    blocker = Path(shard_prefixes(prefix, 4)[2] + ".bin")
    blocker.mkdir(parents=True)
    job_id = submit(slurm_cluster, corpus, prefix, "0-3", out)
    tasks = wait_array(slurm_cluster, job_id, 240, lambda: logs(out))
    assert tasks["2"] == ("FAILED", "1:0"), (tasks, logs(out))
    assert all(tasks[str(i)] == ("COMPLETED", "0:0") for i in (0, 1, 3)), (tasks, logs(out))
    failed_log = (out / f"slurm-{job_id}_2.out").read_text()
    assert "to redo this shard alone: sbatch --array=2" in failed_log, failed_log[-2000:]
    assert not Path(f"{prefix}_text_document.shards.json").exists()
    left = sorted(p.name for p in prefix.parent.iterdir() if "-00002-of-" in p.name)
    assert left == [blocker.name], left  # nothing of shard 2 but the obstacle

    blocker.rmdir()
    job_id = submit(slurm_cluster, corpus, prefix, "2", out)
    tasks = wait_array(slurm_cluster, job_id, 240, lambda: logs(out))
    assert tasks == {"2": ("COMPLETED", "0:0")}, logs(out)
    assert_merge_is_reference(prefix, 4, corpus.reference, tmp_path)


def test_shards_from_num_shards_under_srun_and_from_plain_flags(slurm_cluster, corpus, tmp_path):
    """`srun -n 2 preprocess_data.py --num-shards 2`: each task takes its index from
    SLURM_PROCID; two plain processes with --num-shards 2 --shard-index I outside Slurm write
    the same bytes. Either set merges to one process's output."""
    under_srun = tmp_path / "srun" / "mix"
    proc = preprocess(corpus.glob, under_srun, corpus.spm, "--workers", "1", "--num-shards", "2",
                      env=slurm_cluster.env, runner=("srun", "-n", "2", "--cpus-per-task=1"))
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    for i in range(2):
        assert f"shard {i} of 2 (from --num-shards and SLURM_PROCID)" in proc.stderr, \
            proc.stderr[-3000:]
    assert_merge_is_reference(under_srun, 2, corpus.reference, tmp_path / "m1")

    plain = tmp_path / "plain" / "mix"
    procs = [subprocess.Popen([sys.executable, str(PREPROCESS), "--input", corpus.glob,
                               "--output-prefix", str(plain), "--tokenizer-model", corpus.spm,
                               "--no-progress", *FLAGS, "--workers", "1", "--num-shards", "2",
                               "--shard-index", str(i)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in results]
    for a, b in zip(shard_prefixes(plain, 2), shard_prefixes(under_srun, 2)):
        for ext in (".bin", ".idx"):
            assert Path(a + ext).read_bytes() == Path(b + ext).read_bytes(), a + ext
    assert_merge_is_reference(plain, 2, corpus.reference, tmp_path / "m2")

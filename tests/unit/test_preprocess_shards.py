"""Preprocessing in shards (megatron/data/preprocess/sharding.py, manifest.py and
preprocess_data.py --num-shards): plans by hand, the shards against one process's run, the shard
from flags and Slurm's environment, re-runs, the manifest."""

import gzip
import json
import os
from pathlib import Path

import numpy as np
import pytest

from data_tools import merge_datasets, preprocess_data
from megatron.data.preprocess import manifest as manifest_mod
from megatron.data.preprocess.jsonl import read_chunks
from megatron.data.preprocess.sharding import (
    Piece,
    ShardChoice,
    ShardFlagError,
    read_piece_chunks,
    shard_from_env,
    shard_plan,
    shard_prefix,
)
from megatron.data.storage.indexed_dataset import IndexedDataset


def write_lines(path, lengths):
    """A file of lines of the given byte lengths (newline included), each line distinct."""
    with open(path, "wb") as f:
        for i, n in enumerate(lengths):
            f.write((str(i % 10) * (n - 1)).encode() + b"\n")
    return str(path)


# --- plans by hand ----------------------------------------------------------------------------


def test_whole_files_when_they_balance(tmp_path):
    # 4 files of 100 bytes, 2 shards: the cut at 200 is a file boundary
    paths = [write_lines(tmp_path / f"{c}.jsonl", [10] * 10) for c in "abcd"]
    plan = shard_plan(paths, 2)
    assert plan == [[Piece(0, paths[0], 0, 100), Piece(1, paths[1], 0, 100)],
                    [Piece(2, paths[2], 0, 100), Piece(3, paths[3], 0, 100)]]


def test_a_large_file_is_cut_after_a_newline(tmp_path):
    # one file of lines 30, 30, 30, 30, 30, 30 bytes (180): a cut aimed at 90 lands on a line
    # start (3 lines); aimed at 60 and 120 for 3 shards: line starts too
    path = write_lines(tmp_path / "a.jsonl", [30] * 6)
    assert shard_plan([path], 2) == [[Piece(0, path, 0, 90)], [Piece(0, path, 90, 180)]]
    # lines 50, 50, 50, 30 (180): the cut aimed at 90 is inside line 2 (50..100): moves to 100
    path = write_lines(tmp_path / "b.jsonl", [50, 50, 50, 30])
    assert shard_plan([path], 2) == [[Piece(0, path, 0, 100)], [Piece(0, path, 100, 180)]]


def test_a_cut_spans_files_and_lines(tmp_path):
    # a: 40 bytes, b: 200 bytes of 20-byte lines; total 240, 3 shards aim at 80 and 160: both
    # fall in b (at 40 and 120 into it), on line starts, 40 bytes from its edges (> 5% of 80)
    a = write_lines(tmp_path / "a.jsonl", [20, 20])
    b = write_lines(tmp_path / "b.jsonl", [20] * 10)
    assert shard_plan([a, b], 3) == [
        [Piece(0, a, 0, 40), Piece(1, b, 0, 40)],
        [Piece(1, b, 40, 120)],
        [Piece(1, b, 120, 200)]]


def test_compressed_files_stay_whole(tmp_path):
    paths = []
    for name in ("a", "b"):
        with gzip.open(tmp_path / f"{name}.jsonl.gz", "wb") as f:
            f.write(b'{"text": "x"}\n' * 50)
        paths.append(str(tmp_path / f"{name}.jsonl.gz"))
    sizes = [os.path.getsize(p) for p in paths]
    plan = shard_plan(paths, 4)
    # every cut snaps to a file edge; a shard may be empty
    assert [p for shard in plan for p in shard] == [Piece(0, paths[0], 0, sizes[0]),
                                                    Piece(1, paths[1], 0, sizes[1])]
    assert all(p.start == 0 for shard in plan for p in shard)
    assert sum(1 for shard in plan if not shard) == 2


def test_a_cut_near_a_file_edge_snaps_to_it(tmp_path):
    # a: 1000 bytes, b: 1002 bytes; 2 shards aim at 1001: 1 byte from a's end (< 5% of 1001)
    a = write_lines(tmp_path / "a.jsonl", [100] * 10)
    b = write_lines(tmp_path / "b.jsonl", [100] * 9 + [102])
    assert shard_plan([a, b], 2) == [[Piece(0, a, 0, 1000)], [Piece(1, b, 0, 1002)]]


def test_pieces_read_the_same_lines_with_their_line_numbers(tmp_path):
    path = write_lines(tmp_path / "a.jsonl", [7, 13, 30, 5, 21, 9, 40, 2])
    whole = [(c.first_line + k, line) for c in read_chunks([path]) for k, line in
             enumerate(c.lines)]
    for n in (1, 2, 3, 4, 5):
        got = [(c.first_line + k, line) for shard in shard_plan([path], n)
               for c in read_piece_chunks(shard, chunk_bytes=16) for k, line in enumerate(c.lines)]
        assert got == whole, n


# --- which shard --------------------------------------------------------------------------------


@pytest.mark.parametrize("num, index, env, expected", [
    (None, None, {}, None),
    (4, 2, {}, ShardChoice(2, 4, "--num-shards/--shard-index")),
    # flags win over a Slurm array
    (4, 2, {"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "8"},
     ShardChoice(2, 4, "--num-shards/--shard-index")),
    ({}, {}, {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "8",
              "SLURM_ARRAY_TASK_MIN": "0"}, ShardChoice(3, 8, "SLURM_ARRAY_TASK_ID")),
    # --array=1-8: task 1 is shard 0
    ({}, {}, {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "8",
              "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_MAX": "8"},
     ShardChoice(0, 8, "SLURM_ARRAY_TASK_ID")),
    # --array=1-7:2 (1, 3, 5, 7): task 5 is shard 2
    ({}, {}, {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_COUNT": "4",
              "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_STEP": "2"},
     ShardChoice(2, 4, "SLURM_ARRAY_TASK_ID")),
    # srun -n 4: only inside a step
    ({}, {}, {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0"},
     ShardChoice(1, 4, "SLURM_PROCID")),
    ({}, {}, {"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, None),  # the batch script itself
    # srun -n 2 inside task 3 of --array=1-3:2 (as a real Slurm sets them): shard 1 * 2 + 1 of 4
    ({}, {}, {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_STEP": "2",
              "SLURM_ARRAY_TASK_COUNT": "2", "SLURM_PROCID": "1", "SLURM_NTASKS": "2",
              "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2"},
     ShardChoice(3, 4, "SLURM_ARRAY_TASK_ID and SLURM_PROCID")),
    # the batch script of that array task (no step): the array alone
    ({}, {}, {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_STEP": "2",
              "SLURM_ARRAY_TASK_COUNT": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"},
     ShardChoice(1, 2, "SLURM_ARRAY_TASK_ID")),
    ({}, {}, {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_ID": "0"}, None),
    (None, 1, {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0"},
     ShardChoice(1, 4, "--shard-index and SLURM_PROCID")),
])
def test_shard_from_flags_and_environment(num, index, env, expected):
    num = None if num == {} else num
    index = None if index == {} else index
    assert shard_from_env(num, index, env) == expected


@pytest.mark.parametrize("num, index, env, flag", [
    (4, 4, {}, "--shard-index 4"),
    (4, None, {}, "--num-shards needs --shard-index"),
    (None, 0, {}, "--shard-index needs --num-shards"),
    (0, 0, {}, "--num-shards 0"),
    (None, None, {"SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_COUNT": "4",
                  "SLURM_ARRAY_TASK_MIN": "1"}, "SLURM_ARRAY_TASK_ID=7"),
])
def test_bad_shard_choices_name_the_flag(num, index, env, flag):
    with pytest.raises(ShardFlagError, match=flag):
        shard_from_env(num, index, env)


# --- the shards against one process -------------------------------------------------------------


@pytest.fixture(scope="module")
def inputs(corpora_dir, tmp_path_factory):
    """Three inputs: a plain file large enough to be cut (~120 KB), a gzip file, a small one."""
    folder = tmp_path_factory.mktemp("shard_inputs")
    with open(corpora_dir / "en_wikitext2.jsonl", "rb") as f:
        lines = f.readlines()
    with open(corpora_dir / "zh_cmrc2018_wiki.jsonl", "rb") as f:
        zh = f.readlines()
    (folder / "a.jsonl").write_bytes(b"".join(zh[:20]))
    (folder / "b.jsonl").write_bytes(b"".join(lines[:60]) + b"not json\n" + b"".join(lines[60:120]))
    with gzip.open(folder / "c.jsonl.gz", "wb") as f:
        f.write(b"".join(zh[20:60]))
    return folder


def preprocess(spm, inputs, out, *extra):
    return preprocess_data.main(["--input", str(inputs / "*.jsonl*"), "--output-prefix",
                                 str(out), "--tokenizer-model", str(spm), "--append-eod",
                                 "--workers", "1", "--chunk-mb", "0.01", "--no-progress",
                                 *map(str, extra)])


@pytest.fixture(scope="module")
def reference(inputs, spm_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "mix"
    assert preprocess(spm_model, inputs, out) == 0
    return out


def concatenated(prefixes):
    tokens, bounds = [], []
    for prefix in prefixes:
        ds = IndexedDataset(prefix)
        doc_idx = np.asarray(ds.document_indices)
        for d in range(ds.num_documents):
            seqs = [ds[j].tolist() for j in range(doc_idx[d], doc_idx[d + 1])]
            bounds.append([len(s) for s in seqs])
            tokens.extend(t for s in seqs for t in s)
    return tokens, bounds


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_shards_in_order_are_one_process_run(spm_model, inputs, reference, tmp_path, n):
    plan = shard_plan(sorted(str(p) for p in inputs.glob("*.jsonl*")), n)
    if n == 3:  # the plain file b is cut mid-file
        assert any(p.start > 0 for shard in plan for p in shard)
    out = tmp_path / "mix"
    for i in range(n):
        assert preprocess(spm_model, inputs, out, "--num-shards", n, "--shard-index", i) == 0
    shards = [f"{shard_prefix(out, i, n)}_text_document" for i in range(n)]
    assert concatenated(shards) == concatenated([f"{reference}_text_document"])
    # the bad line is reported by the shard that read it, with its line number in the file
    reports = [Path(f"{shard_prefix(out, i, n)}_bad_lines.tsv") for i in range(n)]
    rows = [r.read_text().splitlines()[1:] for r in reports if r.exists()]
    assert rows == [Path(f"{reference}_bad_lines.tsv").read_text().splitlines()[1:]]
    # the manifest, written by the last shard, lists the set
    listed = json.loads(Path(f"{out}_text_document.shards.json").read_text())
    assert listed["num_shards"] == n
    assert [s["prefix"] for s in listed["shards"]] == [os.path.basename(s) for s in shards]
    ref = IndexedDataset(f"{reference}_text_document")
    assert listed["documents"] == ref.num_documents
    assert listed["tokens"] == sum(s["tokens"] for s in listed["shards"]) == ref.num_tokens


def test_shards_from_a_slurm_array(spm_model, inputs, reference, tmp_path, monkeypatch, capsys):
    out = tmp_path / "mix"
    for task in (1, 2):  # sbatch --array=1-2
        monkeypatch.setenv("SLURM_ARRAY_TASK_ID", str(task))
        monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "1")
        monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "2")
        assert preprocess(spm_model, inputs, out) == 0
        assert f"shard {task - 1} of 2 (from SLURM_ARRAY_TASK_ID)" in capsys.readouterr().err
    shards = [f"{shard_prefix(out, i, 2)}_text_document" for i in range(2)]
    assert concatenated(shards) == concatenated([f"{reference}_text_document"])


def test_a_rerun_rewrites_its_own_files_with_the_same_bytes(inputs, tmp_path, spm_model):
    out = tmp_path / "mix"
    for i in range(2):
        assert preprocess(spm_model, inputs, out, "--num-shards", 2, "--shard-index", i) == 0
    files = sorted(p for p in tmp_path.iterdir())
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in files}
    assert preprocess(spm_model, inputs, out, "--num-shards", 2, "--shard-index", 1) == 0
    after = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(tmp_path.iterdir())}
    assert {k: v[0] for k, v in after.items()} == {k: v[0] for k, v in before.items()}
    untouched = [k for k in before if "-00000-of-" in k]
    assert untouched and all(after[k][1] == before[k][1] for k in untouched)


def test_the_manifest_is_written_once_by_the_last_shard(inputs, tmp_path, spm_model,
                                                        monkeypatch, capsys):
    out = tmp_path / "mix"
    manifest = Path(f"{out}_text_document.shards.json")
    writes = []
    real = manifest_mod.write_manifest
    monkeypatch.setattr(manifest_mod, "write_manifest",
                        lambda *a, **k: writes.append(a) or real(*a, **k))
    for i in (2, 0):
        assert preprocess(spm_model, inputs, out, "--num-shards", 3, "--shard-index", i) == 0
        assert not manifest.exists()
    assert preprocess(spm_model, inputs, out, "--num-shards", 3, "--shard-index", 1) == 0
    assert manifest.exists() and len(writes) == 1
    # after the fact, from the set's name alone: the same bytes
    text = manifest.read_text()
    manifest.unlink()
    base, suffix, count = manifest_mod.find_set(f"{out}_text_document")
    assert (base, suffix, count) == (str(out), "_text_document", 3)
    assert merge_datasets.main(["--manifest-only", f"{out}_text_document"]) == 0
    assert manifest.read_text() == text
    # a missing shard is named
    manifest.unlink()
    os.unlink(f"{shard_prefix(out, 1, 3)}_text_document.idx")
    assert merge_datasets.main(["--manifest-only", f"{out}_text_document"]) == 1
    assert "shard " + f"{shard_prefix(out, 1, 3)}_text_document is missing" in \
        capsys.readouterr().err
    assert not manifest.exists()


@pytest.mark.parametrize("flags, message", [
    (["--num-shards", "2", "--shard-index", "2"], "--shard-index 2: must be in 0..1"),
    (["--num-shards", "2"], "--num-shards needs --shard-index"),
])
def test_bad_shard_flags_exit_2_before_anything_is_written(inputs, tmp_path, spm_model, flags,
                                                           message, capsys):
    with pytest.raises(SystemExit) as e:
        preprocess(spm_model, inputs, tmp_path / "mix", *flags)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_more_shards_than_compressed_files_leaves_empty_shards(corpora_dir, tmp_path, spm_model):
    # two gzip files, four shards: two shards get no input and write empty datasets, so that the
    # set is complete and still concatenates to one process's run
    with open(corpora_dir / "en_shakespeare.jsonl", "rb") as f:
        lines = f.readlines()
    folder = tmp_path / "in"
    folder.mkdir()
    for name, part in (("a", lines[:30]), ("b", lines[30:50])):
        with gzip.open(folder / f"{name}.jsonl.gz", "wb") as f:
            f.write(b"".join(part))
    assert preprocess(spm_model, folder, tmp_path / "one" / "mix") == 0
    out = tmp_path / "set" / "mix"
    for i in range(4):
        assert preprocess(spm_model, folder, out, "--num-shards", 4, "--shard-index", i) == 0
    shards = [f"{shard_prefix(out, i, 4)}_text_document" for i in range(4)]
    assert sorted(IndexedDataset(s).num_documents == 0 for s in shards) == [False, False, True,
                                                                             True]
    assert concatenated(shards) == concatenated([f"{tmp_path}/one/mix_text_document"])
    listed = json.loads(Path(f"{out}_text_document.shards.json").read_text())
    assert listed["documents"] == 50


def test_strict_stops_only_the_shard_holding_the_bad_line(inputs, tmp_path, spm_model, capsys):
    # b.jsonl's line 61 is "not json"; with 3 shards it lies in one of them: that shard stops
    # naming file and line and leaves nothing, the others are written
    paths = sorted(str(p) for p in inputs.glob("*.jsonl*"))
    plan = shard_plan(paths, 3)
    out = tmp_path / "mix"
    codes = [preprocess(spm_model, inputs, out, "--num-shards", 3, "--shard-index", i, "--strict")
             for i in range(3)]
    with open(paths[1], "rb") as f:
        bad_at = f.read().index(b"not json\n")
    holder = next(i for i, shard in enumerate(plan) for p in shard
                  if p.file_index == 1 and p.start <= bad_at < p.end)
    assert codes == [1 if i == holder else 0 for i in range(3)]
    assert f"{paths[1]}:61: invalid JSON" in capsys.readouterr().err
    assert not list(tmp_path.glob(f"mix-{holder:05d}-of-00003*"))
    assert all(Path(f"{shard_prefix(out, i, 3)}_text_document.idx").exists()
               for i in range(3) if i != holder)
    assert not Path(f"{out}_text_document.shards.json").exists()


def test_a_folder_named_as_a_shards_index_is_no_shard(tmp_path):
    """A set is complete only when each shard's .idx is a file: a folder in its place (a
    failed task's leftover, an obstacle) leaves the shard missing, so no manifest is written."""
    from megatron.data.preprocess.manifest import missing_shards, set_member

    prefix = str(tmp_path / "corpus")
    members = [set_member(prefix, "_text_document", i, 2) for i in range(2)]
    (tmp_path / (Path(members[0]).name + ".idx")).write_bytes(b"")
    (tmp_path / (Path(members[1]).name + ".idx")).mkdir()
    assert missing_shards(prefix, "_text_document", 2) == [members[1]]

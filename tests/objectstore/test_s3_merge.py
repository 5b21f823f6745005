"""merge_datasets.py from and to s3:// on a real S3 server (`rclone serve s3`, conftest.py): inputs
read by ranged reads, the output staged and uploaded, each the same bytes as the local merge; a
missing object named, exit 2, nothing uploaded."""

import os
from pathlib import Path

import numpy as np
import pytest

from data_tools import merge_datasets as cli
from megatron.data.storage import merge
from megatron.data.storage.data_meta import DatasetMeta
from megatron.data.storage.indexed_dataset import IndexedDatasetBuilder
from megatron.data.storage.object_storage import ObjectStorage

META = DatasetMeta(tokenizer={"type": "SentencePieceTokenizer", "model": "t5.model"}, eod_id=1,
                   eod_appended=True, dtype="", documents=0, sequences=0, tokens=0)


def write(prefix, rng, documents):
    with IndexedDatasetBuilder(prefix + ".bin", np.uint16) as b:
        for _ in range(documents):
            for _ in range(int(rng.integers(1, 4))):
                b.add_item(rng.integers(0, 30000, size=int(rng.integers(0, 12))))
            b.end_document()
        b.finalize(prefix + ".idx", META)
    return prefix


@pytest.fixture
def shards(s3_server, s3_env, tmp_path, monkeypatch):
    """Three local shards (the second empty), uploaded to s3://merge-in/parts/; chunks small
    enough that every array takes several ranged reads."""
    monkeypatch.setattr(merge, "CHUNK_ITEMS", 5)
    monkeypatch.setattr(merge, "COPY_BYTES", 64)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # the tool's default settings
    storage = ObjectStorage()
    for bucket in ("merge-in", "merge-out"):
        s3_server.make_bucket(bucket)
    rng = np.random.default_rng(0)
    (tmp_path / "parts").mkdir()
    local = [write(str(tmp_path / "parts" / f"shard-{k}"), rng, n)
             for k, n in enumerate((20, 0, 13))]
    # The empty .bin goes last: rclone answers a PUT that follows an empty one on the same
    # connection only after a 60 s timeout (the merge itself only reads).
    files = sorted((os.path.getsize(p + suffix) == 0, p + suffix) for p in local
                   for suffix in (".bin", ".idx", ".meta.json"))
    for _, path in files:
        storage.upload(path, f"s3://merge-in/parts/{Path(path).name}")
    return local, [f"s3://merge-in/parts/{Path(p).name}" for p in local]


def files(folder: Path, name: str):
    return {p.name[len(name):]: p.read_bytes() for p in folder.iterdir()
            if p.name.startswith(name)}


@pytest.mark.parametrize("preload", [0, 1 << 20], ids=["ranged-reads", "whole-objects"])
def test_merge_from_and_to_s3_equals_the_local_merge(s3_server, shards, tmp_path, monkeypatch,
                                                     preload):
    """Inputs read in chunks of ranged reads, or (small ones, PRELOAD_BYTES) fetched whole
    while the one before merges."""
    monkeypatch.setattr(merge, "PRELOAD_BYTES", preload)
    local, remote = shards
    assert cli.main(["--input", *local, "--output-prefix", str(tmp_path / "local")]) == 0
    expected = files(tmp_path, "local")
    assert sorted(expected) == [".bin", ".idx", ".meta.json"]

    assert cli.main(["--input", *remote, "--output-prefix", str(tmp_path / "fetched")]) == 0
    assert files(tmp_path, "fetched") == expected

    assert cli.main(["--input", remote[0], local[1], remote[2], "--output-prefix",
                     f"s3://merge-out/all-{preload}/merged",
                     "--staging-dir", str(tmp_path / "stage")]) == 0
    assert files(Path(s3_server.root) / "merge-out" / f"all-{preload}", "merged") == expected
    assert list((tmp_path / "stage").iterdir()) == []  # the staging copy removed


def test_a_missing_object_is_named_and_nothing_uploaded(s3_server, shards, tmp_path, capsys):
    _, remote = shards
    s3_server.client().delete_object(Bucket="merge-in", Key="parts/shard-2.bin")
    assert cli.main(["--input", *remote, "--output-prefix", "s3://merge-out/bad/merged",
                     "--staging-dir", str(tmp_path / "stage")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: s3://merge-in/parts/shard-2.bin: does not exist; nothing was written"
    assert not (Path(s3_server.root) / "merge-out" / "bad").exists()

"""A shard set on the real S3 server (conftest.py) as one --data-path: the documents and samples
of the same set read from local files, its shards' .idx fetched once each; a missing shard named."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_shard_set import write_set  # noqa: E402

from megatron.data.datasets.builder import (  # noqa: E402
    DataConfig,
    build_datasets,
    data_file_problems,
)
from megatron.data.datasets.t5_dataset import T5DatasetConfig, T5SpecialTokens  # noqa: E402
from megatron.data.storage.object_storage import ObjectStorage, StorageSettings  # noqa: E402
from megatron.data.storage.shard_set import ShardSet, open_dataset  # noqa: E402

TOKENS = T5SpecialTokens(0, 1, 0, tuple(range(4100, 4000, -1)))


@pytest.fixture(scope="module")
def local_set(train_data, tmp_path_factory):
    return write_set(train_data.root / "corpus.jsonl", train_data.spm,
                     tmp_path_factory.mktemp("set") / "mix")


def upload_set(s3_server, local_set, bucket="shards", skip=()):
    s3_server.make_bucket(bucket)
    client = s3_server.client()
    for path in Path(local_set).parent.iterdir():
        if path.is_file() and not any(s in path.name for s in skip):
            client.upload_file(str(path), bucket, f"corpus/{path.name}")
    return f"s3://{bucket}/corpus/{Path(local_set).name}"


def test_a_set_on_s3_reads_as_the_local_set(s3_server, s3_env, local_set, tmp_path):
    url = upload_set(s3_server, local_set)
    storage = ObjectStorage(StorageSettings(cache_path=str(tmp_path / "node")))
    remote, local = open_dataset(url, storage=storage), ShardSet(local_set)
    assert isinstance(remote, ShardSet)
    # the manifest and each shard's index fetched once (a pool of max_connections fetches them)
    assert sorted(storage.downloads) == [
        f"s3://shards/corpus/mix-{i:05d}-of-00003_text_document.idx" for i in range(3)] + [
        "s3://shards/corpus/mix_text_document.shards.json"]
    ShardSet(url, storage=storage)
    assert len(storage.downloads) == 4  # a second open finds the node-local copies
    assert np.array_equal(remote.document_indices, local.document_indices)
    for i in range(len(local)):
        assert np.array_equal(remote[i], local[i])
    seam = len(local.shards[0])
    assert [r[0].url for r in remote.slice_reads(seam - 1, seam + 1)] == [
        "s3://shards/corpus/mix-00000-of-00003_text_document.bin",
        "s3://shards/corpus/mix-00001-of-00003_text_document.bin"]
    config = dict(split="98,2,0", t5=T5DatasetConfig(encoder_seq_length=64, seed=5))
    on_s3 = build_datasets(DataConfig([url], data_cache_path=str(tmp_path / "c1"), **config),
                           TOKENS, (50, 8, 0), storage)
    on_disk = build_datasets(DataConfig([local_set], data_cache_path=str(tmp_path / "c2"),
                                        **config), TOKENS, (50, 8, 0))
    for split in ("train", "valid"):
        for i in range(len(on_disk[split])):
            assert np.array_equal(on_s3[split].raw_tokens(i), on_disk[split].raw_tokens(i))


def test_a_missing_shard_on_s3_is_named(s3_server, s3_env, local_set, tmp_path):
    url = upload_set(s3_server, local_set, "broken", skip=("00002-of",))
    storage = ObjectStorage(StorageSettings(cache_path=str(tmp_path / "node")))
    problems = data_file_problems([url], storage=storage)
    assert problems == [f"--data-path {url}: shard s3://broken/corpus/mix-00002-of-00003_text_"
                        f"document of the set {url} is missing (1 of 3 are; {url}.shards.json "
                        "lists them): run its preprocessing task again"]

"""Opening s3:// data reads a bounded number of `.bin` bytes (a small and a much larger corpus the
same), preprocess's sidecar is uploaded with its outputs, an unwritable destination is refused
before any work, and index caches land in one folder per prefix (not nested in themselves)."""

import os
from pathlib import Path

import numpy as np
import pytest

from megatron.data.storage.object_storage import ObjectStorage, StorageSettings
from megatron.data.datasets.builder import DataConfig, build_datasets
from megatron.data.storage.data_meta import SAMPLE_DOCUMENTS, read_meta
from megatron.data.storage.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.data.datasets.t5_dataset import T5DatasetConfig, T5SpecialTokens

TOKENS = T5SpecialTokens(0, 1, 0, tuple(range(1999, 1899, -1)))


@pytest.fixture
def storage(s3_env, tmp_path):
    """Each test's client reads its environment; index copies go to the test's folder."""
    return ObjectStorage(StorageSettings(cache_path=str(tmp_path / "node"), retries=3,
                                         timeout_s=5.0, backoff_s=0.01))


def synthetic(prefix, n_docs, seed=3):
    """n_docs random documents of 5..60 ids in [10, 1000), each ending with EOS (1)."""
    rng = np.random.default_rng(seed)
    with IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16) as b:
        for _ in range(n_docs):
            b.add_item(np.append(rng.integers(10, 1000, size=int(rng.integers(5, 60))), 1))
            b.end_document()
        b.finalize(prefix + ".idx")
    return prefix


def upload(s3_server, bucket, key, local_prefix):
    client = s3_server.client()
    if bucket not in {b["Name"] for b in client.list_buckets()["Buckets"]}:
        client.create_bucket(Bucket=bucket)
    for suffix in (".bin", ".idx"):
        client.upload_file(local_prefix + suffix, bucket, key + suffix)
    return f"s3://{bucket}/{key}"


def test_bytes_fetched_at_open_do_not_grow_with_the_corpus(s3_server, tmp_path, storage):
    fetched = {}
    for name, n_docs in (("small", 300), ("large", 200_000)):
        url = upload(s3_server, "sizes", f"{name}_text_document",
                     synthetic(str(tmp_path / name), n_docs))
        config = DataConfig([url], split="100,0,0", data_cache_path=str(tmp_path / "cache"),
                            t5=T5DatasetConfig(encoder_seq_length=64, seed=1))
        train = build_datasets(config, TOKENS, (24, 0, 0), storage)["train"]
        reader = train.indexed.remote
        at_open = (reader.fetched_bytes, reader.requests)
        samples = [train[i] for i in range(24)]
        fetched[name] = (at_open, reader.fetched_bytes, reader.size)
        assert train.eod.appended and len(samples) == 24
    assert fetched["large"][2] > 500 * fetched["small"][2]
    # at open: one token of each sampled document, one ranged read each
    assert fetched["small"][0] == fetched["large"][0] == (SAMPLE_DOCUMENTS * 2, SAMPLE_DOCUMENTS)
    # then the samples' own bytes: 24 samples of about 70 tokens, merged with their neighbours
    # (64 KiB merge gap), a small share of the 12 MB object
    at_open, total, size = fetched["large"]
    assert total - at_open[0] < 24 * 2 * (64 * 1024 + 200) and total < size / 10


def test_preprocess_uploads_the_sidecar(s3_server, train_data, tmp_path, storage):
    from data_tools import preprocess_data

    s3_server.client().create_bucket(Bucket="sidecar")
    staging = tmp_path / "staging"
    rc = preprocess_data.main(["--input", str(train_data.root / "corpus.jsonl"),
                               "--output-prefix", "s3://sidecar/out/mix", "--staging-dir",
                               str(staging), "--tokenizer-model", train_data.spm,
                               "--workers", "1", "--no-progress"])
    assert rc == 0
    meta = read_meta("s3://sidecar/out/mix_text_document", storage)
    ds = IndexedDataset("s3://sidecar/out/mix_text_document", storage=storage)
    assert (meta.eod_appended, meta.documents, meta.tokens) == (False, ds.num_documents,
                                                                ds.num_tokens)
    # no probe object left, nothing left in the staging folder
    root = Path(s3_server.root) / "sidecar" / "out"
    assert sorted(p.name for p in root.iterdir()) == [
        "mix_text_document.bin", "mix_text_document.idx", "mix_text_document.meta.json"]
    assert os.listdir(staging) == []


def test_preprocess_into_a_missing_bucket_stops_before_any_work(s3_server, s3_env, train_data,
                                                                 tmp_path, capsys):
    from data_tools import preprocess_data

    staging = tmp_path / "staging"
    rc = preprocess_data.main(["--input", str(train_data.root / "corpus.jsonl"),
                               "--output-prefix", "s3://no-such-bucket/out/mix",
                               "--staging-dir", str(staging), "--tokenizer-model",
                               train_data.spm, "--workers", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "--output-prefix s3://no-such-bucket/out/mix is not writable" in err
    assert "NoSuchBucket" in err or "no such bucket" in err
    assert "done in" not in err  # nothing was tokenized
    assert os.listdir(staging) == []


def test_the_staging_dir_flag_is_used(s3_server, s3_env, train_data, tmp_path, capsys):
    from data_tools import preprocess_data

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    rc = preprocess_data.main(["--input", str(train_data.root / "corpus.jsonl"),
                               "--output-prefix", "s3://any/out/mix", "--staging-dir",
                               str(blocker / "sub"), "--tokenizer-model", train_data.spm,
                               "--workers", "1", "--no-progress"])
    assert rc == 2 and f"--staging-dir {blocker / 'sub'}" in capsys.readouterr().err


def test_index_caches_of_s3_data_are_not_nested_in_themselves(s3_server, tmp_path, storage):
    url = upload(s3_server, "cachepath", "corpus/en/gut_text_document",
                 synthetic(str(tmp_path / "gut"), 300))
    cache = tmp_path / "cache"
    config = DataConfig([url], split="100,0,0", data_cache_path=str(cache),
                        t5=T5DatasetConfig(encoder_seq_length=64, seed=1))
    build_datasets(config, TOKENS, (24, 0, 0), storage)
    folder = cache / "s3" / "cachepath" / "corpus" / "en" / "gut_text_document_cache"
    entries = sorted(os.listdir(folder))
    assert entries and all(e.startswith("gut_text_document_train-") for e in entries)
    assert not (folder / "s3").exists()

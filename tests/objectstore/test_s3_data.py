"""Training data read from a real S3 server (`rclone serve s3`, conftest.py) against the same data
read from local files: sample for sample for T5 span corruption, Megatron's T5 layout, CPM-2's
three files and a blend of a local and an S3 prefix, through the loader's read-ahead; the index
downloaded once per node and again when the object changes; an object shorter than its index
refused at open; preprocess writing to s3:// and inspect_dataset reading from it."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron.data.storage.object_storage import ObjectStorage, StorageSettings
from megatron.data.datasets.builder import DataConfig, build_datasets, data_file_problems
from megatron.data.datasets.cpm2_dataset import cpm2_prefixes
from megatron.data.storage.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    data_file_path,
    index_file_path,
)
from megatron.data.storage.readahead import ReadAheadBatchSampler, ReadAheadDataset
from megatron.data.datasets.t5_dataset import T5DatasetConfig, T5SpecialTokens
from megatron.data.tokenizers.tokenizer import TokenizerSpec, build_tokenizer
from megatron.training.loaders import collate_tensors

REPO = Path(__file__).resolve().parents[2]
SENTENCE_TOKENS = T5SpecialTokens(0, 1, 0, tuple(range(199, 99, -1)))
CPM2_TOKENS = T5SpecialTokens(pad_id=5, eos_id=7, decoder_start_token_id=1,
                              sentinel_ids=tuple(range(200, 232)))


@pytest.fixture
def storage(s3_env, tmp_path):
    """Each test's client reads its environment; index copies go to the test's folder."""
    return ObjectStorage(StorageSettings(cache_path=str(tmp_path / "node"), retries=3,
                                         timeout_s=5.0, backoff_s=0.01))


def upload(s3_server, bucket, prefix, local_prefix):
    """PREFIX.bin and .idx of `local_prefix` as objects under s3://bucket/prefix."""
    client = s3_server.client()
    if bucket not in {b["Name"] for b in client.list_buckets()["Buckets"]}:
        client.create_bucket(Bucket=bucket)
    for suffix in (".bin", ".idx"):
        client.upload_file(str(local_prefix) + suffix, bucket, prefix + suffix)
    return f"s3://{bucket}/{prefix}"


def sentence_data(folder):
    """Sentence-level data for Megatron's T5 layout: 200 documents of 1..8 sentences."""
    prefix = str(folder / "sentences_text_sentence")
    rng = np.random.default_rng(5)
    with IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16) as b:
        for _ in range(200):
            for _ in range(int(rng.integers(1, 9))):
                b.add_item(rng.integers(200, 1000, size=int(rng.integers(1, 40))))
            b.end_document()
        b.finalize(prefix + ".idx")
    return prefix


def cpm2_data(folder):
    """CPM-2's three files for 60 documents (context with placeholders, target, offsets)."""
    prefix = str(folder / "cpm2")
    rng = np.random.default_rng(6)
    rows = ([], [], [])
    for _ in range(60):
        raw = list(rng.integers(10, 90, size=int(rng.integers(20, 80)))) + [7]
        context, target, offsets, prev = [], [], [], 0
        cuts = sorted(rng.choice(np.arange(1, len(raw) - 1), size=4, replace=False))
        spans = [(cuts[0], cuts[1]), (cuts[2], cuts[3]), (len(raw) - 1, len(raw))]
        for k, (s, e) in enumerate(spans):
            context += raw[prev:s] + [100 + k]
            offsets += [len(target), 1 + e - s]
            target += [100 + k] + raw[s:e]
            prev = e
        for row, values in zip(rows, (context, target, offsets)):
            row.append(values)
    for p, values in zip(cpm2_prefixes(prefix), rows):
        with IndexedDatasetBuilder(data_file_path(p), dtype=np.uint16) as b:
            for row in values:
                b.add_item(np.asarray(row, dtype=np.int64))
                b.end_document()
            b.finalize(index_file_path(p))
    return prefix


def datasets(storage, data_path, tmp_path, objective="span-corruption", tokens=None,
             decoder=None, samples=(64, 8, 8)):
    config = DataConfig(data_path=data_path, split="90,5,5",
                        data_cache_path=str(tmp_path / f"cache-{len(os.listdir(tmp_path))}"),
                        t5=T5DatasetConfig(encoder_seq_length=64, decoder_seq_length=decoder,
                                           seed=11), objective=objective)
    return build_datasets(config, tokens, samples, storage)


def read_through_loader(dataset, batches, workers, depth=2):
    """The samples as the trainer's loader reads them: ReadAheadDataset behind a DataLoader
    whose batch sampler carries the next batches' indices."""
    loader = torch.utils.data.DataLoader(
        ReadAheadDataset(dataset), batch_sampler=ReadAheadBatchSampler(batches, depth, workers),
        collate_fn=collate_tensors, num_workers=workers)
    return list(loader)


def assert_same_batches(got, dataset, batches):
    assert len(got) == len(batches)
    for batch, indices in zip(got, batches):
        want = collate_tensors([dataset[i] for i in indices])
        assert batch.keys() == want.keys()
        for key in want:
            assert torch.equal(batch[key], want[key]), key


@pytest.fixture
def spm_tokens(train_data):
    tokenizer = build_tokenizer(TokenizerSpec("SentencePieceTokenizer", train_data.spm),
                                extra_ids=100)
    return T5SpecialTokens.from_tokenizer(tokenizer)


def test_t5_samples_from_s3_equal_local_ones_through_the_read_ahead(s3_server, train_data,
                                                                     tmp_path, spm_tokens,
                                                                     storage):
    url = upload(s3_server, "t5data", "corpus/mix_text_document", train_data.prefix)
    local = datasets(storage, [train_data.prefix], tmp_path, tokens=spm_tokens)["train"]
    # this object is small: no merging of near ranges
    unmerged = ObjectStorage(dataclasses.replace(storage.settings, merge_gap=0))
    remote = datasets(unmerged, [url], tmp_path, tokens=spm_tokens)["train"]
    order = np.random.default_rng(0).permutation(len(local))[:48]
    batches = [order[i:i + 4].tolist() for i in range(0, len(order), 4)]
    reader = remote.indexed.remote
    opened = reader.fetched_bytes  # at open: a sample of the documents' last tokens
    assert 0 < opened <= 64 * 2
    assert_same_batches(read_through_loader(remote, batches, 0), local, batches)
    # ranged reads of the samples' tokens only (48 samples of about 70 tokens, two bytes each,
    # and the next two batches' read ahead)
    assert 0 < reader.fetched_bytes - opened < 2 * 60 * 80 * 2
    assert_same_batches(read_through_loader(remote, batches, 2), local, batches)


def test_megatron_cpm2_and_blended_samples_from_s3_equal_local_ones(s3_server, train_data,
                                                                    tmp_path, spm_tokens,
                                                                    storage):
    sentences = sentence_data(tmp_path)
    url = upload(s3_server, "layouts", "sentences_text_sentence", sentences)
    local = datasets(storage, [sentences], tmp_path, "megatron", SENTENCE_TOKENS, 32)["train"]
    remote = datasets(storage, [url], tmp_path, "megatron", SENTENCE_TOKENS, 32)["train"]
    batches = [list(range(i, i + 4)) for i in range(0, 40, 4)]
    assert_same_batches(read_through_loader(remote, batches, 0), local, batches)

    cpm2 = cpm2_data(tmp_path)
    for p in cpm2_prefixes(cpm2):
        upload(s3_server, "layouts", Path(p).name, p)
    local = datasets(storage, [cpm2], tmp_path, tokens=CPM2_TOKENS, decoder=32,
                     samples=(32, 4, 4))
    remote = datasets(storage, ["s3://layouts/cpm2"], tmp_path, tokens=CPM2_TOKENS, decoder=32,
                      samples=(32, 4, 4))
    batches = [list(range(i, i + 4)) for i in range(0, 32, 4)]
    assert_same_batches(read_through_loader(remote["train"], batches, 0), local["train"],
                        batches)

    url = upload(s3_server, "layouts", "mix_text_document", train_data.prefix)
    other = str(tmp_path / "other")  # a second local prefix (a copy)
    _copy_prefix(train_data.prefix, other)
    local = datasets(storage, ["0.3", train_data.prefix, "0.7", other], tmp_path,
                     tokens=spm_tokens)
    blend = datasets(storage, ["0.3", url, "0.7", other], tmp_path, tokens=spm_tokens)
    batches = [list(range(i, i + 4)) for i in range(0, 48, 4)]
    assert_same_batches(read_through_loader(blend["train"], batches, 2), local["train"], batches)


def test_planning_records_the_reads_of_the_whole_sample(s3_server, train_data, tmp_path,
                                                       spm_tokens, storage, monkeypatch):
    """The read-ahead plans a sample from what its dataset says it reads (through a blend to
    its part), not by building it; the ranges planned are all those the whole build reads."""
    from megatron.data.storage.object_storage import RemoteBin
    from megatron.data.storage.readahead import planned_ranges

    def whole(dataset, indices):
        ranges, read = [], RemoteBin.read

        def recorded(self, start, end):
            ranges.append((start, end))
            return read(self, start, end)

        monkeypatch.setattr(RemoteBin, "read", recorded)
        for i in indices:
            dataset[i]
        monkeypatch.setattr(RemoteBin, "read", read)
        return sorted(ranges)

    def planned(dataset, indices):
        return sorted(r for rs in planned_ranges(dataset, indices).values() for r in rs)

    url = upload(s3_server, "plans", "mix_text_document", train_data.prefix)
    sentences = sentence_data(tmp_path)
    sentences_url = upload(s3_server, "plans", "sentences_text_sentence", sentences)
    for dataset in (datasets(storage, [url], tmp_path, tokens=spm_tokens)["train"],
                    datasets(storage, ["0.5", url, "0.5", url], tmp_path,
                             tokens=spm_tokens)["train"],
                    datasets(storage, [sentences_url], tmp_path, "megatron", SENTENCE_TOKENS,
                             32)["train"]):
        indices = list(range(0, len(dataset), 3))[:24]
        assert planned(dataset, indices) == whole(dataset, indices) != []


def _copy_prefix(source, target):
    for suffix in (".bin", ".idx"):
        Path(target + suffix).write_bytes(Path(source + suffix).read_bytes())


def test_the_index_is_downloaded_once_per_node_and_again_when_it_changes(s3_server, train_data,
                                                                         tmp_path, storage):
    url = upload(s3_server, "indexonce", "a/mix_text_document", train_data.prefix)
    code = ("import sys; from megatron.data.storage import object_storage as o; "
            "s = o.ObjectStorage(o.StorageSettings(cache_path=sys.argv[1])); "
            "from megatron.data.storage.indexed_dataset import IndexedDataset; "
            "IndexedDataset(sys.argv[2], storage=s); print(len(s.downloads))")
    node = str(tmp_path / "node-x")
    procs = [subprocess.Popen([sys.executable, "-c", code, node, url], stdout=subprocess.PIPE,
                              text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
             for _ in range(2)]
    counts = [int(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]
    assert sorted(counts) == [0, 1]  # two processes of one node: one download
    storage = ObjectStorage(dataclasses.replace(storage.settings, cache_path=node))
    IndexedDataset(url, storage=storage)
    assert storage.downloads == []  # the copy is current
    # the object written again (another dataset): fetched again, and read as the new one
    client = s3_server.client()
    other = str(tmp_path / "shorter")
    with IndexedDatasetBuilder(other + ".bin", dtype=np.uint16) as b:
        b.add_item(np.arange(2, 40))
        b.end_document()
        b.finalize(other + ".idx")
    for suffix in (".bin", ".idx"):
        client.upload_file(other + suffix, "indexonce", "a/mix_text_document" + suffix)
    again = IndexedDataset(url, storage=storage)
    assert storage.downloads == [url + ".idx"]
    assert len(again) == 1 and np.array_equal(again[0], np.arange(2, 40))


def test_an_object_shorter_than_its_index_is_refused_at_open(s3_server, train_data, storage):
    client = s3_server.client()
    client.create_bucket(Bucket="truncated")
    client.upload_file(train_data.prefix + ".idx", "truncated", "d.idx")
    data = Path(train_data.prefix + ".bin").read_bytes()
    client.put_object(Bucket="truncated", Key="d.bin", Body=data[:len(data) // 2])
    with pytest.raises(ValueError, match=r"ends past the end of s3://truncated/d\.bin"):
        IndexedDataset("s3://truncated/d", storage=storage)


def test_bad_credentials_a_missing_bucket_or_key_one_message_each(s3_server, train_data,
                                                                  monkeypatch, storage):
    upload(s3_server, "present", "mix_text_document", train_data.prefix)
    assert data_file_problems(["s3://present/absent"], storage=storage) == [
        "--data-path: no .bin/.idx pair (nor a shard set's .shards.json, nor CPM-2's _context, "
        "_target, _target_offset pairs) for s3://present/absent"]
    [problem] = data_file_problems(["s3://no-such-bucket/x"], storage=storage)
    assert "no such bucket 'no-such-bucket'" in problem
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x" * 40)
    storage.reset()
    [problem] = data_file_problems(["s3://present/mix_text_document"], storage=storage)
    assert "s3://present/mix_text_document.idx" in problem and "403" in problem


def test_preprocess_writes_to_s3_and_inspect_reads_it(s3_server, s3_env, train_data, tmp_path,
                                                      monkeypatch):
    from data_tools import inspect_dataset, preprocess_data

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # the tools' default settings

    s3_server.client().create_bucket(Bucket="written")
    rc = preprocess_data.main(["--input", str(train_data.root / "corpus.jsonl"),
                               "--output-prefix", "s3://written/out/mix",
                               "--tokenizer-model", train_data.spm, "--append-eod",
                               "--workers", "1", "--no-progress"])
    assert rc == 0
    root = Path(s3_server.root) / "written" / "out"
    assert sorted(p.name for p in root.iterdir()) == ["mix_text_document.bin",
                                                       "mix_text_document.idx",
                                                       "mix_text_document.meta.json"]
    for suffix in (".bin", ".idx", ".meta.json"):  # the same bytes as the local preprocess
        assert (root / f"mix_text_document{suffix}").read_bytes() == \
            Path(train_data.prefix + suffix).read_bytes()
    assert inspect_dataset.main(["s3://written/out/mix_text_document"]) == 0

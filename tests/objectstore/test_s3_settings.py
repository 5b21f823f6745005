"""Object storage settings are an object passed to what reads s3:// data, not process state: two
ObjectStorage objects with different settings, used in one process (and in its forked DataLoader
workers), each read with their own cache folder, merge gap and client; an ObjectStorage pickles as
its settings. And read-ahead planning is an interface (`sample_reads`): an error in it is raised,
not swallowed."""

import dataclasses
import os
import pickle

import numpy as np
import pytest
import torch

from megatron.data.datasets.builder import DataConfig, build_datasets
from megatron.data.datasets.t5_dataset import T5DatasetConfig, T5SpecialTokens
from megatron.data.storage.indexed_dataset import IndexedDataset
from megatron.data.storage.object_storage import ObjectStorage, StorageSettings
from megatron.data.storage.readahead import AheadBatch, ReadAheadDataset, planned_ranges

TOKENS = T5SpecialTokens(0, 1, 0, tuple(range(1999, 1899, -1)))


@pytest.fixture
def url(s3_server, s3_env, train_data):
    client = s3_server.client()
    if "settings" not in {b["Name"] for b in client.list_buckets()["Buckets"]}:
        client.create_bucket(Bucket="settings")
    for suffix in (".bin", ".idx"):
        client.upload_file(train_data.prefix + suffix, "settings", "mix_text_document" + suffix)
    return "s3://settings/mix_text_document"


def two_storages(tmp_path):
    """(a, b): the same server read with other settings (cache folder, merge gap, cache size)."""
    a = ObjectStorage(StorageSettings(cache_path=str(tmp_path / "a"), merge_gap=0,
                                      block_cache_mib=1, retries=3, backoff_s=0.01))
    b = ObjectStorage(StorageSettings(cache_path=str(tmp_path / "b"), merge_gap=1 << 20,
                                      retries=2, backoff_s=0.01))
    return a, b


def test_two_settings_objects_in_one_process_do_not_leak_into_each_other(url, tmp_path):
    a, b = two_storages(tmp_path)
    ds_a, ds_b = IndexedDataset(url, storage=a), IndexedDataset(url, storage=b)
    # each downloaded the index into its own cache folder, and only its own
    assert a.downloads == b.downloads == [url + ".idx"]
    for name in ("a", "b"):
        assert (tmp_path / name / "objects" / "settings" / "mix_text_document.idx").is_file()
    assert ds_a.remote.storage is a and ds_b.remote.storage is b
    assert a.client() is not b.client() and a.pool() is not b.pool()
    # two ranges 100 bytes apart: apart under a's merge gap (0), one request under b's (1 MiB)
    ranges, requests = [(0, 10), (110, 120)], []
    for ds in (ds_a, ds_b):
        before = ds.remote.requests
        for future in ds.remote.prefetch(ranges):
            future.result()
        requests.append(ds.remote.requests - before)
    assert requests == [2, 1]
    assert ds_a[3].tolist() == ds_b[3].tolist()
    # a third, made after them with the defaults, is not changed by them either
    assert ObjectStorage().settings == StorageSettings()
    # an ObjectStorage travels (pickled, to a spawned worker) as its settings
    again = pickle.loads(pickle.dumps(ds_a))
    assert again.storage.settings == a.settings and again.remote.storage.settings == a.settings
    assert again.storage is again.remote.storage  # one client per unpickled dataset


def test_the_settings_given_to_build_datasets_reach_every_reader(url, tmp_path):
    a, b = two_storages(tmp_path)
    config = DataConfig([url], split="100,0,0", data_cache_path=str(tmp_path / "cache"),
                        t5=T5DatasetConfig(encoder_seq_length=64, seed=1))
    train_a = build_datasets(config, TOKENS, (8, 0, 0), a)["train"]
    train_b = build_datasets(config, TOKENS, (8, 0, 0), b)["train"]
    assert train_a.indexed.remote.storage is a and train_b.indexed.remote.storage is b
    plan_a, plan_b = planned_ranges(train_a, range(8)), planned_ranges(train_b, range(8))
    assert list(plan_a) == [train_a.indexed.remote] and list(plan_b) == [train_b.indexed.remote]
    assert plan_a[train_a.indexed.remote] == plan_b[train_b.indexed.remote]  # the same bytes
    for i in range(8):
        assert train_a[i]["encoder_input_ids"].tolist() == \
            train_b[i]["encoder_input_ids"].tolist()


class SeenByWorker(torch.utils.data.Dataset):
    """Item i: (the process, the merge gap of the reader's settings there, bytes [i, i + 8))."""

    def __init__(self, indexed):
        self.indexed = indexed

    def __len__(self):
        return 4

    def __getitem__(self, i):
        remote = self.indexed.remote
        return os.getpid(), remote.storage.settings.merge_gap, bytes(remote.read(i, i + 8))


def test_forked_workers_read_with_the_settings_of_their_dataset(url, tmp_path):
    a, b = two_storages(tmp_path)
    ds_a, ds_b = IndexedDataset(url, storage=a), IndexedDataset(url, storage=b)
    want = bytes(ds_a.remote.read(0, 16))
    for ds, gap in ((ds_a, 0), (ds_b, 1 << 20)):
        loader = torch.utils.data.DataLoader(SeenByWorker(ds), batch_size=None, num_workers=2)
        seen = list(loader)
        assert {pid for pid, _, _ in seen} & {os.getpid()} == set()  # read in the workers
        assert [g for _, g, _ in seen] == [gap] * 4
        assert [data for _, _, data in seen] == [want[i:i + 8] for i in range(4)]


def test_settings_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        StorageSettings().merge_gap = 0


class _Planned:
    """A dataset whose planning fails for sample 3 (as a corrupt index would make it fail)."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return {"i": np.array([i])}

    def sample_reads(self, i):
        if i == 3:
            raise ValueError("sample 3: corrupt index")
        return []


def test_an_error_in_planning_is_raised_not_swallowed():
    dataset = ReadAheadDataset(_Planned())
    batch = AheadBatch([0, 1])
    batch.ahead = [2, 3]
    with pytest.raises(ValueError, match="sample 3: corrupt index"):
        dataset.__getitems__(batch)
    assert [s["i"].tolist() for s in ReadAheadDataset(_Planned()).__getitems__(
        AheadBatch([0, 1]))] == [[0], [1]]


def test_a_sample_out_of_range_fails_its_planning(train_data, tmp_path):
    config = DataConfig([train_data.prefix], split="100,0,0",
                        data_cache_path=str(tmp_path / "cache"),
                        t5=T5DatasetConfig(encoder_seq_length=64, seed=1))
    train = build_datasets(config, TOKENS, (8, 0, 0))["train"]
    assert train.sample_reads(0) == []  # local data: nothing to fetch ahead
    with pytest.raises(IndexError, match="sample 8 out of range for 8 samples"):
        planned_ranges(train, [7, 8])


def test_a_dataset_that_cannot_plan_is_refused_at_once():
    class Unplanned:
        def __len__(self):
            return 1

        def __getitem__(self, i):
            return i

    with pytest.raises(TypeError, match="Unplanned cannot be read ahead.*sample_reads"):
        ReadAheadDataset(Unplanned())

"""Reads through a real TCP proxy that breaks connections (fault_proxy.py): a dropped connection,
an answer delayed past the timeout, 503 SlowDown, a truncated body. Within the retries the bytes
read are the object's, exactly; past them one ObjectStorageError names the object and the byte
range, in bounded time. Never wrong bytes, never a hang."""

import time

import pytest

from megatron.data.storage import object_storage
from megatron.data.storage.indexed_dataset import IndexedDataset
from megatron.data.storage.object_storage import ObjectStorage, StorageSettings

DATA = bytes(range(256)) * 4096  # 1 MiB


@pytest.fixture(params=["sigv4", "boto3"])
def through_proxy(request, s3_server, s3_env, fault_proxy, monkeypatch, tmp_path):
    """An object of 1 MiB, and a client pointed at the proxy (1 s timeouts, 4 attempts, short
    backoff), ranged GETs sent by either reader (--object-storage-reader): (proxy, storage)."""
    client = s3_server.client()
    s3_server.make_bucket("faults")
    client.put_object(Bucket="faults", Key="blob", Body=DATA)
    monkeypatch.setenv("AWS_ENDPOINT_URL", fault_proxy.endpoint)
    return fault_proxy, ObjectStorage(StorageSettings(
        cache_path=str(tmp_path / "node"), retries=4, timeout_s=1.0, backoff_s=0.01,
        reader=request.param))


@pytest.mark.parametrize("fault", ["drop", "delay", "503", "truncate"])
def test_a_read_retried_past_a_fault_returns_the_objects_bytes(through_proxy, fault):
    proxy, storage = through_proxy
    storage.read_range("s3://faults/blob", 0, 10)  # a pooled connection exists now
    proxy.reset()  # the next request opens a new connection, which gets the fault
    {"drop": lambda: proxy.drop_next(2), "delay": lambda: proxy.delay_next(1, 3.0),
     "503": lambda: proxy.answer_503_next(2),
     "truncate": lambda: proxy.truncate_next(2, 300)}[fault]()
    start, end = 1000, 300_000
    assert storage.read_range("s3://faults/blob", start, end) == DATA[start:end]
    assert proxy.faults_served >= 1


@pytest.mark.parametrize("fault", ["drop", "503", "truncate"])
def test_a_fault_past_the_retries_names_the_object_and_range(through_proxy, fault):
    proxy, storage = through_proxy
    proxy.reset()
    {"drop": lambda: proxy.drop_next(50), "503": lambda: proxy.answer_503_next(50),
     "truncate": lambda: proxy.truncate_next(50, 300)}[fault]()
    began = time.monotonic()
    with pytest.raises(object_storage.ObjectStorageError,
                       match=r"s3://faults/blob bytes \[5, 70000\): failed after 4 attempts"):
        storage.read_range("s3://faults/blob", 5, 70_000)
    assert time.monotonic() - began < 20
    proxy.clear()


def test_a_delay_past_the_timeout_on_every_attempt_ends_in_bounded_time(through_proxy):
    proxy, storage = through_proxy
    proxy.reset()
    proxy.delay_next(50, 30.0)
    began = time.monotonic()
    with pytest.raises(object_storage.ObjectStorageError, match=r"bytes \[0, 100\)"):
        storage.read_range("s3://faults/blob", 0, 100)
    assert time.monotonic() - began < 4 * 2.5 + 2  # 4 attempts of a 1 s timeout, and backoff
    proxy.clear()


def test_samples_read_through_faults_equal_the_local_ones(s3_server, train_data,
                                                          through_proxy):
    """A dataset opened and read while every few connections fail: the same tokens."""
    proxy, storage = through_proxy
    client = s3_server.client()
    for suffix in (".bin", ".idx"):
        client.upload_file(train_data.prefix + suffix, "faults", "mix" + suffix)
    local = IndexedDataset(train_data.prefix)
    remote = IndexedDataset("s3://faults/mix", storage=storage)
    for i in range(0, len(local), 7):
        proxy.reset()
        [proxy.drop_next, proxy.answer_503_next, lambda: proxy.truncate_next(1, 200)][i % 3]()
        assert remote.get(i, 1, 20).tolist() == local.get(i, 1, 20).tolist()
    assert proxy.faults_served >= 10

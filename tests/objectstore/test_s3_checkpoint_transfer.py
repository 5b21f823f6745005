"""The moves of checkpoint files to and from the S3 server (remote.py RemoteFolder): a download
fetches each file in ranged GETs of the part size, all files at once, and gives back the bytes
uploaded; a download whose first requests fail is tried again."""

import collections
import os

import pytest


def _folder(url, part_mb=5, concurrency=4):
    from megatron.checkpoint.io.remote import RemoteFolder
    from megatron.config.training import CheckpointStorage
    from megatron.data.storage.object_storage import StorageSettings

    storage = CheckpointStorage(StorageSettings(retries=4, timeout_s=30, backoff_s=0.01),
                                part_size_mb=part_mb, upload_concurrency=concurrency)
    return RemoteFolder(url, storage)


def _files(root):
    sizes = {"iter_0000001/optim.pt": 12 * 2**20 + 3, "iter_0000001/rng/rank_0.pt": 1000,
             "iter_0000001/empty.pt": 0}
    pairs = []
    for rel, size in sizes.items():
        path = root / "up" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size))
        pairs.append((str(path), rel))
    return pairs


def test_a_download_fetches_part_sized_ranges_of_every_file(s3_server, s3_env, tmp_path):
    bucket = s3_server.make_bucket("ckpt-transfer")
    folder = _folder(f"s3://{bucket}/run")
    pairs = _files(tmp_path)
    folder.confirm(folder.upload_files(pairs))
    ranges = collections.defaultdict(list)  # name -> the Range headers of its GETs

    def count(request, **_):
        ranges[request.url.rsplit("/", 1)[-1]].append(request.headers.get("Range"))
    folder.objects.client().meta.events.register("before-send.s3.GetObject", count)
    down = tmp_path / "down"
    folder.download_files((rel, down / rel) for _, rel in pairs)
    for path, rel in pairs:
        assert (down / rel).read_bytes() == open(path, "rb").read(), rel
    assert sorted(p.relative_to(down).as_posix() for p in down.rglob("*") if p.is_file()) == \
        sorted(rel for _, rel in pairs)  # no temporary file left
    # 12 MiB in 5 MiB ranges (not one GET per 64 MiB)
    mib = 2**20
    assert sorted(str(r, "ascii") if isinstance(r, bytes) else r for r in ranges["optim.pt"]) \
        == [f"bytes=0-{5 * mib - 1}", f"bytes={10 * mib}-", f"bytes={5 * mib}-{10 * mib - 1}"]


def test_a_download_whose_requests_fail_is_tried_again(s3_server, fault_proxy, tmp_path,
                                                       monkeypatch):
    from megatron.data.storage.object_storage import ObjectStorageError

    bucket = s3_server.make_bucket("ckpt-transfer-faults")
    for name, value in s3_server.env(fault_proxy.endpoint).items():
        monkeypatch.setenv(name, value)
    folder = _folder(f"s3://{bucket}/run")
    pairs = _files(tmp_path)
    folder.confirm(folder.upload_files(pairs))
    fault_proxy.reset()
    fault_proxy.answer_503_next(2)
    down = tmp_path / "down"
    folder.download_files((rel, down / rel) for _, rel in pairs)
    for path, rel in pairs:
        assert (down / rel).read_bytes() == open(path, "rb").read(), rel
    with pytest.raises(ObjectStorageError, match=f"s3://{bucket}/run/iter_0000001/gone.pt"):
        folder.download_files([("iter_0000001/gone.pt", down / "gone.pt")])

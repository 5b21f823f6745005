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


def test_confirming_a_save_lists_its_folder_instead_of_a_head_per_object(s3_server, s3_env,
                                                                         tmp_path):
    """At 256 ranks a save has 500 objects: confirmed by one listing (1000 objects a request),
    not 500 HEADs; an object the listing shows at another size is asked for by HEAD, then
    named."""
    from megatron.data.storage.object_storage import ObjectStorageError

    bucket = s3_server.make_bucket("ckpt-confirm")
    folder = _folder(f"s3://{bucket}/run")
    sizes = folder.upload_files(_files(tmp_path))
    sent = collections.Counter()
    folder.objects.client().meta.events.register(
        "before-send.s3", lambda request, **_: sent.update([request.method]))
    folder.confirm(sizes)
    assert sent == {"GET": 1}  # ListObjectsV2 of iter_0000001/, no HEAD
    (s3_server.root / bucket / "run/iter_0000001/optim.pt").write_bytes(b"x" * 100)
    sent.clear()
    with pytest.raises(ObjectStorageError, match=r"iter_0000001/optim.pt has 100 bytes"):
        folder.confirm(sizes)
    assert sent == {"GET": 1, "HEAD": 1}

"""A short training run (2 data-parallel ranks) reading its data from the
S3 server has the losses of the same run reading local files, bit for bit."""

import shutil
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "distributed"))  # the process harness
sys.path.insert(0, str(HERE.parent / "training"))  # its training workers

from harness import run_workers  # noqa: E402
from train_workers import base_argv, run_pretrain  # noqa: E402

pytestmark = pytest.mark.slow


def test_a_run_from_s3_has_the_losses_of_the_run_from_local_files(s3_server, s3_env, train_data,
                                                                 tmp_path):
    s3_server.make_bucket("training")
    client = s3_server.client()
    for suffix in (".bin", ".idx"):
        client.upload_file(train_data.prefix + suffix, "training", "corpus/mix" + suffix)
    local_data = train_data
    remote_data = type(train_data)(**{**vars(train_data), "prefix": "s3://training/corpus/mix",
                                      "cache": str(tmp_path / "node")})
    extra = ("--object-storage-read-ahead", "2")  # (refused with local data: no effect there)
    local, remote = run_workers(2, run_pretrain, [
        base_argv(local_data, "--data-cache-path", str(tmp_path / "local-cache")),
        base_argv(remote_data, *extra)], timeout=600)[0]
    assert sorted(remote["losses"]) == [1, 2, 3, 4]
    assert remote["losses"] == local["losses"]
    assert remote["evals"] == local["evals"]
    # the index went to the node-local folder under --data-cache-path, the data did not
    copies = [p.name for p in (tmp_path / "node").rglob("*") if p.is_file()]
    assert "mix.idx" in copies and "mix.bin" not in copies
    shutil.rmtree(tmp_path / "node")

"""A training run whose object storage fails for good (past its retries) under a real torchrun,
with data-loader workers: one error line per rank that met it, no traceback, an exit, and no
process left behind (before, a worker's exception came back with ~340 lines of traceback and
the rank then hung in multiprocessing's exit handler, joining a worker that ignores SIGTERM)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from s3_server import S3Server

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "launch"))

from launching import read  # noqa: E402
from test_exits import OUR_FRAME, run_tiny  # noqa: E402

from megatron.data.storage.indexed_dataset import IndexedDataset, merge_datasets  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("workers", [0, 2])
def test_storage_lost_mid_run_ends_the_run_in_one_line(workers, train_data, tmp_path):
    # four copies of the corpus (2.4 MB): more than the 1 MiB block cache, so that later
    # batches must still read from the server
    big = str(tmp_path / "big_text_document")
    merge_datasets([train_data.prefix] * 4, big)
    assert len(IndexedDataset(big)) == 4 * len(IndexedDataset(train_data.prefix))
    server = S3Server()
    try:
        server.make_bucket("lost")
        client = server.client()
        for suffix in (".bin", ".idx"):
            client.upload_file(big + suffix, "lost", "corpus/big" + suffix)
        data = type(train_data)(prefix=train_data.prefix, spm=train_data.spm,
                                config=train_data.tiny)
        out = tmp_path / "run"
        flags = ("--data-path", "s3://lost/corpus/big", "--num-workers", str(workers), "--eval-interval", "0", "--save-interval",
                 "1000000", "--object-storage-block-cache-mib", "1",
                 "--object-storage-read-ahead", "1", "--object-storage-retries", "2",
                 "--object-storage-timeout", "2")
        status, output, describe = run_tiny(data, out, flags, stop_at_step=2,
                                            on_step=server.close, ITERS="1000000",
                                            **server.env())
    finally:
        server.close()
    assert status != 0, describe
    assert not OUR_FRAME.search(output), describe  # torchrun's own traceback names none
    errors = re.findall(r"^error \(rank \d\): the train data: reading samples \d+\.\.\d+: "
                        r".*s3://lost/corpus/big\.bin.*$", output, re.M)
    assert 1 <= len(errors) <= 2, describe  # each rank that met it, once
    assert "exiting at iteration" not in read(out / "log.txt"), describe

"""The flags of checkpoints on object storage (`--save s3://...`, `--load s3://...`): how the
files are staged, uploaded and read (megatron/checkpoint/io/remote.py). Endpoint, credentials,
retries and timeouts are the data's `--object-storage-*` flags (megatron/data/data_args.py)."""

from __future__ import annotations

import argparse
from typing import Any, List, Mapping, Tuple

from megatron.config.training import CheckpointStorage
from megatron.data.data_args import storage_settings_from_args

REMOTE_ONLY = ("checkpoint_staging_path", "object_storage_part_size_mb",
               "object_storage_upload_concurrency")
"""Flags with an effect only on an s3:// --save or --load."""


def add_checkpoint_storage_args(parser: argparse.ArgumentParser) -> None:
    d = CheckpointStorage()
    g = parser.add_argument_group("checkpoints on object storage (--save / --load s3://BUCKET/"
                                  "PREFIX; endpoint, keys and retries as for s3:// data)")
    g.add_argument("--checkpoint-staging-path", default=None, metavar="DIR",
                   help="node-local folder each rank writes its checkpoint files into before "
                        "uploading them, and downloads them into before loading (default: a "
                        "folder under the system's temporary folder); it holds one iteration "
                        "of this node's files at most")
    g.add_argument("--object-storage-part-size-mb", type=int, default=d.part_size_mb,
                   help="part size of the multipart uploads of checkpoint files (files up to "
                        "this size go in one request)")
    g.add_argument("--object-storage-upload-concurrency", type=int,
                   default=d.upload_concurrency,
                   help="requests (files and parts) each rank sends at once while uploading "
                        "or downloading a checkpoint")


def checkpoint_storage_from_args(values: Mapping[str, Any]
                                 ) -> Tuple[CheckpointStorage, List[str]]:
    """(the settings, the problems with their flags) from `vars(namespace)`."""
    d = CheckpointStorage()
    part = values.get("object_storage_part_size_mb", d.part_size_mb)
    concurrency = values.get("object_storage_upload_concurrency", d.upload_concurrency)
    problems = []
    if part < 5:  # S3's smallest part (but the last)
        problems.append(f"--object-storage-part-size-mb {part}: S3 takes parts of 5 MB or more")
    if concurrency < 1:
        problems.append(f"--object-storage-upload-concurrency {concurrency} must be >= 1")
    return CheckpointStorage(storage_settings_from_args(values),
                             values.get("checkpoint_staging_path"), part, concurrency), problems

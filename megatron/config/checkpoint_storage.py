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


def add_checkpoint_storage_args(parser: argparse.ArgumentParser, uploads: bool = True,
                                flags: str = "--save / --load"):
    """The flags (without --object-storage-part-size-mb unless `uploads`), in a group whose
    title names the `flags` that take s3://; returns the group."""
    d = CheckpointStorage()
    g = parser.add_argument_group(f"checkpoints on object storage ({flags} s3://BUCKET/"
                                  f"PREFIX; endpoint, keys and retries as for s3:// data)")
    g.add_argument("--checkpoint-staging-path", default=None, metavar="DIR",
                   help="node-local folder each rank writes its checkpoint files into before "
                        "uploading them, and downloads them into before loading (default: a "
                        "folder under the system's temporary folder); it holds one iteration "
                        "of this node's files at most")
    if uploads:
        g.add_argument("--object-storage-part-size-mb", type=int, default=d.part_size_mb,
                       help="part size of the multipart uploads of checkpoint files (files up "
                            "to this size go in one request)")
    g.add_argument("--object-storage-upload-concurrency", type=int,
                   default=d.upload_concurrency,
                   help="requests (files and parts) each rank sends at once while uploading "
                        "or downloading a checkpoint")
    return g


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


TOOL_FLAGS = ("checkpoint_staging_path", "object_storage_part_size_mb",
              "object_storage_upload_concurrency", "object_storage_max_connections",
              "object_storage_retries", "object_storage_timeout", "object_storage_reader")
"""The object-storage flags of the checkpoint tools (convert_checkpoint.py, megatron.generate):
the trainer's, less those of the data's reader alone (read-ahead, block cache, index copies)."""


def add_tool_storage_args(parser: argparse.ArgumentParser, flags: str,
                          uploads: bool = True) -> None:
    """The trainer's flags of checkpoints on object storage that a tool reading (and, with
    `uploads`, writing) s3:// checkpoints whole uses; `flags`: the tool's that take s3://."""
    from megatron.data.data_args import add_object_storage_args

    group = add_checkpoint_storage_args(parser, uploads, flags)
    add_object_storage_args(parser, group, only=[
        "--" + d.replace("_", "-") for d in TOOL_FLAGS])


def tool_storage_from_args(values: Mapping[str, Any], remote: bool, what: str
                           ) -> Tuple[CheckpointStorage, List[str]]:
    """(the settings, the problems with their flags) of a tool's object-storage flags
    (`vars(namespace)`); `remote`: whether the command line names an s3:// checkpoint (without
    one, each of these flags given is refused as changing nothing; `what` names the flags that
    take s3://, for that message)."""
    from megatron.data.data_args import object_storage_problems

    storage, problems = checkpoint_storage_from_args(values)
    problems += object_storage_problems(storage.settings)
    if not remote:
        defaults = CheckpointStorage()
        d = {"checkpoint_staging_path": None, "object_storage_part_size_mb":
             defaults.part_size_mb, "object_storage_upload_concurrency":
             defaults.upload_concurrency, "object_storage_max_connections":
             defaults.settings.max_connections, "object_storage_retries":
             defaults.settings.retries, "object_storage_timeout": defaults.settings.timeout_s,
             "object_storage_reader": defaults.settings.reader}
        problems += [f"--{dest.replace('_', '-')} has effect only with an s3:// {what}"
                     for dest in TOOL_FLAGS if dest in values and values[dest] != d[dest]]
    return storage, problems

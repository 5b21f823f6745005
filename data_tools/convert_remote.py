"""convert_checkpoint.py's checkpoints on object storage: `--load s3://BUCKET/PREFIX` and
`--inspect s3://...` (the checkpoint downloaded whole into the staging folder first), `--to
megatron s3://...` (built in the staging folder, then uploaded as the trainer commits a save:
the files confirmed, meta.json, the tracker last). Every problem found before anything is read
or written (refused credentials, no checkpoint, a missing or truncated object, an existing
checkpoint at --to's prefix without --force) is one line naming the flag and the key (exit 2).
The storage side is megatron/checkpoint/io/remote_tools.py.
"""

from __future__ import annotations

import argparse
import contextlib
import io
from pathlib import Path
from typing import List

from megatron.data.storage.object_storage import ObjectStorageError, is_remote

FLAGS = "--load / --inspect / --to megatron"
"""The flags that take s3:// (the storage flags' group title)."""


def add_args(parser: argparse.ArgumentParser) -> None:
    from megatron.config.checkpoint_storage import add_tool_storage_args

    add_tool_storage_args(parser, FLAGS)


def output_is_remote(args) -> bool:
    return args.to is not None and args.to[0] == "megatron" and is_remote(args.to[1])


def problems(args, others: List[str]) -> List[str]:
    """The storage flags' problems, and with an s3:// source or --to megatron output and no
    problem found so far (`others`: the command line's): what the server says of them (the
    checkpoint found and its objects confirmed; --to's prefix writable and, without --force,
    empty). Sets args.storage, and args.remote (the source's RemoteCheckpoint) for
    `localized`."""
    from megatron.checkpoint.io.remote import RemoteFolder
    from megatron.checkpoint.io.remote_tools import find_checkpoint, prefix_is_empty
    from megatron.config.checkpoint_storage import tool_storage_from_args

    flag, url = ("--inspect", args.inspect) if args.inspect is not None else ("--load", args.load)
    remote_in = url is not None and is_remote(url)
    args.storage, found = tool_storage_from_args(vars(args), remote_in or output_is_remote(args),
                                                 FLAGS)
    args.remote = None
    if found or others:
        return found
    if remote_in:
        try:
            args.remote = find_checkpoint(url, args.storage, args.iteration)
        except ObjectStorageError as e:
            found.append(f"{flag} {url}: {e}")
    if output_is_remote(args):
        out = args.to[1]
        try:
            RemoteFolder(out, args.storage).probe()
            if not args.force and not prefix_is_empty(out, args.storage):
                found.append(f"--to megatron {out}: objects exist under that prefix; pass "
                             f"--force to replace the checkpoint there")
        except (ObjectStorageError, ValueError) as e:
            found.append(f"--to megatron {out}: {e}")
    return found


def localized(args, staged) -> argparse.Namespace:
    """`args` with an s3:// --load or --inspect replaced by its download into `staged`
    (a remote_tools.Staged); `load_url` keeps the URL (None for a local source)."""
    local = argparse.Namespace(**vars(args))
    local.load_url = None
    if args.remote is not None:
        root = staged.download(args.remote)
        local.load_url = args.inspect if args.inspect is not None else args.load
        if args.inspect is not None:
            local.inspect = str(root)
        else:
            local.load = str(root)
    return local


def shown_source(args, source: dict) -> dict:
    """The source description written into the output's meta.json: an s3:// source by its
    URL (not the staging folder it was read from)."""
    if getattr(args, "load_url", None) is None or source.get("format") != "megatron":
        return source
    return {**source, "path": f"{args.load_url}/{Path(source['path']).name}"}


def shown_text(args, text: str) -> str:
    """--inspect's text with the staging folder replaced by the URL."""
    url = getattr(args, "load_url", None)
    return text if url is None else text.replace(str(Path(args.inspect)), url)


def to_remote_megatron(args, staged, write) -> int:
    """--to megatron s3://...: `write(local_out)` (convert_checkpoint.to_megatron, its report
    held back) into a staging folder, then the upload (remote_tools.upload_checkpoint); the
    report is printed once the tracker names the upload."""
    from megatron.checkpoint.io.remote_tools import upload_checkpoint

    url = args.to[1]
    local = staged.folder(args.storage, url, "convert")
    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        code = write(local)
    count = upload_checkpoint(local, url, args.storage, replace=args.force)
    print(report.getvalue().replace(str(local), url), end="")
    print(f"uploaded {count} objects to {url} (the tracker last)")
    return code


def staging():
    """A remote_tools.Staged for the run (its folders removed at its end)."""
    from megatron.checkpoint.io.remote_tools import Staged

    return Staged()

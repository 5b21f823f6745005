"""Checkpoint folders on S3-compatible object storage (`--save s3://BUCKET/PREFIX`, `--load
s3://...`): the storage side. The layout under PREFIX is the local one (the tracker and
`latest`, `iter_NNNNNNN/` with DeepSpeed's files, meta.json, rng/); the layout logic
(saver.py, checkpointing.py) never knows where bytes go: it writes and reads a node-local
staging folder, and this module moves that folder's files.

A save (remote_saver.py): every rank writes its files into the staging folder as locally, then
uploads its OWN files (s3transfer's manager: files and multipart parts in parallel, part size
and concurrency settable); after every rank has uploaded, rank 0 confirms each object of the
manifest (one listing of the folder, a HEAD where it does not show the size written), uploads
meta.json and only then the tracker objects. A job killed before that leaves the tracker on the previous iteration: what
`--load` reads does not change. Incomplete multipart uploads under PREFIX are aborted at the
next commit; `--keep-last` deletes old iterations' objects in batches (never the tracker's).

A load (`stage_for_load`): rank 0 reads the tracker and the iteration's meta.json and checks
every object a run reads (present, of its saved size; the message names the key); each rank
then downloads only the files it reads (`reads`) into its own staging folder, with a meta.json
whose manifest lists those files, and the local load goes on from there.

Credentials, endpoint and retries are the data's (megatron/data/storage/object_storage.py and
the `--object-storage-*` flags; docs/checkpoints.md "Object storage").
"""

from __future__ import annotations

import json
import os
import re
import socket
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

from megatron.checkpoint.formats.meta import META
from megatron.checkpoint.io import completeness
from megatron.checkpoint.layout import (
    DEEPSPEED_LATEST,
    ITERATION_PREFIX,
    TRACKER,
    iteration_folder_name,
    iteration_of_folder,
)
from megatron.config.training import CheckpointStorage
from megatron.data.storage.object_storage import (
    ObjectStorage,
    ObjectStorageError,
    is_remote,
    split_url,
)

PROBE = ".write-probe"
"""The object put and deleted under PREFIX before training, to see that the bucket is writable."""

_MP_RANK = re.compile(r"mp_rank_(\d+)")
_TP_MODEL = re.compile(r"-model_(\d+)-")
_RNG = re.compile(r"^rng/rank_(\d+)\.pt$")


def default_staging_path() -> str:
    """Where --checkpoint-staging-path points by default: a node-local temporary folder."""
    return os.path.join(tempfile.gettempdir(), f"t5-pretrain-staging-{os.getuid()}")


def staging_root(storage: CheckpointStorage, url: str, what: str) -> Path:
    """The node-local folder that stands for `url` while saving (`what` "save") or loading
    ("load-rank_00003")."""
    bucket, _, key = url[len("s3://"):].partition("/")
    root = Path(storage.staging_path or default_staging_path())
    return root / what / bucket / key.strip("/")


def load_staging_root(storage: CheckpointStorage, url: str) -> Path:
    """The folder stage_for_load downloads the files of `url` that this host's ranks read into
    (one per host), laid out as a local checkpoint folder; it stays until the next load."""
    return staging_root(storage, url, f"load-{socket.gethostname()}")


def reads(name: str, rank: int, mp_rank: int, tp_rank: int) -> bool:
    """Whether a rank (global `rank`, DeepSpeed's model-parallel rank `mp_rank`, tensor-parallel
    rank `tp_rank`) reads the file `name` of an iteration folder (a path inside it): another
    rank's RNG file, model or optimizer files of another model-parallel rank (DeepSpeed names
    them `mp_rank_NN`; a rank reads every data-parallel rank's optimizer files of its own) and
    the pipeline's layer files of another tensor-parallel rank (`-model_NN-`) are not read;
    every other file is."""
    found = _RNG.match(name)
    if found:
        return int(found.group(1)) == rank
    found = _MP_RANK.search(name)
    if found:
        return int(found.group(1)) == mp_rank
    found = _TP_MODEL.search(name)
    if found:
        return int(found.group(1)) == tp_rank
    return True


class RemoteFolder:
    """The checkpoint folder `url` (s3://bucket/prefix) on object storage."""

    def __init__(self, url: str, storage: CheckpointStorage,
                 objects: Optional[ObjectStorage] = None) -> None:
        self.url = url.rstrip("/")
        self.bucket, prefix = split_url(self.url + "/")
        self.prefix = prefix.strip("/")
        self.storage = storage
        self.objects = objects or ObjectStorage(storage.settings)

    def key(self, relative: str) -> str:
        return f"{self.prefix}/{relative}" if self.prefix else relative

    def url_of(self, relative: str) -> str:
        return f"{self.url}/{relative}"

    def _call(self, what: str, call):
        return self.objects._with_retries(what, call)  # the data's retries and messages

    # before any step -----------------------------------------------------------------------
    def probe(self) -> None:
        """Put and delete a small object under the prefix: the bucket exists, the credentials
        are taken and allowed to write and delete.

        Raises:
            ObjectStorageError: naming the probe object and what the server said."""
        client = self.objects.client()
        key = self.key(f"{PROBE}-{socket.gethostname()}-{os.getpid()}")
        self._call(f"writing {self.url_of(key[len(self.prefix) + 1:])}",
                   lambda: client.put_object(Bucket=self.bucket, Key=key, Body=b"probe"))
        self._call(f"deleting s3://{self.bucket}/{key}",
                   lambda: client.delete_object(Bucket=self.bucket, Key=key))

    # small objects ---------------------------------------------------------------------------
    def get_text(self, relative: str) -> Optional[str]:
        """The object's text; None when there is no such key.

        Raises:
            ObjectStorageError: no such bucket, refused credentials, failures past retries."""
        url = self.url_of(relative)
        if not self.objects.exists(url):
            return None
        size, _ = self.objects.head(url)
        return self.objects.read_range(url, 0, size).decode("utf-8", errors="replace")

    def put_text(self, relative: str, text: str) -> None:
        client = self.objects.client()
        self._call(f"writing {self.url_of(relative)}",
                   lambda: client.put_object(Bucket=self.bucket, Key=self.key(relative),
                                             Body=text.encode("utf-8")))

    def read_tracker(self) -> Optional[int]:
        """The iteration the tracker object names; None without one.

        Raises:
            ObjectStorageError: the tracker cannot be read; ValueError: it names no iteration."""
        text = self.get_text(TRACKER)
        if text is None:
            return None
        if not text.strip().isdigit():
            raise ValueError(f"{self.url_of(TRACKER)} holds {text.strip()[:40]!r}, not an "
                             f"iteration")
        return int(text.strip())

    def write_tracker(self, iteration: int) -> None:
        """The tracker, then DeepSpeed's `latest` (as layout.write_tracker writes them)."""
        self.put_text(TRACKER, f"{iteration}\n")
        self.put_text(DEEPSPEED_LATEST, iteration_folder_name(iteration))

    # listing ---------------------------------------------------------------------------------
    def iterations(self) -> List[int]:
        """The iterations with objects under the prefix, oldest first."""
        client, found = self.objects.client(), set()
        paginator = client.get_paginator("list_objects_v2")
        pages = self._call(f"listing {self.url}/", lambda: list(paginator.paginate(
            Bucket=self.bucket, Prefix=self.key(ITERATION_PREFIX), Delimiter="/")))
        for page in pages:
            for common in page.get("CommonPrefixes", []):
                n = iteration_of_folder(common["Prefix"].rstrip("/").rsplit("/", 1)[-1])
                if n is not None:
                    found.add(n)
        return sorted(found)

    def _keys(self, relative_folder: str) -> List[str]:
        return sorted(self.sizes(relative_folder))

    # large objects ---------------------------------------------------------------------------
    def _manager(self):
        from boto3.s3.transfer import TransferConfig, create_transfer_manager

        part = self.storage.part_size_mb * 1024 * 1024
        config = TransferConfig(multipart_threshold=part, multipart_chunksize=part,
                                max_concurrency=self.storage.upload_concurrency,
                                use_threads=True)
        return create_transfer_manager(self.objects.client(), config)

    def upload_files(self, files: Iterable[Tuple[str, str]]) -> Dict[str, int]:
        """Upload (local path, relative key) pairs, all through one transfer manager (files and
        their parts in parallel, at most `upload_concurrency` requests); a file that failed is
        tried again, alone, with the data's retries. Returns {relative: bytes}.

        Raises:
            ObjectStorageError: a file that could not be uploaded (naming it and its key)."""
        files = list(files)
        self._transfer(files, lambda manager, f: manager.upload(f[0], self.bucket,
                                                                self.key(f[1])),
                       lambda f: f"uploading {f[0]} to {self.url_of(f[1])}")
        return {rel: os.path.getsize(path) for path, rel in files}

    def _transfer(self, items: List, start, what) -> None:
        """Start the transfer of every item through one manager (`start(manager, item)`: its
        future); an item whose transfer failed is tried again, alone, with the data's retries
        (`what(item)` names it in the message)."""
        with self._manager() as manager:
            futures = [(item, start(manager, item)) for item in items]
            failed = []
            for item, future in futures:
                try:
                    future.result()
                except Exception as e:  # noqa: BLE001 - retried below, classified there
                    failed.append((item, e))
        for item, error in failed:
            def again(item=item):
                with self._manager() as manager:
                    start(manager, item).result()
            self.objects._with_retries(what(item), again, error)

    def confirm(self, sizes: Dict[str, int]) -> None:
        """Every object of `sizes` ({relative: bytes}) is there, of that size: one listing of
        each folder they are in (1000 objects a request), then a HEAD of each object the listing
        does not show at its size (a server whose listing lags its writes; one without listing).

        Raises:
            ObjectStorageError: the first missing or short object, naming its key."""
        listed: Dict[str, int] = {}
        for folder in sorted({rel.split("/", 1)[0] for rel in sizes if "/" in rel}):
            try:
                listed.update(self.sizes(folder))
            except ObjectStorageError:
                pass  # each object is checked by a HEAD below
        unsure = sorted((rel, size) for rel, size in sizes.items()
                        if listed.get(self.key(rel)) != size)

        def check(item: Tuple[str, int]) -> Optional[str]:
            rel, size = item
            url = self.url_of(rel)
            try:
                found, _ = self.objects.head(url)
            except ObjectStorageError as e:
                if "no such" in str(e) or "404" in str(e):
                    return f"{url} is missing"
                raise
            return None if found == size else f"{url} has {found} bytes, the save wrote {size}"

        with ThreadPoolExecutor(max(1, self.storage.upload_concurrency)) as pool:
            for problem in pool.map(check, unsure):
                if problem is not None:
                    raise ObjectStorageError(problem)

    def sizes(self, relative_folder: str) -> Dict[str, int]:
        """{key: bytes} of every object under the folder (ListObjectsV2, paginated)."""
        client, found = self.objects.client(), {}
        paginator = client.get_paginator("list_objects_v2")
        pages = self._call(f"listing {self.url_of(relative_folder)}/", lambda: list(
            paginator.paginate(Bucket=self.bucket, Prefix=self.key(relative_folder) + "/")))
        for page in pages:
            found.update((o["Key"], int(o["Size"])) for o in page.get("Contents", []))
        return found

    def download_files(self, files: Iterable[Tuple[str, Path]]) -> None:
        """Download (relative key, local path) pairs through one transfer manager, as
        upload_files uploads (ranged GETs of `part_size_mb` of every file at once, at most
        `upload_concurrency`; each file to a temporary name, then renamed; not fsynced: a
        staging copy, read at once). A file that failed is tried again, alone, with the data's
        retries (bench/RESULTS.md "S3 checkpoints": file by file, 64 MiB ranges and an fsync
        each took twice boto3's download_file).

        Raises:
            ObjectStorageError: a file that could not be downloaded (naming its key)."""
        files = list(files)
        for _, path in files:
            path.parent.mkdir(parents=True, exist_ok=True)
        self._transfer(files, lambda manager, f: manager.download(self.bucket, self.key(f[0]),
                                                                  str(f[1])),
                       lambda f: f"downloading {self.url_of(f[0])}")

    # housekeeping ----------------------------------------------------------------------------
    def abort_incomplete_uploads(self) -> List[str]:
        """Abort the multipart uploads under the prefix that were never completed (a job killed
        mid-upload leaves them, and their parts are billed); returns their keys. A server
        without the listing call is left as it is."""
        client, aborted = self.objects.client(), []
        try:
            answer = client.list_multipart_uploads(Bucket=self.bucket,
                                                   Prefix=self.key(ITERATION_PREFIX))
        except Exception:  # noqa: BLE001 - optional on S3-compatible servers
            return aborted
        for upload in answer.get("Uploads", []):
            self._call(f"aborting the upload of s3://{self.bucket}/{upload['Key']}",
                       lambda u=upload: client.abort_multipart_upload(
                           Bucket=self.bucket, Key=u["Key"], UploadId=u["UploadId"]))
            aborted.append(upload["Key"])
        return aborted

    def delete_iteration(self, iteration: int) -> int:
        """Delete every object of `iteration`'s folder (batches of 1000); how many."""
        tag = iteration_folder_name(iteration)
        return self.delete_keys(self._keys(tag), f"{self.url_of(tag)}/")

    def delete_keys(self, keys: List[str], what: str) -> int:
        """Delete the objects `keys` (full keys) in batches of 1000 (DeleteObjects); how many.
        `what` names them in a failure's message."""
        client = self.objects.client()
        for start in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[start:start + 1000]]
            self._call(f"deleting {what}", lambda b=batch: client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": b, "Quiet": True}))
        return len(keys)

    def prune(self, keep_last: int, current: int) -> List[int]:
        """Delete all but the newest `keep_last` iterations (the tracker's, `current`, always
        kept); returns the deleted. Called after the tracker names the newest."""
        done = [n for n in self.iterations() if n <= current]
        doomed = [n for n in done[:max(len(done) - keep_last, 0)] if n != current]
        for n in doomed:
            self.delete_iteration(n)
        return doomed


def stage_for_load(url: str, storage: CheckpointStorage, ckpt_step: Optional[int],
                   ranks: Tuple[int, int, int], needed, broadcast, gather=None,
                   other_layout=None) -> Path:
    """Download what the ranks of this host read of the checkpoint `url` into the host's
    staging folder, laid out as a local checkpoint folder; returns that folder (holding no
    tracker when `url` holds no checkpoint). Collective: rank 0 reads the tracker and meta.json
    and checks every object the run needs; `broadcast(obj)` hands rank 0's answer to every rank.

    The ranks of one host (by host name) share one folder: each object one of them reads is
    downloaded once, by one of them (DeepSpeed's ZeRO load reads every data-parallel rank's
    optimizer files of a model-parallel rank, so a node's ranks would fetch the same files).
    `gather(obj)` returns every rank's `obj` (an all-gather); without it this rank is alone.

    ranks: (global rank, DeepSpeed's model-parallel rank, tensor-parallel rank) (`reads`).
    needed(name, meta): whether the run reads that file of the checkpoint of meta.json `meta`
        at all (its --no-load-optim / --no-load-rng: completeness.needed).
    other_layout(meta): whether the checkpoint is loaded into another layout (io/reshard.py):
        then every model-parallel rank's files are read, and no RNG file.
    Raises:
        ObjectStorageError: the storage could not be read, or an object is missing or short
            (naming its key; on every rank of the host).
    """
    gather = gather or (lambda obj: [obj])
    rank = ranks[0]
    folder = RemoteFolder(url, storage)
    answer: List[object] = [None, None, None]  # iteration, meta, problem
    if rank == 0:
        try:
            answer[:2] = _checked_meta(folder, ckpt_step, needed)
        except (ObjectStorageError, ValueError) as e:
            answer[2] = str(e)
    iteration, meta, problem = broadcast(answer)
    if problem is not None:
        raise ObjectStorageError(problem)
    host = socket.gethostname()
    root = load_staging_root(storage, url)
    if iteration is None:
        gather(None)
        root.mkdir(parents=True, exist_ok=True)
        return root
    tag = iteration_folder_name(iteration)
    whole = other_layout is not None and other_layout(meta)
    mine = sorted(rel for rel in (meta.get("file_sizes") or {}) if needed(rel, meta) and (
        not _RNG.match(rel) if whole else reads(rel, *ranks)))
    hosts = gather((host, rank, mine))
    here = sorted((r, files) for h, r, files in hosts if h == host)
    sizes = meta.get("file_sizes") or {}
    wanted = sorted({rel for _, files in here for rel in files})
    if here[0][0] == rank:  # the host's first rank empties the folder
        if root.exists():
            import shutil

            shutil.rmtree(root)
        root.mkdir(parents=True)
    gather(None)
    position = [r for r, _ in here].index(rank)
    error = None
    try:  # this rank's share of the host's files
        folder.download_files((f"{tag}/{rel}", root / tag / rel)
                              for rel in wanted[position::len(here)])
    except ObjectStorageError as e:
        error = str(e)
    errors = [(h, e) for h, e in gather((host, error)) if h == host and e is not None]
    if errors:
        failed = ObjectStorageError(errors[0][1])
        failed.rank_local = True  # this host's download; the others may have theirs
        raise failed
    if here[0][0] == rank:
        # the staged meta.json lists the staged files: the local checks see a whole folder
        (root / tag / META).write_text(json.dumps({**meta, "file_sizes": {
            rel: sizes[rel] for rel in wanted}}), encoding="utf-8")
        (root / TRACKER).write_text(f"{iteration}\n", encoding="utf-8")
    gather(None)
    return root


def fetch_for_load(config, other_layout=None) -> Path:
    """stage_for_load for the run's --load (a CheckpointConfig), in its process groups;
    `other_layout(meta)` as there.

    Raises:
        ObjectStorageError: as stage_for_load (`rank_local` set on a download's)."""
    import torch.distributed as dist

    from megatron import parallel_state

    load_rng = not (config.finetune or config.no_load_rng)

    def needed(name: str, meta: Dict) -> bool:
        zero3 = (meta.get("layout") or {}).get("zero_stage") == 3  # its weights: optim files
        return completeness.needed(name, not config.weights_only or zero3, load_rng)

    def broadcast(obj):
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(obj):
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    ranks = (dist.get_rank(), parallel_state.get_model_parallel_rank(),
             parallel_state.get_tensor_model_parallel_rank())
    return stage_for_load(config.load, config.storage, config.ckpt_step, ranks, needed,
                          broadcast, gather, other_layout)


def remote_meta(url: str, storage: CheckpointStorage, ckpt_step: Optional[int]
                ) -> Optional[Dict]:
    """meta.json of the iteration an s3:// --load reads (`ckpt_step`, else the tracker's); None
    when the folder holds no checkpoint yet. Before start: arguments.py checks the layout and
    the schedule against it.

    Raises:
        ObjectStorageError, ValueError: naming the key."""
    return _checked_meta(RemoteFolder(url, storage), ckpt_step, lambda name, meta: False)[1]


def _checked_meta(folder: RemoteFolder, ckpt_step: Optional[int], needed):
    """(iteration, meta) of the checkpoint a run loads from `folder` ((None, None): none), with
    every object it reads confirmed.

    Raises:
        ObjectStorageError, ValueError: naming the key."""
    iteration = ckpt_step if ckpt_step is not None else folder.read_tracker()
    if iteration is None:
        return None, None
    tag = iteration_folder_name(iteration)
    text = folder.get_text(f"{tag}/{META}")
    if text is None:
        have = folder.iterations()
        said = "--ckpt-step" if ckpt_step is not None else f"{TRACKER} names it"
        raise ObjectStorageError(f"{folder.url_of(tag + '/' + META)} is missing ({said}); "
                                 f"the iterations saved there: "
                                 f"{', '.join(map(str, have)) or 'none'}")
    meta = json.loads(text)
    sizes = meta.get("file_sizes")
    if not isinstance(sizes, dict):
        raise ValueError(f"{folder.url_of(tag + '/' + META)}: no file_sizes: not a checkpoint "
                         f"saved to object storage by this trainer")
    folder.confirm({f"{tag}/{rel}": int(size) for rel, size in sizes.items()
                    if needed(rel, meta)})
    return iteration, meta


__all__ = ["RemoteFolder", "default_staging_path", "is_remote", "reads", "remote_meta",
           "stage_for_load", "staging_root"]


def remote_problems(values: Dict, storage: CheckpointStorage, given=()) -> List[str]:
    """Before anything starts: an s3:// --save whose bucket this job cannot write (a probe object
    put and deleted), an s3:// --load whose tracker cannot be read (refused credentials, no such
    bucket: the message says which), and the flags of checkpoints on object storage given
    without an s3:// --save, --load or --prompt-load. `values`: `vars(namespace)`; `given`: the
    destinations the command line set."""
    save, load = values.get("save"), values.get("load")
    if not (is_remote(save) or is_remote(load) or is_remote(values.get("prompt_load"))):
        from megatron.config.checkpoint_storage import REMOTE_ONLY

        return [f"--{d.replace('_', '-')} has effect only with an s3:// --save, --load or "
                f"--prompt-load" for d in REMOTE_ONLY if d in given]
    problems = []
    objects = ObjectStorage(storage.settings)
    for flag, url in (("--save", save), ("--load", load)):
        if not is_remote(url):
            continue
        try:
            folder = RemoteFolder(url, storage, objects)
            if flag == "--save":
                folder.probe()
            else:
                folder.read_tracker()
        except (ObjectStorageError, ValueError) as e:
            problems.append(f"{flag} {url}: {e}")
    return problems

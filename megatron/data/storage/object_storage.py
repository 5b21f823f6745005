"""Training data on S3-compatible object storage (AWS S3, Ceph RGW, MinIO).

A dataset prefix `s3://bucket/path/name` names the objects `path/name.idx`, `path/name.bin`
and the sidecar `path/name.meta.json`.

- `StorageSettings`: how data is read (the `--object-storage-*` flags), frozen.
- `ObjectStorage(settings)`: HEAD, ranged GETs retried with backoff, upload, delete, and
  node-local copies of index files (`local_copy`, under `settings.cache_path`). Whoever opens
  s3:// data is handed one and passes it on; nothing here is process-wide. Its boto3 client,
  signed-GET reader and thread pool are made at first use and again in a forked process (a
  DataLoader worker); it pickles as its settings.
- `RemoteBin`: byte ranges of one data object, through a bounded cache of fetched ranges, with
  `prefetch` for the read-ahead (readahead.py).
- `ObjectStorageError`: a request that failed past its retries or cannot succeed; the message
  names the object and, for reads, the byte range.

Reads the environment as boto3 does (`AWS_ENDPOINT_URL` or `AWS_ENDPOINT_URL_S3`,
`AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY`, `AWS_PROFILE`, `AWS_REGION`, the `~/.aws`
files), `AWS_S3_ADDRESSING_STYLE` (default path) and `XDG_CACHE_HOME` (the default cache
folder). Needs boto3 (`pip install -e ".[s3]"`); does not import torch.

See docs/object-storage.md.
"""

from __future__ import annotations

import bisect
import collections
import fcntl
import json
import os
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

SCHEME = "s3://"


def is_remote(path) -> bool:
    """Whether `path` (a dataset prefix or a file) is on object storage."""
    return str(path).startswith(SCHEME)


def split_url(url: str) -> Tuple[str, str]:
    """(bucket, key) of `s3://bucket/key`.

    Raises:
        ValueError: not an s3:// URL with a bucket and a key."""
    if not is_remote(url):
        raise ValueError(f"{url}: not an {SCHEME} URL")
    bucket, _, key = url[len(SCHEME):].partition("/")
    if not bucket or not key:
        raise ValueError(f"{url}: an {SCHEME} path needs a bucket and a key (s3://bucket/key)")
    return bucket, key


class ObjectStorageError(OSError):
    """A request that failed past its retries, or could not succeed (no such object, refused
    credentials): the message names the object and, for reads, the byte range."""


@dataclass(frozen=True)
class StorageSettings:
    """How data on object storage is read (the `--object-storage-*` flags)."""

    cache_path: Optional[str] = None
    """Node-local folder for index copies; None: `default_cache_path()`."""
    read_ahead: int = 4
    """Batches of this process whose ranges are fetched ahead of use (0: none)."""
    block_cache_mib: int = 256
    """Bytes of fetched ranges kept in memory per process and data file, at most."""
    max_connections: int = 64
    """Concurrent requests per process."""
    merge_gap: int = 64 * 1024
    """Ranges at most this many bytes apart are fetched as one request."""
    retries: int = 8
    """Attempts of a request before ObjectStorageError."""
    timeout_s: float = 30.0
    """Connect and read timeout of one request."""
    backoff_s: float = 0.1
    """First retry delay; doubling, at most 5 s, with jitter."""
    reader: str = "sigv4"
    """What sends the data files' ranged GETs: "sigv4" (s3_get.py: signed requests over kept-
    alive http.client connections, a fraction of boto3's CPU per request) or "boto3"."""


def worst_read_seconds(s: StorageSettings) -> float:
    """The longest a read can take before its ObjectStorageError: each attempt waits for the
    connection and then for data (a timeout each), and the backoff (at most 5 s) between."""
    backoff = sum(min(5.0, s.backoff_s * 2 ** a) for a in range(max(0, s.retries - 1)))
    return max(1, s.retries) * 2 * s.timeout_s + backoff


def default_cache_path() -> str:
    """Where index copies and the index caches of s3:// data go without --data-cache-path:
    node-local, under the user's cache folder."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "t5-pretrain", "object-storage")


def local_cache_dir(url: str, data_cache_path: Optional[str]) -> str:
    """A node-local folder for the index caches of dataset `url` (s3://bucket/key)."""
    bucket, key = split_url(url)
    root = data_cache_path or default_cache_path()
    return os.path.join(root, "s3", bucket, key + "_cache")


_RETRY_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
                "TooManyRequests", "InternalError", "ServiceUnavailable", "RequestTimeout",
                "RequestTimeTooSkewed", "503", "500", "502", "504"}


def _make_client(s: StorageSettings):
    """A boto3 S3 client with the settings' timeouts and connections, no retries of its own
    (ObjectStorage._with_retries retries), path-style addressing unless AWS_S3_ADDRESSING_STYLE
    says otherwise (Ceph RGW and MinIO want it)."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise ObjectStorageError(
            "s3:// data needs boto3: pip install -e \".[s3]\" (or pip install boto3)") from None
    style = os.environ.get("AWS_S3_ADDRESSING_STYLE", "path")
    config = Config(retries={"total_max_attempts": 1},  # ours retry (_with_retries)
                    connect_timeout=s.timeout_s, read_timeout=s.timeout_s,
                    max_pool_connections=max(10, s.max_connections),
                    s3={"addressing_style": style},
                    # a ranged GET carries no whole-object checksum on AWS; some servers
                    # (rclone, older Ceph) echo the PUT's, which would fail every ranged
                    # read: checksums only where the API requires them
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required")
    return boto3.session.Session().client("s3", config=config)


class ObjectStorage:
    """Object storage read and written with `settings`. The boto3 client,
    the SigV4 getter and the thread pool are made at first use in each process (a forked
    DataLoader worker makes its own); `downloads` lists the index copies this object fetched
    (for tests and the log). Pickles as its settings."""

    def __init__(self, settings: StorageSettings = StorageSettings()) -> None:
        self.settings = settings
        self.downloads: List[str] = []
        self._lock = threading.Lock()
        self._made: Dict[str, Tuple[int, object]] = {}  # "client"|"getter"|"pool" -> (pid, it)

    def __getstate__(self):
        return {"settings": self.settings}

    def __setstate__(self, state):
        self.__init__(state["settings"])

    def __repr__(self) -> str:
        return f"ObjectStorage({self.settings!r})"

    def _get(self, name: str, make):
        pid = os.getpid()
        found = self._made.get(name)
        if found is not None and found[0] == pid:
            return found[1]
        with self._lock:
            found = self._made.get(name)
            if found is None or found[0] != pid:  # none yet, or the parent's before a fork
                found = self._made[name] = (pid, make())
        return found[1]

    def client(self):
        """This process's boto3 S3 client."""
        return self._get("client", lambda: _make_client(self.settings))

    def getter(self):
        """This process's s3_get.RangedGetter (on the boto3 client's endpoint and credentials)."""
        boto = self.client()

        def make():
            from .s3_get import RangedGetter

            return RangedGetter(boto, self.settings.timeout_s,
                                os.environ.get("AWS_S3_ADDRESSING_STYLE", "path"))

        return self._get("getter", make)

    def pool(self) -> ThreadPoolExecutor:
        """This process's thread pool for concurrent requests (`max_connections` threads)."""
        return self._get("pool", lambda: ThreadPoolExecutor(
            max_workers=max(1, self.settings.max_connections), thread_name_prefix="s3-read"))

    def reset(self) -> None:
        """Forget the client, getter and thread pool (a new endpoint or credentials in the
        environment take effect at the next request)."""
        with self._lock:
            made, self._made = self._made, {}
        pool = made.get("pool")
        if pool is not None and pool[0] == os.getpid():
            pool[1].shutdown(wait=False)

    # Requests ----------------------------------------------------------------------------------
    def _with_retries(self, what: str, call, failed: Optional[BaseException] = None):
        """call(), retried with exponential backoff and jitter on 5xx answers, throttling,
        dropped or reset connections, timeouts and short bodies; past `settings.retries`
        attempts, or at once for errors that retrying cannot fix (no such bucket or key,
        refused credentials), one ObjectStorageError naming `what`. `failed`: the error of a
        first attempt made elsewhere (read_ranges), counted as attempt 1."""
        s = self.settings
        last: Optional[BaseException] = None
        for attempt in range(max(1, s.retries)):
            try:
                if failed is not None:
                    error, failed = failed, None
                    raise error
                return call()
            except Exception as e:  # noqa: BLE001 - classified below
                last = e
                if not _retryable(e):
                    raise ObjectStorageError(f"{what}: {_describe(e)}") from None
                if attempt + 1 < s.retries:
                    delay = min(5.0, s.backoff_s * 2 ** attempt)
                    time.sleep(delay * (0.5 + random.random() / 2))
        raise ObjectStorageError(f"{what}: failed after {s.retries} attempts "
                                 f"(last: {_describe(last)})")

    def head(self, url: str) -> Tuple[int, str]:
        """(size in bytes, ETag) of the object `url`."""
        bucket, key = split_url(url)
        answer = self._with_retries(url, lambda: self.client().head_object(Bucket=bucket,
                                                                           Key=key))
        return int(answer["ContentLength"]), str(answer.get("ETag", "")).strip('"')

    def exists(self, url: str) -> bool:
        """Whether the object exists: False for a missing key; a missing bucket, refused
        credentials and requests failing past their retries raise ObjectStorageError."""
        try:
            self.head(url)
            return True
        except ObjectStorageError as e:
            if "no such" not in str(e) and "404" not in str(e):
                raise
        bucket, _ = split_url(url)  # a HEAD answers 404 for a missing bucket too: which is it?
        try:
            self._with_retries(f"{SCHEME}{bucket}",
                               lambda: self.client().head_bucket(Bucket=bucket))
        except ObjectStorageError as e:
            if "404" in str(e) or "no such" in str(e):
                raise ObjectStorageError(f"{url}: no such bucket {bucket!r}") from None
            raise
        return False

    def read_range(self, url: str, start: int, end: int,
                   failed: Optional[BaseException] = None) -> bytes:
        """Bytes [start, end) of object `url`, whole or an ObjectStorageError (`failed`: a first
        attempt's error, as _with_retries takes it)."""
        bucket, key = split_url(url)

        def get() -> bytes:
            if self.settings.reader == "sigv4":
                data = self.getter().get(bucket, key, start, end)
            else:
                answer = self.client().get_object(Bucket=bucket, Key=key,
                                                  Range=f"bytes={start}-{end - 1}")
                body = answer["Body"]
                try:
                    data = body.read()
                finally:
                    body.close()
            if len(data) != end - start:
                raise _ShortRead(f"{len(data)} of {end - start} bytes")
            return data

        if end <= start:
            return b""
        return self._with_retries(f"{url} bytes [{start}, {end})", get, failed)

    def read_ranges(self, url: str, ranges: List[Tuple[int, int]]) -> Iterable[bytes]:
        """Bytes of each [start, end) of `ranges` (non-empty), in order, each whole or an
        ObjectStorageError as read_range's: with the sigv4 reader their GETs go out together
        from this thread (RangedGetter.get_many) and a range whose first attempt failed is
        retried alone; with boto3, one after another."""
        if self.settings.reader != "sigv4" or len(ranges) < 2:
            for start, end in ranges:
                yield self.read_range(url, start, end)
            return
        bucket, key = split_url(url)
        try:
            got = self.getter().get_many(bucket, key, ranges, self.settings.max_connections)
        except Exception as e:  # noqa: BLE001 - each range's retry classifies it
            got = [e] * len(ranges)
        for (start, end), data in zip(ranges, got):
            if isinstance(data, bytes) and len(data) == end - start:
                yield data
            else:
                yield self.read_range(url, start, end, data if isinstance(data, BaseException)
                                      else _ShortRead(f"{len(data)} of {end - start} bytes"))

    def download(self, url: str, path: str) -> None:
        """The whole object `url` into the file `path` (a temporary name, then renamed)."""
        size, _ = self.head(url)
        tmp = f"{path}.tmp-{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                step = 64 * 1024 * 1024
                for start in range(0, size, step):
                    f.write(self.read_range(url, start, min(size, start + step)))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def upload(self, path: str, url: str) -> None:
        """The file `path` to object `url` (multipart above 64 MiB, boto3's transfer manager)."""
        from boto3.s3.transfer import TransferConfig

        bucket, key = split_url(url)
        config = TransferConfig(multipart_threshold=64 * 1024 * 1024,
                                multipart_chunksize=64 * 1024 * 1024)
        self._with_retries(f"upload of {path} to {url}",
                           lambda: self.client().upload_file(path, bucket, key, Config=config))

    def delete(self, url: str) -> None:
        """Remove the object `url` (retried as reads are)."""
        bucket, key = split_url(url)
        self._with_retries(f"delete of {url}",
                           lambda: self.client().delete_object(Bucket=bucket, Key=key))

    def local_copy(self, url: str) -> str:
        """A node-local copy of the (small) object `url` under `settings.cache_path`,
        downloaded once per node: the first process takes a lock (flock beside the copy),
        downloads to a temporary name and renames, the others wait and find it; a copy that no
        longer matches the object's size and ETag is replaced."""
        bucket, key = split_url(url)
        size, etag = self.head(url)
        root = self.settings.cache_path or default_cache_path()
        path = os.path.join(root, "objects", bucket, key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        meta_path, want = path + ".meta.json", {"size": size, "etag": etag}

        def current() -> bool:
            try:
                with open(meta_path, encoding="utf-8") as f:
                    return json.load(f) == want and os.path.getsize(path) == size
            except (OSError, ValueError):
                return False

        if current():
            return path
        with open(path + ".lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one process per node downloads; the others wait
            try:
                if not current():
                    self.download(url, path)
                    with open(meta_path + ".tmp", "w", encoding="utf-8") as f:
                        json.dump(want, f)
                    os.replace(meta_path + ".tmp", meta_path)
                    self.downloads.append(url)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        return path


def _retryable(error: BaseException) -> bool:
    import http.client

    from botocore.exceptions import BotoCoreError, ClientError

    from .s3_get import HttpError

    if isinstance(error, HttpError):
        return error.code in _RETRY_CODES or error.status >= 500 or error.status == 429
    if isinstance(error, http.client.HTTPException):
        return True
    if isinstance(error, ClientError):
        response = error.response or {}
        code = str(response.get("Error", {}).get("Code", ""))
        status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        return code in _RETRY_CODES or status >= 500 or status == 429
    return isinstance(error, (BotoCoreError, OSError, _ShortRead)) or \
        type(error).__module__.startswith("urllib3")


def _describe(error: BaseException) -> str:
    from botocore.exceptions import ClientError

    from .s3_get import HttpError

    code = status = None
    if isinstance(error, HttpError):
        code, status = error.code, error.status
    elif isinstance(error, ClientError):
        response = error.response or {}
        code = response.get("Error", {}).get("Code", "")
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", "")
    if code is not None:
        hint = {"NoSuchBucket": "no such bucket", "NoSuchKey": "no such key",
                "404": "no such bucket or key", "403": "access denied (credentials?)",
                "AccessDenied": "access denied", "InvalidAccessKeyId": "unknown access key",
                "SignatureDoesNotMatch": "wrong secret key",
                "PermanentRedirect": "the bucket is in another region: set AWS_REGION to it "
                                     "(or --object-storage-reader boto3, which follows)",
                "AuthorizationHeaderMalformed": "wrong region? set AWS_REGION to the "
                                                "bucket's"}.get(str(code or status), "")
        return f"{code or status} {hint}".strip()
    return f"{type(error).__name__}: {error}"


class _ShortRead(Exception):
    pass


# The data file ---------------------------------------------------------------------------------
def merge_ranges(ranges: Iterable[Tuple[int, int]], gap: int) -> List[Tuple[int, int]]:
    """Sorted ranges with those at most `gap` bytes apart joined."""
    out: List[List[int]] = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if out and start <= out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


class RemoteBin:
    """Byte ranges of one data object read through `storage`, into a bounded cache of fetched
    extents (`block_cache_mib`, least recently used out); `prefetch` fetches ranges ahead of
    use, those closer than `merge_gap` merged into one request. Thread-safe; pickles as its
    storage, URL and size (a worker builds its own cache)."""

    def __init__(self, storage: ObjectStorage, url: str, size: int, etag: str = "") -> None:
        self.storage, self.url, self.size, self.etag = storage, url, int(size), etag
        self._lock = threading.Lock()
        self._extents: "collections.OrderedDict[int, Tuple[int, bytes]]" = \
            collections.OrderedDict()  # start -> (end, data), least recently used first
        self._starts: List[int] = []  # the extents' starts, sorted
        self._cached = 0
        self._pending: Dict[Tuple[int, int], Future] = {}
        self.fetched_bytes = 0
        self.requests = 0

    @classmethod
    def open(cls, storage: ObjectStorage, url: str) -> "RemoteBin":
        size, etag = storage.head(url)
        return cls(storage, url, size, etag)

    def __getstate__(self):
        return {"storage": self.storage, "url": self.url, "size": self.size, "etag": self.etag}

    def __setstate__(self, state):
        self.__init__(state["storage"], state["url"], state["size"], state["etag"])

    # Reads -------------------------------------------------------------------------------------
    def read(self, start: int, end: int) -> memoryview:
        """Bytes [start, end): from the cache, a fetch under way, or a request now."""
        if end <= start:
            return memoryview(b"")
        while True:
            with self._lock:
                found = self._find(start, end)
                if found is not None:
                    return found
                waiting = [f for (a, b), f in self._pending.items() if a <= start and end <= b]
            if not waiting:
                break
            try:
                waiting[0].result()
            except ObjectStorageError as e:  # the fetch's error, if it is this range's
                failed = getattr(e, "range", None)
                if failed is None or failed[0] <= start and end <= failed[1]:
                    raise
                # another range of the same task failed, and its later ones were not
                # fetched: this one is no longer pending, and is fetched here
        self._store(start, end, self._fetch(start, end))
        with self._lock:
            found = self._find(start, end)
        return found if found is not None else memoryview(self._fetch(start, end))

    def prefetch(self, ranges: Iterable[Tuple[int, int]]) -> List[Future]:
        """Start fetching `ranges` (merged) that are neither cached nor under way; returns the
        futures (their errors surface again when the bytes are read). With the sigv4 reader
        they go as one task whose GETs run together (read_ranges), so that a batch costs one
        thread hand-off, not one per request; with boto3, one task per range."""
        todo, settings = [], self.storage.settings
        with self._lock:
            for start, end in merge_ranges(ranges, settings.merge_gap):
                start, end = max(0, start), min(self.size, end)
                if end <= start or self._find(start, end, touch=False) is not None or any(
                        a <= start and end <= b for a, b in self._pending):
                    continue
                todo.append((start, end))
            if not todo:
                return []
            groups = [todo] if settings.reader == "sigv4" else [[r] for r in todo]
            futures = []
            for group in groups:
                future = self.storage.pool().submit(self._fetch_and_store, group)
                for r in group:
                    self._pending[r] = future
                futures.append(future)
        return futures

    def items(self, offsets, itemsize: int, gap: int = 4 * 1024 * 1024) -> bytes:
        """The `itemsize` bytes at each of the sorted byte `offsets`, concatenated: ranges less
        than `gap` apart are read as one, concurrently, past the cache (a scan, read once)."""
        offsets = [int(o) for o in offsets]
        merged = merge_ranges(((o, o + itemsize) for o in offsets), gap)
        parts = dict(zip((a for a, _ in merged),
                         self.storage.pool().map(lambda r: self._fetch(*r), merged)))
        out, k = bytearray(), 0
        for start, end in merged:
            data = parts[start]
            while k < len(offsets) and offsets[k] + itemsize <= end:
                out += data[offsets[k] - start:offsets[k] - start + itemsize]
                k += 1
        return bytes(out)

    def _fetch(self, start: int, end: int) -> bytes:
        data = self.storage.read_range(self.url, start, end)
        with self._lock:
            self.fetched_bytes += len(data)
            self.requests += 1
        return data

    def _fetch_and_store(self, ranges: List[Tuple[int, int]]) -> None:
        done = 0
        try:
            for (start, end), data in zip(ranges, self.storage.read_ranges(self.url, ranges)):
                with self._lock:
                    self.fetched_bytes += len(data)
                    self.requests += 1
                self._store(start, end, data)
                with self._lock:
                    self._pending.pop((start, end), None)
                done += 1
        except ObjectStorageError as e:
            e.range = ranges[done]  # which one failed: read() raises it for that range only
            raise
        finally:
            with self._lock:
                for r in ranges:
                    self._pending.pop(r, None)

    # The cache (callers hold no lock unless said) ------------------------------------------------
    def _find(self, start: int, end: int, touch: bool = True) -> Optional[memoryview]:
        """Under the lock: a view of [start, end) from one cached extent, or None (the few
        extents starting nearest below `start` are looked at)."""
        i = bisect.bisect_right(self._starts, start) - 1
        for j in range(i, max(-1, i - 4), -1):
            a = self._starts[j]
            b, data = self._extents[a]
            if end <= b:
                if touch:
                    self._extents.move_to_end(a)
                return memoryview(data)[start - a:end - a]
        return None

    def _store(self, start: int, end: int, data: bytes) -> None:
        limit = max(1, self.storage.settings.block_cache_mib) * 1024 * 1024
        with self._lock:
            old = self._extents.pop(start, None)
            if old is not None:
                self._cached -= len(old[1])
            else:
                bisect.insort(self._starts, start)
            self._extents[start] = (end, data)
            self._cached += len(data)
            while self._cached > limit and len(self._extents) > 1:
                first, (_, dropped) = self._extents.popitem(last=False)
                del self._starts[bisect.bisect_left(self._starts, first)]
                self._cached -= len(dropped)

    @property
    def cached_bytes(self) -> int:
        return self._cached

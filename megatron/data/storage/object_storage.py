"""Training data on S3-compatible object storage (AWS S3, Ceph RGW, MinIO): `s3://bucket/prefix`.

A dataset prefix `s3://bucket/path/name` names the objects `path/name.idx` and `path/name.bin`.

- **Index files** are downloaded once per node into a node-local folder (`--object-storage-cache-
  path`, default `<data cache>/object-storage`): the first process takes a lock (flock on a file
  beside the copy), downloads to a temporary name and renames; the others wait on the lock and
  then find the copy. A copy whose size or ETag no longer matches the object (written again) is
  fetched again. The C++ reader maps that copy as it maps a local index, and checks it against
  the object's size: an object shorter than its index says is refused at open.
- **Data files** are never downloaded whole: `RemoteBin` reads byte ranges with HTTP range GETs
  into a bounded in-memory cache (`--object-storage-block-cache-mib`, least recently used out).
  The sampler's order is known ahead, so the loader (`readahead.py`) asks for the ranges of the
  next batches of this process before they are needed; ranges closer than `merge_gap` are merged
  into one request, and requests run concurrently (`--object-storage-max-connections`): with
  the sigv4 reader, those of one prefetch go out together from one pool thread, which reads the
  answers as they come (one thread hand-off per batch, not per request).
- **Faults**: each request is retried with exponential backoff and jitter on 5xx answers,
  throttling (SlowDown), dropped or reset connections, timeouts and short bodies (a truncated
  answer is never handed out: the body's length is checked). Past `retries` attempts, or at once
  for errors that retrying cannot fix (no such bucket or key, refused credentials), one
  `ObjectStorageError` names the object and the byte range. Each request has connect and read
  timeouts, so with the retries a read ends well inside `--distributed-timeout-minutes`.
- **Client**: boto3 (the optional extra `pip install -e ".[s3]"`), so the endpoint and the
  credentials follow the conventions users have: `AWS_ENDPOINT_URL` (or `AWS_ENDPOINT_URL_S3`),
  `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY`, `AWS_PROFILE` and the `~/.aws` files. Path-style
  addressing unless `AWS_S3_ADDRESSING_STYLE` says otherwise (Ceph RGW and MinIO want it). The
  data files' ranged GETs go by default through `s3_get.RangedGetter`, which takes boto3's
  endpoint, region and credentials and signs each request itself (SigV4) over kept-alive
  connections: the loader is bound by the client's CPU per request, and boto3 spends several
  times more (`--object-storage-reader boto3` sends them through boto3). Why these: bench/
  RESULTS.md ("object storage"). One client, getter and thread pool per process (after a fork,
  DataLoader workers make their own).

This module does not import torch.
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
from dataclasses import dataclass, replace
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


_SETTINGS = StorageSettings()


def configure(**changes) -> StorageSettings:
    """Set this process's settings (the trainer, from its flags; inherited by forked workers);
    the next request makes a new client with them."""
    global _SETTINGS
    _SETTINGS = replace(_SETTINGS, **changes)
    reset()
    return _SETTINGS


def reset() -> None:
    """Forget this process's client and thread pool (a new endpoint or credentials in the
    environment take effect at the next request)."""
    with _client_lock:
        _clients.clear()
        _getters.clear()
    with _pool_lock:
        for pool in _pools.values():
            pool.shutdown(wait=False)
        _pools.clear()


def settings() -> StorageSettings:
    return _SETTINGS


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


# The client ------------------------------------------------------------------------------------
_RETRY_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
                "TooManyRequests", "InternalError", "ServiceUnavailable", "RequestTimeout",
                "RequestTimeTooSkewed", "503", "500", "502", "504"}
_client_lock = threading.Lock()
_clients: Dict[int, object] = {}
_getters: Dict[int, object] = {}


def client():
    """This process's boto3 S3 client (a fresh one after a fork)."""
    pid = os.getpid()
    found = _clients.get(pid)
    if found is not None:
        return found
    with _client_lock:
        if pid not in _clients:
            try:
                import boto3
                from botocore.config import Config
            except ImportError:
                raise ObjectStorageError(
                    "s3:// data needs boto3: pip install -e \".[s3]\" (or pip install boto3)"
                ) from None
            s = _SETTINGS
            style = os.environ.get("AWS_S3_ADDRESSING_STYLE", "path")
            config = Config(retries={"total_max_attempts": 1},  # ours retry (module docstring)
                            connect_timeout=s.timeout_s, read_timeout=s.timeout_s,
                            max_pool_connections=max(10, s.max_connections),
                            s3={"addressing_style": style},
                            # a ranged GET carries no whole-object checksum on AWS; some
                            # servers (rclone, older Ceph) echo the PUT's, which would fail
                            # every ranged read: checksums only where the API requires them
                            request_checksum_calculation="when_required",
                            response_checksum_validation="when_required")
            session = boto3.session.Session()
            _clients.clear()
            _clients[pid] = session.client("s3", config=config)
    return _clients[pid]


def getter():
    """This process's s3_get.RangedGetter (on the boto3 client's endpoint and credentials)."""
    pid = os.getpid()
    found = _getters.get(pid)
    if found is not None:
        return found
    boto = client()
    with _client_lock:
        if pid not in _getters:
            from .s3_get import RangedGetter

            _getters.clear()
            _getters[pid] = RangedGetter(
                boto, _SETTINGS.timeout_s, os.environ.get("AWS_S3_ADDRESSING_STYLE", "path"))
    return _getters[pid]


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


def _with_retries(what: str, call, failed: Optional[BaseException] = None):
    """call() retried as the module docstring says; ObjectStorageError naming `what`. `failed`:
    the error of a first attempt made elsewhere (read_ranges), counted as attempt 1."""
    s = _SETTINGS
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


def head(url: str) -> Tuple[int, str]:
    """(size in bytes, ETag) of the object `url`."""
    bucket, key = split_url(url)
    answer = _with_retries(url, lambda: client().head_object(Bucket=bucket, Key=key))
    return int(answer["ContentLength"]), str(answer.get("ETag", "")).strip('"')


def exists(url: str) -> bool:
    """Whether the object exists: False for a missing key; a missing bucket, refused
    credentials and requests failing past their retries raise ObjectStorageError."""
    try:
        head(url)
        return True
    except ObjectStorageError as e:
        if "no such" not in str(e) and "404" not in str(e):
            raise
    bucket, _ = split_url(url)  # a HEAD answers 404 for a missing bucket too: which is it?
    try:
        _with_retries(f"{SCHEME}{bucket}", lambda: client().head_bucket(Bucket=bucket))
    except ObjectStorageError as e:
        if "404" in str(e) or "no such" in str(e):
            raise ObjectStorageError(f"{url}: no such bucket {bucket!r}") from None
        raise
    return False


def read_range(url: str, start: int, end: int,
               failed: Optional[BaseException] = None) -> bytes:
    """Bytes [start, end) of object `url`, whole or an ObjectStorageError (`failed`: a first
    attempt's error, as _with_retries takes it)."""
    bucket, key = split_url(url)

    def get() -> bytes:
        if _SETTINGS.reader == "sigv4":
            data = getter().get(bucket, key, start, end)
        else:
            answer = client().get_object(Bucket=bucket, Key=key,
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
    return _with_retries(f"{url} bytes [{start}, {end})", get, failed)


def read_ranges(url: str, ranges: List[Tuple[int, int]]) -> Iterable[bytes]:
    """Bytes of each [start, end) of `ranges` (non-empty), in order, each whole or an
    ObjectStorageError as read_range's: with the sigv4 reader their GETs go out together from
    this thread (RangedGetter.get_many) and a range whose first attempt failed is retried
    alone; with boto3, one after another."""
    if _SETTINGS.reader != "sigv4" or len(ranges) < 2:
        for start, end in ranges:
            yield read_range(url, start, end)
        return
    bucket, key = split_url(url)
    try:
        got = getter().get_many(bucket, key, ranges, _SETTINGS.max_connections)
    except Exception as e:  # noqa: BLE001 - each range's retry classifies it
        got = [e] * len(ranges)
    for (start, end), data in zip(ranges, got):
        if isinstance(data, bytes) and len(data) == end - start:
            yield data
        else:
            yield read_range(url, start, end, data if isinstance(data, BaseException) else
                             _ShortRead(f"{len(data)} of {end - start} bytes"))


def download(url: str, path: str) -> None:
    """The whole object `url` into the file `path` (written under a temporary name, renamed)."""
    size, _ = head(url)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            step = 64 * 1024 * 1024
            for start in range(0, size, step):
                f.write(read_range(url, start, min(size, start + step)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def upload(path: str, url: str) -> None:
    """The file `path` to object `url` (multipart above 64 MiB, by boto3's transfer manager)."""
    from boto3.s3.transfer import TransferConfig

    bucket, key = split_url(url)
    config = TransferConfig(multipart_threshold=64 * 1024 * 1024,
                            multipart_chunksize=64 * 1024 * 1024)
    _with_retries(f"upload of {path} to {url}",
                  lambda: client().upload_file(path, bucket, key, Config=config))


def delete(url: str) -> None:
    """Remove the object `url` (retried as reads are)."""
    bucket, key = split_url(url)
    _with_retries(f"delete of {url}", lambda: client().delete_object(Bucket=bucket, Key=key))


DOWNLOADS: List[str] = []
"""The index copies this process downloaded (for tests and the log)."""


def local_copy(url: str) -> str:
    """A node-local copy of the (small) object `url`, downloaded once per node (module
    docstring); a copy that no longer matches the object's size and ETag is replaced."""
    bucket, key = split_url(url)
    size, etag = head(url)
    path = os.path.join(_SETTINGS.cache_path or default_cache_path(), "objects", bucket, key)
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
                download(url, path)
                with open(meta_path + ".tmp", "w", encoding="utf-8") as f:
                    json.dump(want, f)
                os.replace(meta_path + ".tmp", meta_path)
                DOWNLOADS.append(url)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return path


# The data file ---------------------------------------------------------------------------------
_pool_lock = threading.Lock()
_pools: Dict[int, ThreadPoolExecutor] = {}


def _pool() -> ThreadPoolExecutor:
    pid = os.getpid()
    with _pool_lock:
        if pid not in _pools:
            _pools.clear()
            _pools[pid] = ThreadPoolExecutor(max_workers=max(1, _SETTINGS.max_connections),
                                             thread_name_prefix="s3-read")
        return _pools[pid]


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
    """Byte ranges of one data object, through a bounded cache of fetched extents (module
    docstring). Thread-safe; pickles as its URL and size (a worker builds its own cache)."""

    def __init__(self, url: str, size: int, etag: str = "") -> None:
        self.url, self.size, self.etag = url, int(size), etag
        self._lock = threading.Lock()
        self._extents: "collections.OrderedDict[int, Tuple[int, bytes]]" = \
            collections.OrderedDict()  # start -> (end, data), least recently used first
        self._starts: List[int] = []  # the extents' starts, sorted
        self._cached = 0
        self._pending: Dict[Tuple[int, int], Future] = {}
        self.fetched_bytes = 0
        self.requests = 0

    @classmethod
    def open(cls, url: str) -> "RemoteBin":
        size, etag = head(url)
        return cls(url, size, etag)

    def __getstate__(self):
        return {"url": self.url, "size": self.size, "etag": self.etag}

    def __setstate__(self, state):
        self.__init__(state["url"], state["size"], state["etag"])

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
        todo = []
        with self._lock:
            for start, end in merge_ranges(ranges, _SETTINGS.merge_gap):
                start, end = max(0, start), min(self.size, end)
                if end <= start or self._find(start, end, touch=False) is not None or any(
                        a <= start and end <= b for a, b in self._pending):
                    continue
                todo.append((start, end))
            if not todo:
                return []
            groups = [todo] if _SETTINGS.reader == "sigv4" else [[r] for r in todo]
            futures = []
            for group in groups:
                future = _pool().submit(self._fetch_and_store, group)
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
                         _pool().map(lambda r: self._fetch(*r), merged)))
        out, k = bytearray(), 0
        for start, end in merged:
            data = parts[start]
            while k < len(offsets) and offsets[k] + itemsize <= end:
                out += data[offsets[k] - start:offsets[k] - start + itemsize]
                k += 1
        return bytes(out)

    def _fetch(self, start: int, end: int) -> bytes:
        data = read_range(self.url, start, end)
        with self._lock:
            self.fetched_bytes += len(data)
            self.requests += 1
        return data

    def _fetch_and_store(self, ranges: List[Tuple[int, int]]) -> None:
        done = 0
        try:
            for (start, end), data in zip(ranges, read_ranges(self.url, ranges)):
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
        limit = max(1, _SETTINGS.block_cache_mib) * 1024 * 1024
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

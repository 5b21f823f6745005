"""The sigv4 reader (megatron/data/storage/s3_get.py): its signature is botocore's for the same request,
its bytes are the object's and boto3's for the same ranges on a real S3 server (keys with spaces
and non-ASCII characters included), refused credentials and a server ignoring `Range` each end
in one clear ObjectStorageError."""

import datetime
import http.server
import threading

import numpy as np
import pytest

from megatron.data.storage import object_storage
from megatron.data.storage.object_storage import ObjectStorage, StorageSettings
from megatron.data.storage.s3_get import RangedGetter


def _client(endpoint, style="path", token=None, **kw):
    import boto3
    from botocore.config import Config

    session = boto3.session.Session(aws_access_key_id="AKIAIOSFODNN7EXAMPLE",
                                    aws_secret_access_key="wJalrXUtnFEMI/K7MDENG/bPxRfiCYEX+KEY",
                                    aws_session_token=token, region_name="eu-west-3")
    return session.client("s3", endpoint_url=endpoint,
                          config=Config(s3={"addressing_style": style}), **kw)


@pytest.mark.parametrize("style", ["path", "virtual"])
@pytest.mark.parametrize("token", [None, "FQoGZXIvYXdzE//session+token="])
@pytest.mark.parametrize("key", ["plain/name.bin", "dir with space/ü+=&~(1).bin"])
def test_the_signature_is_botocores_for_the_same_request(monkeypatch, style, token, key):
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest

    when = datetime.datetime(2026, 11, 25, 12, 34, 56, tzinfo=datetime.timezone.utc)
    boto = _client("http://storage.example:9000", style, token)
    getter = RangedGetter(boto, 5.0, style)
    host, path = getter._where("my-bucket", key)
    ours = getter._sign(host, path, "bytes=10-99", now=when)

    monkeypatch.setattr("botocore.auth.get_current_datetime", lambda: when.replace(tzinfo=None))
    request = AWSRequest(method="GET", url=f"http://{host}{path}",
                         headers={"Range": "bytes=10-99"})
    S3SigV4Auth(boto._request_signer._credentials.get_frozen_credentials(), "s3",
                "eu-west-3").add_auth(request)
    theirs = {k.lower(): v for k, v in request.headers.items()}
    assert ours.pop("Authorization") == theirs.pop("authorization")
    assert {k.lower(): v for k, v in ours.items() if k != "host"} == theirs
    assert ours["host"] == ("my-bucket.storage.example:9000" if style == "virtual"
                            else "storage.example:9000")


@pytest.fixture
def blob(s3_server, s3_env):
    """An object of 3 MiB with an awkward key, written by boto3 (s3_server.client())."""
    data = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    s3_server.make_bucket("sigv4")
    key = "dir with space/ü+=&~(1).bin"
    s3_server.client().put_object(Bucket="sigv4", Key=key, Body=data)
    return f"s3://sigv4/{key}", data


def test_ranges_read_by_sigv4_are_the_objects_and_boto3s(blob):
    url, data = blob
    rng = np.random.default_rng(1)
    starts = rng.integers(0, len(data) - 1, 40)
    ranges = [(int(s), int(min(len(data), s + rng.integers(1, 200_000)))) for s in starts]
    ranges += [(0, 1), (0, len(data)), (len(data) - 1, len(data))]
    got = {}
    for reader in ("sigv4", "boto3"):
        storage = ObjectStorage(StorageSettings(reader=reader))
        got[reader] = [storage.read_range(url, a, b) for a, b in ranges]
    assert got["sigv4"] == got["boto3"] == [data[a:b] for a, b in ranges]
    storage = ObjectStorage(StorageSettings(reader="sigv4"))
    bin_ = object_storage.RemoteBin.open(storage, url)  # the loader's path: concurrent, pooled
    futures = bin_.prefetch(ranges[:20])
    for f in futures:
        f.result()
    assert [bytes(bin_.read(a, b)) for a, b in ranges[:20]] == [data[a:b] for a, b in ranges[:20]]


def test_a_wrong_secret_is_one_error_naming_the_range(blob, monkeypatch):
    url, _ = blob
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x" * 40)
    storage = ObjectStorage(StorageSettings(reader="sigv4", retries=3, backoff_s=0.01))
    with pytest.raises(object_storage.ObjectStorageError) as e:
        storage.read_range(url, 5, 50)
    assert str(e.value).startswith(f"{url} bytes [5, 50): ")
    assert "403" in str(e.value) or "Signature" in str(e.value)
    assert "attempts" not in str(e.value)  # not retried: retrying cannot fix it


class _WholeObject(http.server.BaseHTTPRequestHandler):
    """A server that ignores Range: 200 and the whole object, no Content-Range."""

    body = bytes(range(256)) * 1024

    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


def test_a_server_ignoring_the_range_is_refused_not_streamed(s3_env, monkeypatch):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _WholeObject)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.server_port}")
        storage = ObjectStorage(StorageSettings(reader="sigv4"))
        with pytest.raises(object_storage.ObjectStorageError,
                           match=r"s3://any/key bytes \[0, 100\): RangeIgnored: the server "
                                 r"ignored the range: 200 without Content-Range, 262144 bytes"):
            storage.read_range("s3://any/key", 0, 100)
    finally:
        server.shutdown()


@pytest.mark.parametrize("verify", [None, False, "bundle"])
def test_https_is_verified_as_boto3_verifies(verify, tmp_path):
    import ssl

    from botocore.httpsession import get_cert_path

    kw = {} if verify is None else {"verify": False} if verify is False else \
        {"verify": get_cert_path(True)}  # the bundle botocore itself would use
    boto = _client("https://storage.example", **kw)
    getter = RangedGetter(boto, 5.0)
    assert getter._context.verify_mode == (ssl.CERT_NONE if verify is False
                                           else ssl.CERT_REQUIRED)


class _ClosingServer(http.server.BaseHTTPRequestHandler):
    """HTTP/1.1 that keeps a connection open in its headers' words (no `Connection: close`)
    and then closes it after one answer, as servers do to idle kept-alive connections; GETs of
    /denied, and of a range from byte 666, get a chunked 403 with S3's error XML."""

    protocol_version = "HTTP/1.1"
    body = bytes(range(256)) * 16

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path.endswith("/denied") or self.headers["Range"].startswith("bytes=666-"):
            xml = b"<Error><Code>AccessDenied</Code><Message>no</Message></Error>"
            self.send_response(403)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for part in (xml[:20], xml[20:], b""):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
        else:
            a, b = (int(x) for x in self.headers["Range"].split("=")[1].split("-"))
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {a}-{b}/{len(self.body)}")
            self.send_header("Content-Length", str(b + 1 - a))
            self.end_headers()
            self.wfile.write(self.body[a:b + 1])
        self.close_connection = True

    def log_message(self, *args):
        pass


@pytest.fixture
def closing_server(s3_env, monkeypatch):
    """A _ClosingServer on a loopback port, AWS_ENDPOINT_URL pointing at it."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ClosingServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.server_port}")
    try:
        yield server
    finally:
        server.shutdown()


def test_a_kept_alive_connection_the_server_closed_is_replaced_at_once(closing_server):
    """One attempt only: the GET on a connection the server had closed goes again on a new
    one without needing the caller's retry; a chunked error answer is read for its code."""
    storage = ObjectStorage(StorageSettings(reader="sigv4", retries=1))
    body = _ClosingServer.body
    for a, b in [(0, 10), (5, 300), (4000, 4096), (1, 2)]:
        assert storage.read_range("s3://any/key", a, b) == body[a:b]
    with pytest.raises(object_storage.ObjectStorageError,
                       match=r"s3://any/denied bytes \[0, 5\): AccessDenied"):
        storage.read_range("s3://any/denied", 0, 5)


def test_a_range_failing_in_a_prefetch_fails_its_own_reads_only(closing_server):
    """A prefetch's GETs go together; one refused fails the reads of its range, naming it,
    and the ranges after it, not fetched then, are read on demand."""
    storage = ObjectStorage(StorageSettings(reader="sigv4", merge_gap=0))
    body = _ClosingServer.body
    remote = object_storage.RemoteBin(storage, "s3://any/key", len(body))
    for future in remote.prefetch([(0, 10), (666, 700), (3000, 3100)]):
        future.exception()
    assert bytes(remote.read(0, 10)) == body[0:10]
    with pytest.raises(object_storage.ObjectStorageError,
                       match=r"s3://any/key bytes \[666, 700\): AccessDenied"):
        remote.read(666, 700)
    assert bytes(remote.read(3000, 3100)) == body[3000:3100]

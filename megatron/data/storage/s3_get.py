"""Ranged GETs of training data, signed with AWS Signature Version 4, over kept-alive sockets.

The loader's hot path is many small ranged GETs (one per document a sample touches). Through
boto3 each costs about 1.1 ms of client CPU (parameter validation, event hooks, the response
parser, urllib3); through `http.client` about 0.3 ms, most of it the email-based header parser.
Signing one request, sending it in one write and reading its answer with the few header fields
a ranged GET needs (status, Content-Length, Content-Range, Transfer-Encoding, Connection) costs
a fraction of that (bench/RESULTS.md, "object storage"). So data reads take this path, and
everything else (HEAD, listing, uploads, the `.idx` download) stays on boto3.

What it shares with boto3, so both reach the same server as the same user: the endpoint, the
region, the addressing style, the CA bundle and the credentials (the boto3 client's resolved
provider chain: environment, profiles, `~/.aws` files, instance roles; refreshed when they are
temporary). Connections (TCP, TLS for https) are per thread and kept alive; a connection that
fails is dropped and the caller's retry makes a new one, except a kept-alive one the server
closed before answering, on which the GET goes again at once on a new connection.

Answers: 206 with the asked range, or 200 carrying the right `Content-Range` (rclone and some
S3-compatible servers answer a ranged GET so). A 200 announcing more bytes than asked, without
`Content-Range` (a server ignoring `Range`), is refused before its body is read. Error answers
(with a Content-Length or chunked) carry S3's XML error code, raised as `HttpError` for
object_storage's retry and message rules.

This module does not import torch.
"""

from __future__ import annotations

import collections
import datetime
import hashlib
import hmac
import http.client
import os
import re
import selectors
import socket
import ssl
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple, Union
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


class _NoAnswer(Exception):
    """The connection ended before any byte of the answer."""


_HEAD_LIMIT = 64 * 1024


def _read_head(sock: socket.socket) -> Tuple[int, Dict[bytes, bytes], bytearray]:
    """(status, {lower-case field name: value}, the bytes read past the head) of an HTTP/1.1
    answer. The few fields a ranged GET needs are parsed here (http.client's email-based
    parser costs more CPU than the rest of a request: bench/RESULTS.md, "object storage")."""
    buf = bytearray()
    while True:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            break
        chunk = sock.recv(_HEAD_LIMIT)
        if not chunk:
            if not buf:
                raise _NoAnswer()
            raise http.client.IncompleteRead(bytes(buf))
        buf += chunk
        if len(buf) > _HEAD_LIMIT:
            raise http.client.LineTooLong("answer head")
    status, fields = _parse_head(bytes(buf[:end]))
    return status, fields, buf[end + 4:]


def _parse_head(head: bytes) -> Tuple[int, Dict[bytes, bytes]]:
    """(status, {lower-case field name: value}) of an answer's head (its final CRLF CRLF off)."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        raise http.client.BadStatusLine(lines[0].decode("latin-1"))
    fields = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        fields[name.strip().lower()] = value.strip()
    if parts[0] == b"HTTP/1.0" and fields.get(b"connection", b"").lower() != b"keep-alive":
        fields[b"connection"] = b"close"
    return int(parts[1]), fields


def _read_exactly(sock: socket.socket, n: int, rest: bytearray) -> bytes:
    """n bytes: `rest` (already read) and then the socket's."""
    if len(rest) >= n:
        return bytes(rest[:n])
    out = bytearray(n)
    out[:len(rest)] = rest
    view, got = memoryview(out), len(rest)
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise http.client.IncompleteRead(bytes(out[:got]), n - got)
        got += k
    return bytes(out)


class _Buffered:
    """Lines and byte counts from a socket, past bytes already read (chunked bodies only)."""

    def __init__(self, sock: socket.socket, buf: bytearray) -> None:
        self.sock, self.buf = sock, buf

    def _more(self) -> None:
        chunk = self.sock.recv(_HEAD_LIMIT)
        if not chunk:
            raise http.client.IncompleteRead(bytes(self.buf))
        self.buf += chunk

    def line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self._more()
        line, _, rest = bytes(self.buf).partition(b"\r\n")
        self.buf = bytearray(rest)
        return line

    def take(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._more()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out


def _read_body(sock: socket.socket, fields: Dict[bytes, bytes], rest: bytearray) -> bytes:
    """The answer's body: Content-Length bytes, chunked (S3's error answers may be), or up to
    the connection's end."""
    if b"chunked" in fields.get(b"transfer-encoding", b"").lower():
        reader, body = _Buffered(sock, rest), bytearray()
        while True:
            size = int(reader.line().split(b";")[0], 16)
            if size == 0:
                break
            body += reader.take(size)
            reader.line()  # the chunk's own CRLF
        while reader.line():  # trailer fields, up to the empty line
            pass
        return bytes(body)
    length = fields.get(b"content-length")
    if length is not None:
        return _read_exactly(sock, int(length), rest)
    out = bytearray(rest)
    while True:
        chunk = sock.recv(1 << 20)
        if not chunk:
            return bytes(out)
        out += chunk


def _close(sock: Optional[socket.socket]) -> None:
    if sock is not None:
        sock.close()


class _Answer:
    """get_many's state of one request: the bytes of its answer read so far."""

    __slots__ = ("index", "start", "end", "may_retry", "buf", "status", "fields", "length",
                 "close")

    def __init__(self, index: int, start: int, end: int, may_retry: bool) -> None:
        self.index, self.start, self.end, self.may_retry = index, start, end, may_retry
        self.buf = bytearray()
        self.status: Optional[int] = None
        self.fields: Dict[bytes, bytes] = {}
        self.length = 0
        self.close = False

    def take(self, sock: socket.socket) -> bool:
        """Read what the socket has; True once the answer is whole (False: more to come)."""
        while True:
            chunk = sock.recv(max(_HEAD_LIMIT, min(1 << 20, self.length - len(self.buf))))
            if not chunk:
                if self.status is None and not self.buf:
                    raise _NoAnswer()
                raise http.client.IncompleteRead(bytes(self.buf))
            self.buf += chunk
            if self.status is None:
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(self.buf) > _HEAD_LIMIT:
                        raise http.client.LineTooLong("answer head")
                    if not _pending(sock):
                        return False
                    continue
                self.status, self.fields = _parse_head(bytes(self.buf[:end]))
                del self.buf[:end + 4]
                length = self.fields.get(b"content-length")
                if length is None or b"chunked" in \
                        self.fields.get(b"transfer-encoding", b"").lower():
                    # framed otherwise (an error answer, chunked): get() reads those
                    raise http.client.HTTPException("an answer without Content-Length")
                self.length = int(length)
                if self.status == 200 and b"content-range" not in self.fields and \
                        self.length > self.end - self.start:
                    raise RangeIgnored(f"the server ignored the range: 200 without "
                                       f"Content-Range, {self.length} bytes")
                self.close = self.fields.get(b"connection", b"").lower() == b"close"
            if len(self.buf) >= self.length:
                return True
            if not _pending(sock):
                return False

    def result(self) -> Union[bytes, BaseException]:
        body = bytes(self.buf[:self.length])
        if self.status in (200, 206):
            return body
        found = _CODE.search(body)
        return HttpError(self.status or 0, found.group(1).decode() if found else "")


def _pending(sock: socket.socket) -> int:
    """Bytes a TLS socket holds decrypted already (the selector does not see those)."""
    pending = getattr(sock, "pending", None)
    return pending() if pending is not None else 0


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
        self._stamp: Tuple[int, str, str] = (-1, "", "")  # (second, x-amz-date, day)

    # Requests ----------------------------------------------------------------------------------
    def get(self, bucket: str, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of the object (fewer if the object is shorter: the caller checks).

        Raises:
            HttpError: an error answer; RangeIgnored; OSError / http.client.HTTPException:
            the connection failed (the connection is dropped either way)."""
        host, path = self._where(bucket, key)
        request = self._request(host, path, start, end)
        for last_try in (False, True):
            sock, reused = self._connection(host)
            try:
                sock.sendall(request)
                status, fields, rest = _read_head(sock)
                break
            except (_NoAnswer, ConnectionResetError, BrokenPipeError) as e:
                self._drop()
                # a kept-alive connection the server had closed: the GET never reached it,
                # so it goes again at once on a new connection (a new one failing is a fault)
                if not reused or last_try:
                    if isinstance(e, _NoAnswer):
                        raise http.client.RemoteDisconnected(
                            "the server closed the connection without an answer") from None
                    raise
            except BaseException:
                self._drop()
                raise
        try:
            length = fields.get(b"content-length")
            if status == 200 and b"content-range" not in fields and \
                    length is not None and int(length) > end - start:
                raise RangeIgnored(f"the server ignored the range: 200 without Content-Range, "
                                   f"{length.decode('latin-1')} bytes")
            body = _read_body(sock, fields, rest)
        except BaseException:
            self._drop()
            raise
        if fields.get(b"connection", b"").lower() == b"close" or length is None and \
                b"chunked" not in fields.get(b"transfer-encoding", b"").lower():
            self._drop()  # the server closes it (or ended the body by closing it)
        if status in (200, 206):
            return body  # a short body: the caller's length check
        found = _CODE.search(body)
        raise HttpError(status, found.group(1).decode() if found else "")

    def get_many(self, bucket: str, key: str, ranges: Sequence[Tuple[int, int]],
                 limit: int) -> List[Union[bytes, BaseException]]:
        """Bytes of each [start, end) of `ranges` (fewer if the object is shorter), their GETs
        sent together over at most `limit` kept-alive connections of this thread and their
        answers read as they come, by this one thread: no thread hand-off per request (about
        a third less client CPU a request here than a pool thread each). An entry is
        the exception its request met instead (HttpError, RangeIgnored, OSError,
        http.client.HTTPException); the caller retries those, one by one. A kept-alive
        connection the server had closed is replaced at once, as in `get`."""
        host, path = self._where(bucket, key)
        results: List[Union[bytes, BaseException, None]] = [None] * len(ranges)
        todo = collections.deque((i, False) for i in range(len(ranges)))  # (index, a 2nd go)
        idle = self._idle(host)
        selector = selectors.DefaultSelector()
        try:
            while todo or selector.get_map():
                while todo and len(selector.get_map()) < max(1, limit):
                    i, again = todo.popleft()
                    start, end = ranges[i]
                    sock, reused = (idle.pop(), True) if idle else (None, False)
                    if sock is None:
                        try:
                            sock = self._open(host)
                        except Exception as e:  # noqa: BLE001 - the caller classifies it
                            # unreachable: the others would each wait as long (a timeout)
                            for j, _ in [(i, again), *todo]:
                                results[j] = e
                            todo.clear()
                            continue
                    try:
                        sock.sendall(self._request(host, path, start, end))
                    except (ConnectionResetError, BrokenPipeError) as e:
                        _close(sock)
                        if reused and not again:
                            todo.appendleft((i, True))
                        else:
                            results[i] = e
                        continue
                    except Exception as e:  # noqa: BLE001 - the caller classifies it
                        _close(sock)
                        results[i] = e
                        continue
                    selector.register(sock, selectors.EVENT_READ,
                                      _Answer(i, start, end, reused and not again))
                ready = selector.select(self.timeout_s)
                if not ready:  # no byte on any connection for the timeout: all of them fail
                    for key_ in list(selector.get_map().values()):
                        selector.unregister(key_.fileobj)
                        _close(key_.fileobj)
                        results[key_.data.index] = socket.timeout("timed out")
                    continue
                for key_, _ in ready:
                    sock, answer = key_.fileobj, key_.data
                    try:
                        done = answer.take(sock)
                    except _NoAnswer:
                        done = None
                        if answer.may_retry:
                            todo.appendleft((answer.index, True))
                        else:
                            results[answer.index] = http.client.RemoteDisconnected(
                                "the server closed the connection without an answer")
                    except Exception as e:  # noqa: BLE001 - the caller classifies it
                        done = None
                        if answer.may_retry and not answer.buf and answer.status is None and \
                                isinstance(e, (ConnectionResetError, BrokenPipeError)):
                            todo.appendleft((answer.index, True))
                        else:
                            results[answer.index] = e
                    if done is False:
                        continue  # more bytes to come
                    selector.unregister(sock)
                    if done is None or answer.close:
                        _close(sock)
                    else:
                        idle.append(sock)
                    if done:
                        results[answer.index] = answer.result()
        finally:
            for key_ in list(selector.get_map().values()):
                _close(key_.fileobj)
            selector.close()
        return results  # type: ignore[return-value]

    def _request(self, host: str, path: str, start: int, end: int) -> bytes:
        """The signed GET of bytes [start, end), as sent."""
        headers = self._sign(host, path, f"bytes={start}-{end - 1}")
        return "".join([f"GET {path} HTTP/1.1\r\n",
                        *(f"{name}: {value}\r\n" for name, value in headers.items()),
                        "\r\n"]).encode("latin-1")

    def _idle(self, host: str) -> List[socket.socket]:
        """This thread's kept-alive connections to `host` that get_many may use."""
        idle = getattr(self._local, "idle", None)
        if idle is None or self._local.idle_host != host:
            for sock in idle or ():
                sock.close()
            idle = self._local.idle = []
            self._local.idle_host = host
        return idle

    def _open(self, host: str) -> socket.socket:
        """A new connection to `host` (TCP; TLS for https), with the request timeout."""
        where = urlsplit(f"//{host}")
        port = where.port or (443 if self.scheme == "https" else 80)
        sock = socket.create_connection((where.hostname, port), timeout=self.timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # one send a request
            if self.scheme == "https":
                sock = self._context.wrap_socket(sock, server_hostname=where.hostname)
        except BaseException:
            sock.close()
            raise
        return sock

    def _where(self, bucket: str, key: str) -> Tuple[str, str]:
        """(Host header, request path) of the object: path or virtual-host addressing, the key
        percent-encoded once, as SigV4 signs it for S3."""
        quoted = quote(key, safe="/~")
        if self.virtual:
            return f"{bucket}.{self.host}", f"{self.base_path}/{quoted}"
        return self.host, f"{self.base_path}/{quote(bucket, safe='')}/{quoted}"

    def _connection(self, host: str) -> Tuple[socket.socket, bool]:
        """This thread's connection to `host` and whether it served a request before."""
        sock = getattr(self._local, "sock", None)
        if sock is not None and self._local.host == host:
            return sock, True
        self._drop()
        sock = self._open(host)
        self._local.sock, self._local.host = sock, host
        return sock, False

    def _drop(self) -> None:
        sock = getattr(self._local, "sock", None)
        if sock is not None:
            sock.close()
        self._local.sock = None

    # Signature Version 4 -----------------------------------------------------------------------
    def _sign(self, host: str, path: str, byte_range: str,
              now: Optional[datetime.datetime] = None) -> Dict[str, str]:
        """The request's headers with its SigV4 Authorization (an empty payload), at `now`
        (UTC; default the clock's)."""
        creds = self._credentials.get_frozen_credentials()
        if now is not None:
            stamp, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
        else:  # the clock's second, formatted once a second (one request in ~1000 here)
            second = int(time.time())
            if self._stamp[0] != second:
                stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(second))
                self._stamp = (second, stamp, stamp[:8])
            _, stamp, day = self._stamp
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
        signature = hmac.digest(self._key(creds.secret_key, day), to_sign.encode(),
                                "sha256").hex()
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

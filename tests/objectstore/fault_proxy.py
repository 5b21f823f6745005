"""A real TCP fault-injection proxy for the object-store tests (no mocks): it listens on a
loopback port, forwards raw bytes to a real server (the rclone S3 server of s3_server.py) and,
when a test asks, breaks the next new connections: it drops them, delays them, answers them with
an S3 `503 SlowDown` itself, or truncates the server's response; it can also add latency to
every request. Retry and timeout code then meets the failures on real sockets."""

import select
import socket
import threading
import time
from collections import deque
from typing import Optional, Tuple

HOST = "127.0.0.1"

SLOW_DOWN_BODY = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
                  b'<Message>Please reduce your request rate.</Message>'
                  b'<RequestId>FAULTPROXY</RequestId></Error>')
SLOW_DOWN = (b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
             b"Content-Length: %d\r\nConnection: close\r\nx-amz-request-id: FAULTPROXY\r\n\r\n"
             % len(SLOW_DOWN_BODY)) + SLOW_DOWN_BODY


class FaultProxy:
    """A TCP proxy on 127.0.0.1 (`endpoint`) forwarding to `target` (host, port), with faults.

    Faults apply per new TCP connection, not per request: each accepted connection takes the
    oldest pending fault (FIFO across all kinds), if any. HTTP clients (botocore/urllib3) keep
    connections alive and pool them, so a fault set while a client holds an idle connection is
    only met when that client opens a new one: call reset() after setting a fault (it closes all
    live connections; urllib3 notices and reconnects) or use a fresh client.

    - drop_next(n): accept, then close at once without a response;
    - delay_next(n, seconds): wait `seconds` before forwarding anything;
    - answer_503_next(n): read the request head, answer a complete `503 Slow Down` with an S3
      XML SlowDown body, then close (the server never sees the request);
    - truncate_next(n, keep_bytes): forward, but pass back only the first keep_bytes bytes of
      the response (status line and headers included), then close;
    - latency(seconds): before forwarding each request (each client turn after a response) on
      every connection, sleep `seconds`; 0 turns it off. Not counted as a fault.

    `connections` counts accepted connections, `faults_served` the faults applied and
    `served` lists their kinds in order. Threads are daemons; close() stops everything.
    """

    def __init__(self, target: Tuple[str, int]):
        self.target = target
        self.connections = 0
        self.faults_served = 0
        self.served = []
        self._faults = deque()
        self._latency = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._live = set()
        self._threads = set()
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((HOST, 0))
        self._listener.listen(64)
        self._listener.settimeout(0.1)
        self.port = self._listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True,
                                          name=f"FaultProxy:{self.port}")
        self._acceptor.start()

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    def _add(self, n: int, kind: str, arg: float = 0.0) -> None:
        with self._lock:
            self._faults.extend([(kind, arg)] * n)

    def drop_next(self, n: int = 1) -> None:
        self._add(n, "drop")

    def delay_next(self, n: int, seconds: float) -> None:
        self._add(n, "delay", seconds)

    def answer_503_next(self, n: int = 1) -> None:
        self._add(n, "503")

    def truncate_next(self, n: int, keep_bytes: int) -> None:
        self._add(n, "truncate", keep_bytes)

    def latency(self, seconds: float) -> None:
        self._latency = max(0.0, float(seconds))

    @property
    def pending(self) -> int:
        """Faults set but not yet met by a connection."""
        with self._lock:
            return len(self._faults)

    def clear(self) -> None:
        """Forget pending faults and turn latency off."""
        with self._lock:
            self._faults.clear()
        self._latency = 0.0

    def reset(self, timeout: float = 2.0) -> None:
        """Close every live connection (both sides) and wait for their threads to finish, so that
        clients' next requests open new connections (and meet pending faults)."""
        with self._lock:
            socks, threads = list(self._live), list(self._threads)
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Stop accepting, break all connections and join the threads (bounded: never hangs)."""
        self._stop.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept() at once on Linux
        except OSError:
            pass
        self._acceptor.join(2.0)
        self._listener.close()
        self.reset()

    def __enter__(self) -> "FaultProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            conn.settimeout(None)
            with self._lock:
                self.connections += 1
                fault = self._faults.popleft() if self._faults else None
                if fault is not None:
                    self.faults_served += 1
                    self.served.append(fault[0])
                self._live.add(conn)
                t = threading.Thread(target=self._handle, args=(conn, fault), daemon=True)
                self._threads.add(t)
            t.start()

    def _handle(self, conn: socket.socket, fault) -> None:
        upstream = None
        kind, arg = fault if fault is not None else (None, 0)
        try:
            if kind == "drop":
                return
            if kind == "503":
                self._answer_503(conn)
                return
            if kind == "delay" and self._stop.wait(arg):
                return
            upstream = socket.create_connection(self.target, timeout=5)
            upstream.settimeout(None)
            with self._lock:
                self._live.add(upstream)
            for s in (conn, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._pump(conn, upstream, int(arg) if kind == "truncate" else None)
        except (OSError, ValueError):
            pass
        finally:
            with self._lock:
                self._live.discard(conn)
                self._live.discard(upstream)
                self._threads.discard(threading.current_thread())
            for s in (conn, upstream):
                if s is not None:
                    s.close()

    def _answer_503(self, conn: socket.socket) -> None:
        conn.settimeout(5)
        head = b""
        while b"\r\n\r\n" not in head and len(head) < 65536:
            chunk = conn.recv(65536)
            if not chunk:
                return
            head += chunk
        conn.sendall(SLOW_DOWN)
        conn.shutdown(socket.SHUT_WR)
        # Drain what the client still sends (a body) until it closes: closing with unread data
        # would send a TCP reset, which can destroy the 503 before the client reads it.
        conn.settimeout(0.5)
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and not self._stop.is_set():
            try:
                if not conn.recv(65536):
                    return
            except socket.timeout:
                continue

    def _pump(self, conn: socket.socket, upstream: socket.socket, keep: Optional[int]) -> None:
        peer = {conn: upstream, upstream: conn}
        awaiting_request = True
        returned = 0
        while peer and not self._stop.is_set():
            readable, _, _ = select.select(list(peer), [], [], 0.1)
            for s in readable:
                data = s.recv(65536)
                if not data:  # half-close: pass the EOF on, keep the other direction going
                    try:
                        peer[s].shutdown(socket.SHUT_WR)
                    except OSError:
                        pass
                    del peer[s]
                    continue
                if s is conn:
                    if awaiting_request and self._latency > 0 and self._stop.wait(self._latency):
                        return
                    awaiting_request = False
                    upstream.sendall(data)
                    continue
                awaiting_request = True
                if keep is not None:
                    data = data[:keep - returned]
                    returned += len(data)
                conn.sendall(data)
                if keep is not None and returned >= keep:
                    return

"""HTTP connections to agent hosts with a real deadline: a pool of kept connections per host,
and every call bounded as a whole (connect, send, every byte of the answer), so a host that
trickles is cut at the deadline (docs/dispatch.md)."""

import http.client
import io
import select
import socket
import threading
import time
import weakref
from collections.abc import Callable
from typing import cast
from urllib.parse import urlsplit

from ..validation import check_url
from .answers import MAX_ANSWER_BYTES


class HostConnections:
    """Keep-alive HTTP/1.1 connections to one agent host, shared by the threads of a step.

    Built on the standard library's `http.client`: a goal call through urllib3 cost twice
    the CPU (docs/benchmarks.md, eleventh series), and a step makes one call per session.
    A connection goes back to the idle set only after its whole answer was read; one the
    host closed while idle is noticed (it reads as ready) and replaced before use, as
    urllib3 does. `connect_s` bounds the connection;
    `total_s` the whole call, connection, request and every byte of the answer (a host that
    trickles its answer a byte at a time is cut there, not `total_s` per byte). No call is
    retried here: a failure is the caller's to classify (docs/protocol.md)."""

    def __init__(self, base_url: str, connect_s: float, total_s: float, size: int) -> None:
        parts = urlsplit(check_url(base_url))
        self._make: Callable[..., http.client.HTTPConnection] = (
            http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        )
        self.host, self.port = parts.hostname, parts.port
        self.prefix = parts.path.rstrip("/")
        self.connect_s, self.total_s, self.size = connect_s, total_s, size
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        # The idle connections close when the adapter is dropped.
        weakref.finalize(self, _close_all, self._idle)

    def _take(self) -> http.client.HTTPConnection:
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                return self._make(self.host, self.port, timeout=self.connect_s)
            if not _dropped(conn):
                return conn
            conn.close()

    def _give_back(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if len(self._idle) < self.size:
                self._idle.append(conn)
                return
        conn.close()

    def request(
        self, method: str, path: str, body: bytes | None, headers: dict[str, str]
    ) -> tuple[int, bytes]:
        """One request: the status and at most MAX_ANSWER_BYTES + 1 bytes of the answer.
        Raises OSError (TimeoutError for a timeout) or http.client.HTTPException."""
        deadline = time.monotonic() + self.total_s
        conn = self._take()
        try:
            if conn.sock is None:
                conn.timeout = min(self.connect_s, self.total_s)
                conn.connect()
            sock = cast(socket.socket, conn.sock)
            sock.settimeout(_remaining(deadline))
            conn.request(method, self.prefix + path, body=body, headers=headers)
            sock.settimeout(_remaining(deadline))
            try:
                response = _answer(conn, deadline)
                raw = response.read(MAX_ANSWER_BYTES + 1)
                if len(raw) <= MAX_ANSWER_BYTES and response.length:
                    # The host closed before its Content-Length (a read with a size does
                    # not say so itself): a cut answer is no answer.
                    raise http.client.IncompleteRead(raw, response.length)
            except ValueError as exc:  # http.client lets a malformed chunk size through
                raise http.client.HTTPException(f"malformed answer: {exc}") from None
        except BaseException:
            conn.close()
            raise
        if response.isclosed() and not response.will_close:
            self._give_back(conn)  # the whole answer was read, and the host keeps it open
        else:
            conn.close()  # an answer left unread (over the limit), or the host closes it
        return response.status, raw


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("no whole answer before the call's deadline")
    return left


class _DeadlineReader(io.RawIOBase):
    """The answer's bytes as http.client reads them, each read given only what is left of
    the call's deadline (a socket's own timeout is per read). It reads through the socket's
    own unbuffered file, which holds a reference to the socket: http.client closes the
    connection as soon as an answer that ends it (`Connection: close`) has its headers, and
    the body is still read from here."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.deadline = sock, deadline
        self.raw = sock.makefile("rb", buffering=0)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        self.sock.settimeout(_remaining(self.deadline))
        return self.raw.readinto(buffer) or 0  # None only for a non-blocking socket

    def close(self) -> None:
        self.raw.close()
        super().close()


class _DeadlineSocket:
    """What http.client's response reads from: the connection's socket, read under a
    deadline."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.deadline = sock, deadline

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self.sock, self.deadline))


def _answer(conn: http.client.HTTPConnection, deadline: float) -> http.client.HTTPResponse:
    """conn.getresponse(), its every read bounded by the deadline."""

    def response(sock, *args, **kwargs) -> http.client.HTTPResponse:
        return http.client.HTTPResponse(_DeadlineSocket(sock, deadline), *args, **kwargs)  # type: ignore[arg-type]

    conn.response_class = response  # type: ignore[assignment]
    return conn.getresponse()


def _close_all(connections: list[http.client.HTTPConnection]) -> None:
    for conn in connections:
        conn.close()


def _dropped(conn: http.client.HTTPConnection) -> bool:
    """Whether an idle keep-alive connection was closed by the host (or sent something
    unasked): either way its socket reads as ready, and it is not to be used."""
    if conn.sock is None:
        return True
    poller = select.poll()
    poller.register(conn.sock, select.POLLIN)
    return bool(poller.poll(0))

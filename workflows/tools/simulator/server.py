"""The simulator on a real socket: the runtime protocol and the `/sim/` control endpoints,
both behind the bearer token (docs/protocol.md)."""

import hmac
import json
import logging
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote

from .calls import SESSION_PATH
from .sessions import SimError
from .state import Reporter, Simulator

log = logging.getLogger(__name__)


def bearer_matches(header: str | None, token: str | None) -> bool:
    """Whether an Authorization header carries the token (always, when no token is set).
    Compared in constant time, so the answer's timing tells nothing about the token."""
    if not token:
        return True
    expected = f"Bearer {token}".encode()
    return hmac.compare_digest((header or "").encode("utf-8", "replace"), expected)


def make_handler(sim: Simulator, token: str | None):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self):
            super().setup()
            # Headers and body go out as separate writes; without TCP_NODELAY the second
            # waits for the peer's delayed ACK (~40 ms per call).
            self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def log_message(self, fmt, *args):  # quiet: the demo prints its own timeline
            log.debug("runtime-sim: " + fmt, *args)

        def _send(self, status: int, payload: dict, protocol: bool = False) -> None:
            data = json.dumps(payload).encode()
            trickle_ms = sim.faults.trickle_ms if protocol else 0  # never the /sim/ endpoints'
            if trickle_ms:
                # A host that trickles: the whole answer, one byte every trickle_ms.
                head = (
                    f"HTTP/1.1 {status} {self.responses.get(status, ('',))[0]}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
                ).encode()
                try:
                    for i in range(len(head + data)):
                        self.wfile.write((head + data)[i : i + 1])
                        self.wfile.flush()
                        time.sleep(trickle_ms / 1000)
                except OSError:  # the caller gave up
                    self.close_connection = True
                return
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> dict:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            return json.loads(raw) if raw else {}

        def _dispatch(self, method: str) -> None:
            try:
                # Every path needs the token, the control endpoints under /sim/ included:
                # they can take sessions offline and list every effect.
                if not bearer_matches(self.headers.get("Authorization"), token):
                    return self._send(401, {"error": "unauthorized"})
                body = self._body() if method == "POST" else {}
                path, _, query = self.path.partition("?")
                if path.startswith("/sim/"):
                    if method == "GET":
                        params = parse_qs(query)
                        since = params.get("since", ["0"])[0]
                        wait_s = params.get("wait_s", ["0"])[0]
                        result = sim.snapshot(path, int(since), float(wait_s))
                    else:
                        result = sim.control(path, body)
                    return self._send(200, result)
                match = SESSION_PATH.match(path)
                reads = match and (
                    match[3] in ("liveness", "state")
                    or (match[3].startswith("maintenance/") and not match[3].endswith("/cancel"))
                )
                expected = "GET" if reads else "POST"
                if not match or method != expected:
                    return self._send(404, {"error": "not_found"})
                answer = sim.handle(match[3], unquote(match[1]), unquote(match[2]), body)
                self._send(200, answer, protocol=True)
            except SimError as exc:
                self._send(exc.status, {"error": exc.code, **exc.extra})
            except (ValueError, KeyError, TypeError) as exc:
                self._send(422, {"error": "rejected", "detail": f"bad request: {exc}"})

        def do_GET(self):
            self._dispatch("GET")

        def do_POST(self):
            self._dispatch("POST")

    return Handler


# How often the serving loop looks for a stop request: `stop()` waits up to this long
# (socketserver's default, half a second, is paid by every stop: every test's teardown).
STOP_POLL_S = 0.05


class _Server(ThreadingHTTPServer):
    # A worker calls the runtime for a whole dispatch step at once (up to 32 connections
    # per worker process); socketserver's default listen backlog of 5 would reset some.
    request_queue_size = 256
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        # A caller that gave up (its deadline passed) before its answer went out: one debug
        # line, where socketserver would print a traceback for every such call.
        if isinstance(sys.exc_info()[1], ConnectionError):
            log.debug("runtime-sim: a caller at %s left before its answer", client_address[0])
            return
        super().handle_error(request, client_address)


class SimServer:
    """The simulator on a real socket, in a background thread (or in the foreground)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 8765,
        token: str | None = None,
        reporter: Reporter | None = None,
        host_id: str = "default",
    ) -> None:
        self.sim = Simulator(reporter, host_id, token)
        self.httpd = _Server((host, port), make_handler(self.sim, token))
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "SimServer":
        self.thread = threading.Thread(target=self.serve_forever, daemon=True, name="runtime-sim")
        self.thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=STOP_POLL_S)

    def stop(self) -> None:
        """Stop serving and reporting (after this the reporter may be closed)."""
        self.httpd.shutdown()
        self.httpd.server_close()
        self.sim.close()

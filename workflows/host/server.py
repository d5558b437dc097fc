"""The protocol's server side on a real socket (docs/protocol.md): every call's path and method,
its bearer token, its JSON body (at most MAX_BODY_BYTES), and its answer or refusal. What a
call does is the handler's: `handle(call, workspace_id, session_id, body)`, where `call` is
the path after the session (`goal`, `turns/t%2D1/cancel`, …; `item_of` decodes the id in
it); it returns the answer, or raises HostError. Paths outside the protocol go to
`extra(method, path, query, body)` when given (the simulator's `/sim/` endpoints), else 404.

The simulator (workflows/tools/simulator) and hosts built on the kit (host/agent_host.py)
serve through this."""

import hmac
import json
import logging
import re
import socket
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote

log = logging.getLogger(__name__)

SESSION_PATH = re.compile(
    r"^/v1/workspaces/([^/]+)/sessions/([^/]+)/(liveness|state|resume|goal|goal-fences|prompts"
    r"|turns/[^/]+/cancel|maintenance|maintenance/[^/]+|maintenance/[^/]+/cancel)$"
)
# A request body past this is refused unread (every call's body is a small JSON object).
MAX_BODY_BYTES = 1 << 20
# How often the serving loop looks for a stop request: `stop()` waits up to this long
# (socketserver's default, half a second, is paid by every stop: every test's teardown).
STOP_POLL_S = 0.05


class HostError(Exception):
    """A refusal (docs/protocol.md: errors): its HTTP status, its code, more fields."""

    def __init__(self, status: int, code: str, **extra: Any) -> None:
        super().__init__(code)
        self.status, self.code, self.extra = status, code, extra


Handle = Callable[[str, str, str, dict], dict]
Extra = Callable[[str, str, str, dict], tuple[int, dict]]


def bearer_matches(header: str | None, token: str | None) -> bool:
    """Whether an Authorization header carries the token (always, when no token is set).
    Compared in constant time, so the answer's timing tells nothing about the token."""
    if not token:
        return True
    expected = f"Bearer {token}".encode()
    return hmac.compare_digest((header or "").encode("utf-8", "replace"), expected)


def item_of(call: str) -> str:
    """The turn or run id a call names (`turns/{turn_id}/cancel`, `maintenance/{run_id}…`)."""
    return unquote(call.split("/")[1])


def method_of(call: str) -> str:
    """The method a call takes: reads are GETs (liveness, state, a run's status)."""
    reads = call in ("liveness", "state") or (
        call.startswith("maintenance/") and not call.endswith("/cancel")
    )
    return "GET" if reads else "POST"


def make_handler(
    handle: Handle,
    token: str | None,
    extra: Extra | None = None,
    send_answer: Callable[[Any, int, bytes], bool] | None = None,
):
    """The request handler class. `send_answer(handler, status, data)` may write a protocol
    answer itself (the simulator's trickle) and return True."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self):
            super().setup()
            # Headers and body go out as separate writes; without TCP_NODELAY the second
            # waits for the peer's delayed ACK (~40 ms per call).
            self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def log_message(self, fmt, *args):
            log.debug("agent host: " + fmt, *args)

        def _send(self, status: int, payload: dict, protocol: bool = False) -> None:
            data = json.dumps(payload).encode()
            if protocol and send_answer is not None and send_answer(self, status, data):
                return
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> dict:
            given = self.headers.get("Content-Length") or "0"
            if not given.isdigit() or int(given) > MAX_BODY_BYTES:
                self.close_connection = True  # the rest of the body is not read
                raise HostError(413, "rejected", detail="a body of 0 to 1 MiB is due")
            raw = self.rfile.read(int(given)) if int(given) else b""
            try:
                body = json.loads(raw) if raw else {}
            except (ValueError, RecursionError):
                raise HostError(422, "rejected", detail="the body is not JSON") from None
            if not isinstance(body, dict):
                raise HostError(422, "rejected", detail="the body is not a JSON object")
            return body

        def _dispatch(self, method: str) -> None:
            try:
                # Every path needs the token, a host's own endpoints included.
                if not bearer_matches(self.headers.get("Authorization"), token):
                    return self._send(401, {"error": "unauthorized"})
                body = self._body() if method == "POST" else {}
                path, _, query = self.path.partition("?")
                match = SESSION_PATH.match(path)
                if match is None:
                    if extra is None:
                        return self._send(404, {"error": "not_found"})
                    return self._send(*extra(method, path, query, body))
                if method != method_of(match[3]):
                    return self._send(404, {"error": "not_found"})
                answer = handle(match[3], unquote(match[1]), unquote(match[2]), body)
                self._send(200, answer, protocol=True)
            except HostError as exc:
                self._send(exc.status, {"error": exc.code, **exc.extra})
            except (ValueError, KeyError, TypeError) as exc:
                # The simulator reads bodies as it goes: what it cannot read is refused.
                self._send(422, {"error": "rejected", "detail": f"bad request: {exc}"})
            except Exception:  # noqa: BLE001 - any other failure: a retryable answer
                log.exception("agent host: a call failed")
                self._send(500, {"error": "server_error"})

        def do_GET(self):
            self._dispatch("GET")

        def do_POST(self):
            self._dispatch("POST")

    return Handler


class _Server(ThreadingHTTPServer):
    # A worker calls the runtime for a whole dispatch step at once (up to 32 connections
    # per worker process); socketserver's default listen backlog of 5 would reset some.
    request_queue_size = 256
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        # A caller that gave up (its deadline passed) before its answer went out: one debug
        # line, where socketserver would print a traceback for every such call.
        if isinstance(sys.exc_info()[1], ConnectionError):
            log.debug("agent host: a caller at %s left before its answer", client_address[0])
            return
        super().handle_error(request, client_address)


class HostServer:
    """A host's calls on a real socket, served in a background thread (`start`) or in the
    foreground (`serve_forever`)."""

    def __init__(
        self,
        handle: Handle,
        host: str = "127.0.0.1",
        port: int = 8765,
        token: str | None = None,
        extra: Extra | None = None,
        send_answer: Callable[[Any, int, bytes], bool] | None = None,
    ) -> None:
        self.httpd = _Server((host, port), make_handler(handle, token, extra, send_answer))
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self, name: str = "agent-host") -> "HostServer":
        self.thread = threading.Thread(target=self.serve_forever, daemon=True, name=name)
        self.thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=STOP_POLL_S)

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

"""The runtime port (DESIGN 6) and its HTTP adapter.

Rules talk to agent hosts only through `RuntimePort`; `HttpRuntime` speaks the JSON protocol.
Every failure becomes RuntimeDisconnected (the session is known offline) or RuntimeFault with
`code`, `http_status` and `retryable`.

An agent host's answer is untrusted: one that is not a JSON object of the documented shape, or
is larger than MAX_ANSWER_BYTES, is a retryable `bad_response` fault for that one call
(DESIGN 6), so one misbehaving host never breaks a step that serves other sessions. Values
that the rules store are checked again where they are stored (validation.check_json …).
"""

import http.client
import io
import json
import re
import select
import socket
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol, cast
from urllib.parse import quote, urlsplit

from workflows.adapters import metrics
from workflows.adapters.config import DEFAULT_HOST_CONCURRENCY
from workflows.errors import InvalidArgument, RuntimeDisconnected, RuntimeFault
from workflows.validation import MAX_INT, check_id, check_json_object, check_url

# Error codes of the protocol (DESIGN 6) that callers act on by name.
SESSION_NOT_FOUND = "session_not_found"  # the host no longer has the session: it is gone
NOT_FOUND = "not_found"  # the host does not know what was asked of it (a turn, a run)
STALE_REVISION = "stale_revision"  # the host has applied a newer revision
# Runtime answers that a goal dispatch retries with backoff; everything else is final.
RETRYABLE_CODES = frozenset(
    {
        "disconnected",
        SESSION_NOT_FOUND,
        "timeout",
        "unreachable",
        "server_error",
        "busy",
        "bad_response",
    }
)
# DESIGN 6: a larger answer is a bad_response.
MAX_ANSWER_BYTES = 1024 * 1024
# An error code is a short word; an error detail is kept (in last_error) only this long.
ERROR_CODE = re.compile(r"[a-z][a-z0-9_]{0,63}")
MAX_DETAIL_CHARS = 300


JSON_TYPE_NAMES = {
    type(None): "null",
    list: "array",
    str: "string",
    int: "number",
    float: "number",
    bool: "boolean",
}


def bad_response(why: str, http_status: int | None = 200) -> RuntimeFault:
    return RuntimeFault(
        f"runtime answered {http_status} bad_response: {why}",
        code="bad_response",
        retryable=True,
        http_status=http_status,
    )


def _printable(text: Any) -> str:
    """Untrusted text made safe to log and store: printable, bounded."""
    return "".join(ch if ch.isprintable() else "?" for ch in str(text)[:MAX_DETAIL_CHARS])


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _is_epoch(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_INT


def _one_of(*choices: str) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, str) and v in choices


def _json_object_or_none(v: Any) -> bool:
    try:
        check_json_object("answer", v)
        return True
    except InvalidArgument:
        return False


def _is_id(v: Any) -> bool:
    return v is not None and _id_or_none(v)


def _id_or_none(v: Any) -> bool:
    try:
        return v is None or bool(check_id("answer", v))
    except InvalidArgument:
        return False


def shaped(
    answer: dict[str, Any],
    required: dict[str, Callable[[Any], bool]],
    optional: dict[str, Callable[[Any], bool]] | None = None,
) -> dict[str, Any]:
    """The answer if its documented fields have the documented types, else bad_response.
    Unknown fields are allowed (a newer host may add some) and ignored."""
    for name, ok in required.items():
        if name not in answer or not ok(answer[name]):
            raise bad_response(f"field {name!r} is missing or ill-typed")
    for name, ok in (optional or {}).items():
        if answer.get(name) is not None and not ok(answer[name]):
            raise bad_response(f"field {name!r} is ill-typed")
    return answer


class RuntimePort(Protocol):
    def on_host(self, host_id: str, url: str | None, token: str | None = None) -> "RuntimePort":
        """The port for one host (DESIGN 4.9), for a caller that already knows the session's
        host (url None: the host `default`) and its token."""
        ...

    def liveness(self, workspace_id: str, session_id: str) -> dict[str, Any]: ...

    def resume(
        self, workspace_id: str, session_id: str, fences: list[dict[str, Any]]
    ) -> dict[str, Any]: ...

    def apply_goal(
        self,
        workspace_id: str,
        session_id: str,
        *,
        operation_id: str,
        action: str,
        objective: str | None,
        revision: int,
        client_submit_id: str,
        require_live: bool,
    ) -> dict[str, Any]: ...

    def install_fence(
        self,
        workspace_id: str,
        session_id: str,
        *,
        target_operation_id: str,
        target_revision: int,
        require_live: bool,
    ) -> dict[str, Any]: ...

    def cancel_turn(
        self,
        workspace_id: str,
        session_id: str,
        turn_id: str,
        *,
        operation_id: str,
        reason: str,
        require_live: bool,
    ) -> dict[str, Any]: ...

    def start_maintenance(
        self, workspace_id: str, session_id: str, *, run_id: str, kind: str, args: dict | None
    ) -> dict[str, Any]: ...

    def maintenance_status(
        self, workspace_id: str, session_id: str, run_id: str
    ) -> dict[str, Any]: ...

    def cancel_maintenance(
        self, workspace_id: str, session_id: str, run_id: str
    ) -> dict[str, Any]: ...

    def submit_prompt(
        self, workspace_id: str, session_id: str, *, prompt_id: str, text: str
    ) -> dict[str, Any]: ...


def session_path(workspace_id: str, session_id: str) -> str:
    return f"/v1/workspaces/{quote(workspace_id, safe='')}/sessions/{quote(session_id, safe='')}"


class HostConnections:
    """Keep-alive HTTP/1.1 connections to one agent host, shared by the threads of a step.

    Built on the standard library's `http.client`: a goal call through urllib3 cost twice
    the CPU (0.52–0.58 ms against 0.28 ms a call, measured on this protocol's requests), and
    a step makes one call per session. A connection goes back to the idle set only after
    its whole answer was read; one the host closed while idle is noticed (it reads as
    ready) and replaced before use, as urllib3 does. `connect_s` bounds the connection;
    `total_s` the whole call, connection, request and every byte of the answer (a host that
    trickles its answer a byte at a time is cut there, not `total_s` per byte). No call is
    retried here: a failure is the caller's to classify (DESIGN 6)."""

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


class HttpRuntime:
    # Connections kept open to the runtime: a dispatch step calls it for up to 32 sessions
    # at once (goals.statements.MAX_LANES_PER_STEP).
    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        timeout_s: float = 10.0,
        pool_size: int = 32,
        host_id: str = "default",
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.host_id = host_id  # the metrics' host label
        self.timeout_s = timeout_s  # a whole call
        self.http = HostConnections(self.base_url, min(timeout_s, 3.0), timeout_s, pool_size)
        self.headers = {"Content-Type": "application/json"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"

    def on_host(self, host_id: str, url: str | None, token: str | None = None) -> "HttpRuntime":
        """One adapter is one host: a caller that uses it alone (the tools, the tests) has
        every session at that host."""
        return self

    def request(
        self, method: str, path: str, body: dict[str, Any] | None = None, call: str = "other"
    ) -> dict[str, Any]:
        """One call, timed and counted by host and call (`call` is the protocol call's name)."""
        started = time.perf_counter()
        try:
            return self._request(method, path, body)
        except (RuntimeFault, RuntimeDisconnected) as exc:
            metrics.RUNTIME_CALL_ERRORS.labels(self.host_id, call, exc.code).inc()
            raise
        finally:
            metrics.RUNTIME_CALL_SECONDS.labels(self.host_id, call).observe(
                time.perf_counter() - started
            )

    def _request(
        self, method: str, path: str, body: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        try:
            status, raw = self.http.request(method, path, data, self.headers)
        except TimeoutError as exc:
            raise RuntimeFault(
                f"runtime timed out: {exc or 'no answer in time'}",
                code="timeout",
                retryable=True,
                http_status=None,
            ) from None
        except (OSError, http.client.HTTPException) as exc:
            why = _printable(f"{exc.__class__.__name__}: {exc}")
            raise RuntimeFault(
                f"runtime unreachable: {why}", code="unreachable", retryable=True, http_status=None
            ) from None
        return self._decode(status, raw)

    @staticmethod
    def _decode(status: int, raw: bytes) -> dict[str, Any]:
        if len(raw) > MAX_ANSWER_BYTES:
            raise bad_response(f"the answer is over {MAX_ANSWER_BYTES} bytes", status)
        try:
            payload = json.loads(raw or b"{}")
        except (ValueError, RecursionError):
            if 200 <= status < 300:
                raise bad_response("the answer is not JSON", status) from None
            payload = {}
        if not isinstance(payload, dict):
            if 200 <= status < 300:
                raise bad_response(
                    f"the answer is a JSON {JSON_TYPE_NAMES[type(payload)]}, not an object", status
                )
            payload = {}
        if 200 <= status < 300:
            return payload
        code = payload.get("error")
        if not isinstance(code, str) or not ERROR_CODE.fullmatch(code):
            code = "bad_response"  # errors are {"error": code, ...}; anything else is not
        if status >= 500:
            code = "server_error"
        if code == "disconnected":
            raise RuntimeDisconnected(
                "the session is offline at the agent host", http_status=status
            )
        detail = payload.get("detail")
        current = payload.get("current_revision")
        raise RuntimeFault(
            f"runtime answered {status} {code}" + (f": {_printable(detail)}" if detail else ""),
            code=code,
            retryable=code in RETRYABLE_CODES,
            http_status=status,
            current_revision=current if _is_epoch(current) else None,
        )

    def liveness(self, workspace_id, session_id):
        return shaped(
            self.request(
                "GET", session_path(workspace_id, session_id) + "/liveness", call="liveness"
            ),
            {"live": _is_bool},
            {"runtime_epoch": _is_epoch},
        )

    def resume(self, workspace_id, session_id, fences):
        return shaped(
            self.request(
                "POST",
                session_path(workspace_id, session_id) + "/resume",
                {"fences": fences},
                call="resume",
            ),
            {},
            {"live": _is_bool, "runtime_epoch": _is_epoch},
        )

    def apply_goal(
        self,
        workspace_id,
        session_id,
        *,
        operation_id,
        action,
        objective,
        revision,
        client_submit_id,
        require_live,
    ):
        return shaped(
            self.request(
                "POST",
                session_path(workspace_id, session_id) + "/goal",
                {
                    "operation_id": operation_id,
                    "action": action,
                    "objective": objective,
                    "revision": revision,
                    "client_submit_id": client_submit_id,
                    "require_live": require_live,
                },
                call="goal",
            ),
            {"phase": _one_of("applied", "accepted")},
            {"goal": _json_object_or_none, "evidence": _json_object_or_none},
        )

    def install_fence(
        self, workspace_id, session_id, *, target_operation_id, target_revision, require_live
    ):
        return self.request(
            "POST",
            session_path(workspace_id, session_id) + "/goal-fences",
            {
                "target_operation_id": target_operation_id,
                "target_revision": target_revision,
                "require_live": require_live,
            },
            call="goal_fence",
        )

    def cancel_turn(self, workspace_id, session_id, turn_id, *, operation_id, reason, require_live):
        path = f"{session_path(workspace_id, session_id)}/turns/{quote(turn_id, safe='')}/cancel"
        return shaped(
            self.request(
                "POST",
                path,
                {"operation_id": operation_id, "reason": reason, "require_live": require_live},
                call="turn_cancel",
            ),
            {"result": _one_of("canceled", "already_settled", "accepted")},
        )

    def start_maintenance(self, workspace_id, session_id, *, run_id, kind, args):
        return self.request(
            "POST",
            session_path(workspace_id, session_id) + "/maintenance",
            {"run_id": run_id, "kind": kind, "args": args},
            call="maintenance_start",
        )

    def maintenance_status(self, workspace_id, session_id, run_id):
        # Only the state is checked here; the outcome's values are checked where they are
        # stored (maintenance.terminal_for), so an unstorable outcome ends the run `failed`
        # instead of being asked for again forever.
        return shaped(
            self.request(
                "GET",
                f"{session_path(workspace_id, session_id)}/maintenance/{quote(run_id, safe='')}",
                call="maintenance_status",
            ),
            {"state": _one_of("running", "done")},
        )

    def cancel_maintenance(self, workspace_id, session_id, run_id):
        return self.request(
            "POST",
            f"{session_path(workspace_id, session_id)}/maintenance/{quote(run_id, safe='')}/cancel",
            {},
            call="maintenance_cancel",
        )

    def submit_prompt(self, workspace_id, session_id, *, prompt_id, text):
        return shaped(
            self.request(
                "POST",
                session_path(workspace_id, session_id) + "/prompts",
                {"prompt_id": prompt_id, "text": text},
                call="prompt",
            ),
            # The turn it started (DESIGN 6): without one nothing would ever settle the
            # prompt, so an answer without it is a bad_response that spends budget.
            {"turn_id": _is_id},
        )


# Where a session's runtime calls go: (host_id, url, token), url None for the host `default`
# (or for a host that is no longer registered), token that host's own.
Locate = Callable[[str, str], tuple[str, str | None, str | None]]


class HostRouter:
    """The runtime port for a fleet of agent hosts (DESIGN 4.9): each call goes to the host
    its session is bound to, found by `locate` at the time of the call. Each host has its own
    HttpRuntime and so its own connection pool, so a slow host only ever holds connections
    of its own; every call has the per-call timeouts of HttpRuntime."""

    def __init__(
        self,
        default_url: str,
        locate: Locate,
        token: str | None = None,
        timeout_s: float = 10.0,
        host_concurrency: int = DEFAULT_HOST_CONCURRENCY,
    ) -> None:
        self.locate = locate
        # Calls at once to one host from this process (workflows/goals/flight.py).
        self.host_concurrency = host_concurrency
        self.token = token
        self.timeout_s = timeout_s
        self.default = HttpRuntime(default_url, token, timeout_s, host_id="default")
        self._hosts: dict[tuple[str, str | None], HttpRuntime] = {}
        self._lock = threading.Lock()

    def on_host(self, host_id: str, url: str | None, token: str | None = None) -> "HttpRuntime":
        """The adapter for one host (url None: the host `default`), calling with that host's
        own token: AGENT_RADAR_RUNTIME_TOKEN goes to the host `default` only (DESIGN 4.9)."""
        if url is None:
            if host_id != "default":
                raise RuntimeFault(
                    f"host {host_id!r} is not registered", code="unknown_host", retryable=True
                )
            return self.default
        url = url.rstrip("/")
        with self._lock:
            runtime = self._hosts.get((url, token))
            if runtime is None:
                runtime = self._hosts[(url, token)] = HttpRuntime(
                    url, token, self.timeout_s, host_id=host_id
                )
            return runtime

    def for_session(self, workspace_id: str, session_id: str) -> "HttpRuntime":
        return self.on_host(*self.locate(workspace_id, session_id))

    def liveness(self, workspace_id, session_id):
        return self.for_session(workspace_id, session_id).liveness(workspace_id, session_id)

    def resume(self, workspace_id, session_id, fences):
        return self.for_session(workspace_id, session_id).resume(workspace_id, session_id, fences)

    def apply_goal(self, workspace_id, session_id, **call):
        return self.for_session(workspace_id, session_id).apply_goal(
            workspace_id, session_id, **call
        )

    def install_fence(self, workspace_id, session_id, **call):
        return self.for_session(workspace_id, session_id).install_fence(
            workspace_id, session_id, **call
        )

    def cancel_turn(self, workspace_id, session_id, turn_id, **call):
        return self.for_session(workspace_id, session_id).cancel_turn(
            workspace_id, session_id, turn_id, **call
        )

    def start_maintenance(self, workspace_id, session_id, **call):
        return self.for_session(workspace_id, session_id).start_maintenance(
            workspace_id, session_id, **call
        )

    def maintenance_status(self, workspace_id, session_id, run_id):
        return self.for_session(workspace_id, session_id).maintenance_status(
            workspace_id, session_id, run_id
        )

    def cancel_maintenance(self, workspace_id, session_id, run_id):
        return self.for_session(workspace_id, session_id).cancel_maintenance(
            workspace_id, session_id, run_id
        )

    def submit_prompt(self, workspace_id, session_id, **call):
        return self.for_session(workspace_id, session_id).submit_prompt(
            workspace_id, session_id, **call
        )

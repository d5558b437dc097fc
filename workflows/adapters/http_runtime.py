"""The runtime port's HTTP adapter (docs/protocol.md): `HttpRuntime` speaks the JSON protocol to one
host; `HostRouter` sends each session's calls to the host it lives on. Every failure becomes
RuntimeDisconnected (the session is known offline) or RuntimeFault with `code`,
`http_status` and `retryable`."""

import http.client
import json
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from urllib.parse import quote

from ...models.base import utcnow
from ..errors import RuntimeDisconnected, RuntimeFault
from . import metrics
from .answers import (
    ERROR_CODE,
    JSON_TYPE_NAMES,
    MAX_ANSWER_BYTES,
    HostState,
    bad_response,
    is_bool,
    is_epoch,
    is_id,
    json_object_or_none,
    one_of,
    parse_state,
    printable,
    shaped,
)
from .bulkhead import HostGate
from .config import DEFAULT_HOST_CONCURRENCY
from .http_transport import HostConnections
from .runtime import RETRYABLE_CODES, metric_code, session_path


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
        bulkhead: HostGate | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.host_id = host_id  # the metrics' host label, and its bulkhead's
        # Every call passes the host's bulkhead (bulkhead.py): the router's, shared by its
        # hosts, or this adapter's own when it is used alone.
        self.bulkhead = bulkhead or HostGate()
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
            with self.bulkhead.call(self.host_id, self.timeout_s):
                return self._request(method, path, body)
        except (RuntimeFault, RuntimeDisconnected) as exc:
            metrics.RUNTIME_CALL_ERRORS.labels(self.host_id, call, metric_code(exc.code)).inc()
            exc.asked_at = utcnow() - timedelta(seconds=time.perf_counter() - started)
            exc.answered_by = self.host_id
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
            why = printable(f"{exc.__class__.__name__}: {exc}")
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
            f"runtime answered {status} {code}" + (f": {printable(detail)}" if detail else ""),
            code=code,
            retryable=code in RETRYABLE_CODES,
            http_status=status,
            current_revision=current if is_epoch(current) else None,
        )

    def session_state(self, workspace_id, session_id) -> HostState:
        return parse_state(
            self.request("GET", session_path(workspace_id, session_id) + "/state", call="state")
        )

    def liveness(self, workspace_id, session_id):
        return shaped(
            self.request(
                "GET", session_path(workspace_id, session_id) + "/liveness", call="liveness"
            ),
            {"live": is_bool},
            {"runtime_epoch": is_epoch},
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
            {"live": is_bool, "runtime_epoch": is_epoch},
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
            {"phase": one_of("applied", "accepted")},
            {"goal": json_object_or_none, "evidence": json_object_or_none},
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
            {"result": one_of("canceled", "already_settled", "accepted")},
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
            {"state": one_of("running", "done")},
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
            # The turn it started (docs/protocol.md): without one nothing would ever settle the
            # prompt, so an answer without it is a bad_response that spends budget.
            {"turn_id": is_id},
        )


# Where a session's runtime calls go: (host_id, url, token), url None for the host `default`
# (or for a host that is no longer registered), token that host's own.
Locate = Callable[[str, str], tuple[str, str | None, str | None]]


class HostRouter:
    """The runtime port for a fleet of agent hosts (docs/lifecycles.md: sessions): each call goes to
    the host its session is bound to, found by `locate` at the time of the call. Each host has its
    own HttpRuntime and so its own connection pool, so a slow host only ever holds connections of
    its own; every call has the per-call timeouts of HttpRuntime."""

    def __init__(
        self,
        default_url: str,
        locate: Locate,
        token: str | None = None,
        timeout_s: float = 10.0,
        host_concurrency: int = DEFAULT_HOST_CONCURRENCY,
    ) -> None:
        self.locate = locate
        self.token = token
        self.timeout_s = timeout_s
        # This port's bulkhead: every host's slots and circuit in this process (bulkhead.py).
        self.bulkhead = HostGate(host_concurrency)
        self.default = HttpRuntime(
            default_url, token, timeout_s, host_id="default", bulkhead=self.bulkhead
        )
        # Per host id (its bulkhead's and its metrics' name), URL and token.
        self._hosts: dict[tuple[str, str, str | None], HttpRuntime] = {}
        self._lock = threading.Lock()

    def on_host(self, host_id: str, url: str | None, token: str | None = None) -> "HttpRuntime":
        """The adapter for one host (url None: the host `default`), calling with that host's own
        token: AGENT_RADAR_RUNTIME_TOKEN goes to the host `default` only (docs/lifecycles.md:
        sessions)."""
        if url is None:
            if host_id != "default":
                raise RuntimeFault(
                    f"host {host_id!r} is not registered", code="unknown_host", retryable=True
                )
            return self.default
        url = url.rstrip("/")
        with self._lock:
            runtime = self._hosts.get((host_id, url, token))
            if runtime is None:
                runtime = self._hosts[(host_id, url, token)] = HttpRuntime(
                    url, token, self.timeout_s, host_id=host_id, bulkhead=self.bulkhead
                )
            return runtime

    def for_session(self, workspace_id: str, session_id: str) -> "HttpRuntime":
        return self.on_host(*self.locate(workspace_id, session_id))

    def liveness(self, workspace_id, session_id):
        return self.for_session(workspace_id, session_id).liveness(workspace_id, session_id)

    def session_state(self, workspace_id, session_id) -> HostState:
        return self.for_session(workspace_id, session_id).session_state(workspace_id, session_id)

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

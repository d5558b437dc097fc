"""The runtime port (DESIGN 6) and its HTTP adapter.

Rules talk to agent hosts only through `RuntimePort`; `HttpRuntime` speaks the JSON protocol.
Every failure becomes RuntimeDisconnected (the session is known offline) or RuntimeFault with
`code`, `http_status` and `retryable`.
"""

import json
from typing import Any, Protocol
from urllib.parse import quote

import urllib3

from workflows.errors import RuntimeDisconnected, RuntimeFault

# Runtime answers that a goal dispatch retries with backoff; everything else is final.
RETRYABLE_CODES = frozenset({"disconnected", "session_not_found", "timeout", "unreachable",
                             "server_error", "busy"})


class RuntimePort(Protocol):
    def liveness(self, workspace_id: str, session_id: str) -> dict[str, Any]: ...

    def resume(self, workspace_id: str, session_id: str,
               fences: list[dict[str, Any]]) -> dict[str, Any]: ...

    def apply_goal(self, workspace_id: str, session_id: str, *, operation_id: str, action: str,
                   objective: str | None, revision: int, client_submit_id: str,
                   require_live: bool) -> dict[str, Any]: ...

    def install_fence(self, workspace_id: str, session_id: str, *, target_operation_id: str,
                      target_revision: int, require_live: bool) -> dict[str, Any]: ...

    def cancel_turn(self, workspace_id: str, session_id: str, turn_id: str, *,
                    operation_id: str, reason: str, require_live: bool) -> dict[str, Any]: ...

    def start_maintenance(self, workspace_id: str, session_id: str, *, run_id: str, kind: str,
                          args: dict | None) -> dict[str, Any]: ...

    def maintenance_status(self, workspace_id: str, session_id: str,
                           run_id: str) -> dict[str, Any]: ...

    def cancel_maintenance(self, workspace_id: str, session_id: str,
                           run_id: str) -> dict[str, Any]: ...

    def submit_prompt(self, workspace_id: str, session_id: str, *, prompt_id: str,
                      text: str) -> dict[str, Any]: ...


def session_path(workspace_id: str, session_id: str) -> str:
    return f"/v1/workspaces/{quote(workspace_id, safe='')}/sessions/{quote(session_id, safe='')}"


class HttpRuntime:
    # Connections kept open to the runtime: a dispatch step calls it for up to 32 sessions
    # at once (goals.MAX_LANES_PER_STEP).
    def __init__(self, base_url: str, token: str | None = None, timeout_s: float = 10.0,
                 pool_size: int = 32) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = urllib3.Timeout(connect=min(timeout_s, 3.0), read=timeout_s)
        self.http = urllib3.PoolManager(maxsize=pool_size, retries=False)
        self.headers = {"Content-Type": "application/json"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"

    def request(self, method: str, path: str, body: dict[str, Any] | None = None
                ) -> dict[str, Any]:
        url = self.base_url + path
        data = None if body is None else json.dumps(body).encode()
        try:
            response = self.http.request(method, url, body=data, headers=self.headers,
                                         timeout=self.timeout)
        except urllib3.exceptions.TimeoutError as exc:
            raise RuntimeFault(f"runtime timed out: {exc}", code="timeout", retryable=True,
                               http_status=None) from None
        except urllib3.exceptions.HTTPError as exc:
            raise RuntimeFault(f"runtime unreachable: {exc}", code="unreachable",
                               retryable=True, http_status=None) from None
        return self._decode(response)

    @staticmethod
    def _decode(response) -> dict[str, Any]:
        try:
            payload = json.loads(response.data or b"{}")
        except ValueError:
            payload = {"error": "bad_response", "detail": response.data[:200].decode("latin-1")}
        if 200 <= response.status < 300:
            return payload
        code = payload.get("error") or ("server_error" if response.status >= 500 else "rejected")
        if response.status >= 500:
            code = "server_error"
        if code == "disconnected":
            raise RuntimeDisconnected("the session is offline at the agent host",
                                      http_status=response.status)
        raise RuntimeFault(
            f"runtime answered {response.status} {code}"
            + (f": {payload['detail']}" if payload.get("detail") else ""),
            code=code, retryable=code in RETRYABLE_CODES, http_status=response.status,
            current_revision=payload.get("current_revision"))

    def liveness(self, workspace_id, session_id):
        return self.request("GET", session_path(workspace_id, session_id) + "/liveness")

    def resume(self, workspace_id, session_id, fences):
        return self.request("POST", session_path(workspace_id, session_id) + "/resume",
                            {"fences": fences})

    def apply_goal(self, workspace_id, session_id, *, operation_id, action, objective, revision,
                   client_submit_id, require_live):
        return self.request("POST", session_path(workspace_id, session_id) + "/goal", {
            "operation_id": operation_id, "action": action, "objective": objective,
            "revision": revision, "client_submit_id": client_submit_id,
            "require_live": require_live})

    def install_fence(self, workspace_id, session_id, *, target_operation_id, target_revision,
                      require_live):
        return self.request("POST", session_path(workspace_id, session_id) + "/goal-fences", {
            "target_operation_id": target_operation_id, "target_revision": target_revision,
            "require_live": require_live})

    def cancel_turn(self, workspace_id, session_id, turn_id, *, operation_id, reason,
                    require_live):
        path = f"{session_path(workspace_id, session_id)}/turns/{quote(turn_id, safe='')}/cancel"
        return self.request("POST", path, {"operation_id": operation_id, "reason": reason,
                                           "require_live": require_live})

    def start_maintenance(self, workspace_id, session_id, *, run_id, kind, args):
        return self.request("POST", session_path(workspace_id, session_id) + "/maintenance",
                            {"run_id": run_id, "kind": kind, "args": args})

    def maintenance_status(self, workspace_id, session_id, run_id):
        return self.request("GET", f"{session_path(workspace_id, session_id)}/maintenance/"
                                   f"{quote(run_id, safe='')}")

    def cancel_maintenance(self, workspace_id, session_id, run_id):
        return self.request("POST", f"{session_path(workspace_id, session_id)}/maintenance/"
                                    f"{quote(run_id, safe='')}/cancel", {})

    def submit_prompt(self, workspace_id, session_id, *, prompt_id, text):
        return self.request("POST", session_path(workspace_id, session_id) + "/prompts",
                            {"prompt_id": prompt_id, "text": text})

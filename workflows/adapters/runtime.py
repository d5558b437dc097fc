"""The runtime port (docs/protocol.md): what steps ask of an agent host, and the protocol's error
codes.

Steps talk to agent hosts only through `RuntimePort`; `HttpRuntime` (http_runtime.py) speaks
the JSON protocol. Every failure becomes RuntimeDisconnected (the session is known offline)
or RuntimeFault with `code`, `http_status` and `retryable`.

An agent host's answer is untrusted (answers.py): one that is not a JSON object of the
documented shape, or is too large, is a retryable `bad_response` fault for that one call
(docs/protocol.md), so one misbehaving host never breaks a step that serves other sessions. Values
that the rules store are checked again where they are stored (validation.check_json …).
"""

from typing import Any, Protocol
from urllib.parse import quote

from .answers import HostState
from .bulkhead import HostGate

# Error codes of the protocol (docs/protocol.md) that callers act on by name.
SESSION_NOT_FOUND = "session_not_found"  # the host no longer has the session: it is gone
NOT_FOUND = "not_found"  # the host does not know what was asked of it (a turn, a run)
STALE_REVISION = "stale_revision"  # the host has applied a newer revision
BUSY = "busy"  # the host runs something that what was asked may not run beside
# Runtime answers that a goal dispatch retries with backoff; everything else is final.
RETRYABLE_CODES = frozenset(
    {
        "disconnected",
        SESSION_NOT_FOUND,
        "timeout",
        "unreachable",
        "server_error",
        BUSY,
        "bad_response",
    }
)


# The codes a metric's `code` label takes: the protocol's own and the adapter's; any other
# code a host answers (a final refusal of its own words) is counted as `other`, so a host
# cannot grow the series without bound.
METRIC_CODES = RETRYABLE_CODES | {NOT_FOUND, STALE_REVISION, "rejected", "unknown_host"}
OTHER_CODE = "other"


def metric_code(code: str) -> str:
    return code if code in METRIC_CODES else OTHER_CODE


class RuntimePort(Protocol):
    # Every host's slots and circuit in this process: every call passes it (bulkhead.py).
    bulkhead: HostGate

    def on_host(self, host_id: str, url: str | None, token: str | None = None) -> "RuntimePort":
        """The port for one host (docs/lifecycles.md: sessions), for a caller that already knows the
        session's host (url None: the host `default`) and its token."""
        ...

    def liveness(self, workspace_id: str, session_id: str) -> dict[str, Any]: ...

    def session_state(self, workspace_id: str, session_id: str) -> HostState:
        """What the host runs for the session (docs/protocol.md: session state)."""
        ...

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

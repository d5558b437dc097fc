"""The simulated agent (an `Agent` of the host kit, host/agent_host.py): its turns end after
the session's `turn_duration_ms`, its cancels as its `cancel_mode` says, its maintenance runs
after `maintenance_duration_ms` with `maintenance_outcome`, and it takes goals at once or,
with `goal_mode: accepted`, `apply_delay_ms` later. The host is the Simulator (state.py):
its settings per session and its timers."""

from typing import Any

from ...host.sessions import HostSession, Run, Turn

# What a finished run says of its work (docs/protocol.md: maintenance).
INPUT_TOKENS, RESULT_TOKENS, SUMMARY = 12000, 800, "conversation compacted"


class SimAgent:
    def takes_goal(self, host: Any, s: HostSession, goal: dict) -> bool:
        settings = host.settings_of(s.workspace_id, s.session_id)
        if settings.goal_mode != "accepted":
            return True
        ws, sid = s.workspace_id, s.session_id
        host.later(settings.apply_delay_ms, host.goal_applied, ws, sid, goal["operation_id"])
        return False

    def continues_goal(self, host: Any, s: HostSession, goal: dict) -> bool:
        return bool(host.settings_of(s.workspace_id, s.session_id).continuation_turns)

    def start_turn(self, host: Any, s: HostSession, turn: Turn) -> None:
        duration_ms = host.settings_of(s.workspace_id, s.session_id).turn_duration_ms
        if duration_ms:
            ws, sid = s.workspace_id, s.session_id
            host.later(duration_ms, host.settle, ws, sid, turn.turn_id, "completed")

    def cancel_turn(self, host: Any, s: HostSession, turn: Turn) -> bool:
        settings = host.settings_of(s.workspace_id, s.session_id)
        ws, sid = s.workspace_id, s.session_id
        if settings.cancel_mode == "immediate":
            return bool(host.settle(ws, sid, turn.turn_id, "canceled"))
        if settings.cancel_mode == "accepted":
            host.later(settings.cancel_delay_ms, host.settle, ws, sid, turn.turn_id, "canceled")
        return False

    def start_run(self, host: Any, s: HostSession, run: Run) -> None:
        settings = host.settings_of(s.workspace_id, s.session_id)
        outcome = settings.maintenance_outcome
        ws, sid = s.workspace_id, s.session_id
        if settings.maintenance_duration_ms:
            host.later(settings.maintenance_duration_ms, finish, host, ws, sid, run.run_id, outcome)
        else:
            finish(host, ws, sid, run.run_id, outcome)  # done before its status is asked

    def cancel_run(self, host: Any, s: HostSession, run: Run) -> None:
        if not host.settings_of(s.workspace_id, s.session_id).ignore_cancel:
            finish(host, s.workspace_id, s.session_id, run.run_id, "cancelled")


def finish(host: Any, ws: str, sid: str, run_id: str, outcome: str) -> None:
    """The run is done with `outcome` ("applied", "noop", "cancelled", "error:<text>")."""
    applied = outcome == "applied"
    host.finish(
        ws,
        sid,
        run_id,
        applied=applied,
        cancelled=outcome == "cancelled",
        error=outcome.split(":", 1)[1] if outcome.startswith("error:") else None,
        input_tokens=INPUT_TOKENS,
        result_tokens=RESULT_TOKENS if applied else None,
        summary=SUMMARY if applied else None,
    )

"""A session's turns at the simulated host: goal continuation turns, prompts' turns and
cancels, each settled and reported in its own time; and Host, what the calls need of it."""

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from .sessions import SimError, SimSession, SimTurn


class Host(Protocol):
    """What the calls need of the simulator (state.Simulator): its lock, its records and
    sessions, its timers and its reports."""

    lock: threading.RLock
    host_id: str
    turn_seq: int
    answers: dict[str, dict]
    effects: list[dict]

    def session(self, ws: str, sid: str) -> SimSession: ...

    def later(self, delay_ms: int, fn: Callable[..., object], *args: Any) -> None: ...

    def report(self, report: dict) -> None: ...


def _new_turn_id(host: Host, sess: SimSession) -> str:
    """A turn id this host never gave before, whatever its sessions did (they restart,
    leave and come back anew), as a real agent's UUIDs are. With `numbered_turns`, the
    session's process numbers its turns from 1 (again after a restart, and at each host):
    the control plane tells them apart by (host, epoch, turn id)."""
    if sess.numbered_turns:
        sess.turn_number += 1
        return f"turn-{sess.turn_number}"
    host.turn_seq += 1
    return f"turn-{host.host_id}-{host.turn_seq}"


def start_turn(
    host: Host, ws: str, sid: str, sess: SimSession, operation_id: str, revision: int
) -> None:
    turn = SimTurn(
        turn_id=_new_turn_id(host, sess),
        origin="goal_continuation",
        source_goal_operation_id=operation_id,
        source_goal_revision=revision,
    )
    sess.turns[turn.turn_id] = turn
    _report_turn_later(host, ws, sid, turn, sess.report_delay_ms)
    if sess.turn_duration_ms:
        host.later(sess.turn_duration_ms, _settle, host, ws, sid, turn.turn_id, "completed")


def _settle(host: Host, ws: str, sid: str, turn_id: str, outcome: str) -> None:
    with host.lock:
        turn = host.session(ws, sid).turns.get(turn_id)
        if turn is None or turn.phase == "settled":
            return
        turn.phase, turn.outcome = "settled", outcome
        host.effects.append(
            {
                "kind": "turn_settled",
                "workspace_id": ws,
                "session_id": sid,
                "turn_id": turn_id,
                "outcome": outcome,
                "at": time.time(),
            }
        )
    _report_turn_later(host, ws, sid, turn, 0)


def _report_turn_later(host: Host, ws: str, sid: str, turn: SimTurn, delay_ms: int) -> None:
    snapshot = {
        "turn_id": turn.turn_id,
        "phase": turn.phase,
        "outcome": turn.outcome,
        "origin": turn.origin,
        "source_goal_operation_id": turn.source_goal_operation_id,
        "source_goal_revision": turn.source_goal_revision,
        "prompt_id": turn.prompt_id,
    }
    host.later(
        delay_ms,
        host.report,
        {
            "workspace_id": ws,
            "session_id": sid,
            "occurred_at_ms": int(time.time() * 1000),
            # The process that ran the turn, whenever the report goes out.
            "session": {"host_id": host.host_id, "runtime_epoch": host.session(ws, sid).epoch},
            "turn": snapshot,
        },
    )


def prompt(host: Host, ws: str, sid: str, sess: SimSession, body: dict) -> dict:
    if not sess.live:
        raise SimError(409, "disconnected")
    prompt_id = body["prompt_id"]
    if prompt_id not in sess.prompt_turns:
        turn = SimTurn(
            turn_id=_new_turn_id(host, sess),
            origin="user_prompt",
            source_goal_operation_id=None,
            source_goal_revision=None,
            prompt_id=prompt_id,
        )
        sess.turns[turn.turn_id] = turn
        sess.prompt_turns[prompt_id] = turn.turn_id
        host.effects.append(
            {
                "kind": "prompt",
                "workspace_id": ws,
                "session_id": sid,
                "prompt_id": prompt_id,
                "turn_id": turn.turn_id,
                "text": body.get("text"),
                "at": time.time(),
            }
        )
        _report_turn_later(host, ws, sid, turn, 0)
        if sess.turn_duration_ms:
            host.later(sess.turn_duration_ms, _settle, host, ws, sid, turn.turn_id, "completed")
    return {"turn_id": sess.prompt_turns[prompt_id]}


def cancel_turn(host: Host, ws: str, sid: str, sess: SimSession, turn_id: str, body: dict) -> dict:
    if body.get("require_live") and not sess.live:
        raise SimError(409, "disconnected")
    op_id = body["operation_id"]
    if op_id in host.answers:
        return host.answers[op_id]
    turn = sess.turns.get(turn_id)
    if turn is None:
        raise SimError(404, "not_found")
    host.effects.append(
        {
            "kind": "cancel",
            "workspace_id": ws,
            "session_id": sid,
            "turn_id": turn_id,
            "operation_id": op_id,
            "at": time.time(),
        }
    )
    if turn.phase == "settled":
        answer = {"result": "already_settled"}
    elif sess.cancel_mode == "immediate":
        turn.phase, turn.outcome = "settled", "canceled"
        _report_turn_later(host, ws, sid, turn, 0)
        answer = {"result": "canceled"}
    else:
        if sess.cancel_mode == "accepted":
            host.later(sess.cancel_delay_ms, _settle, host, ws, sid, turn_id, "canceled")
        answer = {"result": "accepted"}
    host.answers[op_id] = answer
    return answer

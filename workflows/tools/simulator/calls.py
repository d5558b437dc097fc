"""The runtime protocol's calls as the simulated host answers them: liveness, the session's
state, resume, goals (applied at once or later), fences, prompts, turn cancels and maintenance
runs."""

import time

from ...host.server import item_of
from .sessions import SimError, SimRun, SimSession
from .turns import Host, cancel_turn, prompt, start_turn


def answer_call(host: Host, call: str, ws: str, sid: str, body: dict) -> dict:
    with host.lock:
        sess = host.session(ws, sid)
        if sess.missing:
            raise SimError(404, "session_not_found")
        if call == "liveness":
            return {"live": sess.live, "runtime_epoch": sess.epoch}
        if call == "state":
            return _state(sess)
        if call == "resume":
            return _resume(host, ws, sid, sess, body)
        if call == "goal-fences":
            return _install_fence(host, ws, sid, sess, body)
        if call.startswith("turns/"):
            return cancel_turn(host, ws, sid, sess, item_of(call), body)
        if call == "prompts":
            return prompt(host, ws, sid, sess, body)
        if call.startswith("maintenance"):
            return _maintenance(host, ws, sid, sess, call.split("/"), body)
        return _goal(host, ws, sid, sess, body)


def _state(sess: SimSession) -> dict:
    """What this host runs for the session (docs/protocol.md: session state). Its turns and
    runs are all of its current epoch: a restart or a resume forgets the old ones."""
    goal = None
    if sess.applied_operation_id is not None:
        goal = {
            "operation_id": sess.applied_operation_id,
            "revision": sess.applied_revision,
            "objective": (sess.goal or {}).get("objective"),
            "status": (sess.goal or {}).get("status"),
        }
    now = time.time()
    running = next((run for run in sess.runs.values() if now < run.done_at), None)
    return {
        "live": sess.live,
        "runtime_epoch": sess.epoch,
        "goal": goal,
        "fences": [
            {"target_operation_id": op, "target_revision": rev} for op, rev in sorted(sess.fences)
        ],
        "turns": [
            {
                "turn_id": t.turn_id,
                "phase": t.phase,
                "runtime_epoch": sess.epoch,
                "origin": t.origin,
                "source_goal_operation_id": t.source_goal_operation_id,
                "source_goal_revision": t.source_goal_revision,
                "prompt_id": t.prompt_id,
            }
            for t in sess.turns.values()
            if t.phase != "settled"
        ],
        "maintenance": None if running is None else {"run_id": running.run_id, "state": "running"},
    }


def _resume(host: Host, ws: str, sid: str, sess: SimSession, body: dict) -> dict:
    fences = body.get("fences") or []
    if not sess.live:
        # A new provider process (a new epoch): what the old one ran ended with it, and
        # it holds the fences it was given, no others.
        sess.live = True
        sess.epoch += 1
        sess.fences, sess.turns, sess.runs, sess.prompt_turns = set(), {}, {}, {}
        host.effects.append(
            {
                "kind": "resume",
                "workspace_id": ws,
                "session_id": sid,
                "fences": fences,
                "runtime_epoch": sess.epoch,
                "at": time.time(),
            }
        )
    sess.fences |= {(f["target_operation_id"], f["target_revision"]) for f in fences}
    return {"live": True, "runtime_epoch": sess.epoch}


def _goal(host: Host, ws: str, sid: str, sess: SimSession, body: dict) -> dict:
    op_id, revision = body["operation_id"], int(body["revision"])
    if not sess.live:
        raise SimError(409, "disconnected")
    if op_id in host.answers:
        return host.answers[op_id]  # a retry: same answer, no second effect
    if (op_id, revision) in sess.fences:
        raise SimError(422, "rejected", detail="fenced generation")
    if revision <= sess.applied_revision:
        raise SimError(409, "stale_revision", current_revision=sess.applied_revision)
    if sess.goal_mode == "accepted":
        answer = {"phase": "accepted", "goal": None, "evidence": {"acknowledged": True}}
        host.answers[op_id] = answer
        host.later(sess.apply_delay_ms, _apply_later, host, ws, sid, body)
        return answer
    goal = _apply(host, ws, sid, sess, body)
    answer = {"phase": "applied", "goal": goal, "evidence": {"applied_revision": revision}}
    host.answers[op_id] = answer
    return answer


def _apply(host: Host, ws: str, sid: str, sess: SimSession, body: dict) -> dict | None:
    action, revision = body["action"], int(body["revision"])
    if action == "set":
        sess.goal = {"objective": body["objective"], "status": "active"}
    elif action == "clear":
        sess.goal = None
    elif sess.goal is not None:
        sess.goal = {**sess.goal, "status": "paused" if action == "pause" else "active"}
    sess.applied_revision = revision
    sess.applied_operation_id = body["operation_id"]
    host.effects.append(
        {
            "kind": "goal",
            "workspace_id": ws,
            "session_id": sid,
            "operation_id": body["operation_id"],
            "action": action,
            "revision": revision,
            "objective": body.get("objective"),
            "at": time.time(),
        }
    )
    if action == "set" and sess.continuation_turns:
        start_turn(host, ws, sid, sess, body["operation_id"], revision)
    return sess.goal


def _maintenance(
    host: Host, ws: str, sid: str, sess: SimSession, parts: list[str], body: dict
) -> dict:
    if len(parts) == 1:  # start, idempotent by run_id
        if not sess.live:
            raise SimError(409, "disconnected")
        run_id = body["run_id"]
        if run_id not in sess.runs:
            sess.runs[run_id] = SimRun(
                run_id,
                time.time() + sess.maintenance_duration_ms / 1000,
                sess.maintenance_outcome,
            )
            host.effects.append(
                {
                    "kind": "maintenance",
                    "workspace_id": ws,
                    "session_id": sid,
                    "run_id": run_id,
                    "maintenance_kind": body.get("kind"),
                    "at": time.time(),
                }
            )
        return {"state": "running"}
    run = sess.runs.get(item_of("/".join(parts)))
    if run is None:
        raise SimError(404, "not_found")
    if len(parts) == 3:  # cancel
        if not sess.ignore_cancel and time.time() < run.done_at:
            run.cancelled, run.done_at = True, time.time()
        return {}
    if time.time() < run.done_at:
        return {"state": "running"}
    applied = run.outcome == "applied" and not run.cancelled
    error = run.outcome.split(":", 1)[1] if run.outcome.startswith("error:") else None
    cancelled = run.cancelled or run.outcome == "cancelled"  # the agent gave up by itself
    return {
        "state": "done",
        "applied": applied,
        "cancelled": cancelled,
        "error": None if run.cancelled else error,
        "input_tokens": 12000,
        "result_tokens": 800 if applied else None,
        "summary": "conversation compacted" if applied else None,
    }


def _install_fence(host: Host, ws: str, sid: str, sess: SimSession, body: dict) -> dict:
    if body.get("require_live") and not sess.live:
        raise SimError(409, "disconnected")
    fence = (body["target_operation_id"], int(body["target_revision"]))
    if fence not in sess.fences:
        sess.fences.add(fence)
        host.effects.append(
            {
                "kind": "fence",
                "workspace_id": ws,
                "session_id": sid,
                "target_operation_id": fence[0],
                "target_revision": fence[1],
                "at": time.time(),
            }
        )
    running = [
        t.turn_id
        for t in sess.turns.values()
        if t.phase != "settled" and (t.source_goal_operation_id, t.source_goal_revision) == fence
    ]
    return {"running_turns": running}


def _apply_later(host: Host, ws: str, sid: str, body: dict) -> None:
    with host.lock:
        sess = host.session(ws, sid)
        if int(body["revision"]) <= sess.applied_revision:
            return  # a newer revision got there first; this one is stale now
        goal = _apply(host, ws, sid, sess, body)
    host.report(
        {
            "workspace_id": ws,
            "session_id": sid,
            "occurred_at_ms": int(time.time() * 1000),
            "goal_applied": {
                "operation_id": body["operation_id"],
                "revision": int(body["revision"]),
                "goal": goal,
            },
        }
    )

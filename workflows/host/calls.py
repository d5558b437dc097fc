"""The protocol's calls as an AgentHost answers them (host/agent_host.py), each inside one
change of the session (`AgentHost._changing`; `host` is the AgentHost, typed loosely so
that this module need not import the one that imports it): the body checked first, then
the promises of docs/protocol.md — answers by key, revisions only forward, fences,
`require_live` — then the change, its effects and the agent's work to start."""

import logging
from dataclasses import asdict
from typing import Any

from .server import HostError
from .sessions import (
    MAX_TEXT_CHARS,
    REFUSED,
    RUN_RESULT,
    HostSession,
    Run,
    Turn,
    fences_of,
    int_of,
    maintenance_of,
    text_of,
)

log = logging.getLogger(__name__)
GOAL_ACTIONS = ("set", "clear", "pause", "resume")


def live(s: HostSession) -> None:
    if not s.live:
        raise HostError(409, "disconnected")


def state(host: Any, s: HostSession) -> dict:
    running = running_run(s)
    goal = s.goal or {"objective": None, "status": None}
    return {
        "live": s.live,
        "runtime_epoch": s.runtime_epoch,
        "goal": None
        if s.applied_operation_id is None
        else {"operation_id": s.applied_operation_id, "revision": s.revision, **goal},
        "fences": [{"target_operation_id": o, "target_revision": r} for o, r in s.fences],
        "turns": [
            {k: v for k, v in asdict(t).items() if k not in ("outcome", "text")}
            for t in s.turns.values()
            if t.phase != "settled"
        ],
        "maintenance": None if running is None else {"run_id": running.run_id, "state": "running"},
    }


def resume(host: Any, s: HostSession, body: dict) -> dict:
    given = fences_of(body)  # every one checked before any is held
    if not s.live:
        host._new_epoch(s)
        fences = [{"target_operation_id": o, "target_revision": r} for o, r in given]
        host._effect("resume", s, runtime_epoch=s.runtime_epoch, fences=fences)
    held = {(o, r) for o, r in s.fences}
    for o, r in given:
        if (o, r) not in held:
            held.add((o, r))
            s.fences.append([o, r])
    return {"live": True, "runtime_epoch": s.runtime_epoch}


def goal(host: Any, s: HostSession, body: dict) -> dict:
    op, revision = text_of(body, "operation_id"), int_of(body, "revision")
    action = text_of(body, "action")
    if action not in GOAL_ACTIONS:
        raise HostError(422, "rejected", detail=f"action must be one of {GOAL_ACTIONS}")
    objective = text_of(body, "objective", MAX_TEXT_CHARS) if action == "set" else None
    live(s)
    if op in host.answers:
        return host.answers[op]
    if s.fenced(op, revision):
        raise HostError(422, "rejected", detail="fenced generation")
    if revision <= s.revision:
        raise HostError(409, "stale_revision", current_revision=s.revision)
    one_at_a_time(s, "goal")
    wanted = {"operation_id": op, "action": action, "objective": objective, "revision": revision}
    if not getattr(host.agent, "takes_goal", lambda *a: True)(host, s, wanted):
        # The agent applies it later (`AgentHost.goal_applied`): accepted now, kept.
        s.pending_goals[op] = wanted
        accepted = {"phase": "accepted", "goal": None, "evidence": {"acknowledged": True}}
        return host._keep_answer(op, accepted)
    apply_goal(host, s, wanted)
    answer = {"phase": "applied", "goal": s.goal, "evidence": {"applied_revision": revision}}
    return host._keep_answer(op, answer)


def apply_goal(host: Any, s: HostSession, wanted: dict) -> None:
    """The goal revision takes effect: the session's goal, its effect, and for a set the
    turn that pursues it."""
    action, op, revision = wanted["action"], wanted["operation_id"], wanted["revision"]
    if action == "set":
        s.goal = {"objective": wanted["objective"], "status": "active"}
    elif action == "clear":
        s.goal = None
    elif s.goal is not None:
        s.goal = {**s.goal, "status": "paused" if action == "pause" else "active"}
    s.revision, s.applied_operation_id = revision, op
    objective = wanted["objective"]
    host._effect("goal", s, operation_id=op, action=action, revision=revision, objective=objective)
    if action == "set" and getattr(host.agent, "continues_goal", lambda *a: True)(host, s, wanted):
        start_turn(
            host, s, "goal_continuation", source_goal_operation_id=op, source_goal_revision=revision
        )


def fence(host: Any, s: HostSession, body: dict) -> dict:
    pair = [text_of(body, "target_operation_id"), int_of(body, "target_revision")]
    if body.get("require_live"):
        live(s)
    if pair not in s.fences:
        s.fences.append(pair)
        host._effect("fence", s, target_operation_id=pair[0], target_revision=pair[1])
    running = [
        t.turn_id
        for t in s.turns.values()
        if t.phase != "settled" and [t.source_goal_operation_id, t.source_goal_revision] == pair
    ]
    return {"running_turns": running}


def start_turn(host: Any, s: HostSession, origin: str, **provenance: Any) -> Turn:
    """The turn is recorded and reported with the call; the agent starts it once the
    call is saved. An agent that cannot start it ends it `failed`."""
    turn = Turn(host.new_turn_id(s), s.runtime_epoch, origin, **provenance)
    s.turns[turn.turn_id] = turn
    host._report_turn(s, turn)

    def start() -> None:
        try:
            host.agent.start_turn(host, s, turn)
        except Exception:  # noqa: BLE001 - the agent's failure ends its turn
            log.exception("agent host: the agent could not start turn %s", turn.turn_id)
            host.settle(s.workspace_id, s.session_id, turn.turn_id, "failed")

    host._change.starts.append(start)
    return turn


def running_run(s: HostSession) -> Run | None:
    return next((r for r in s.runs.values() if r.state == "running"), None)


def one_at_a_time(s: HostSession, starting: str) -> None:
    """A run or a prompt starts only on an idle session, and no goal lands beside a run
    (docs/protocol.md: one thing at a time): a call that comes late — after agent-radar gave
    up on it and let the session go to other work — is refused `409 busy`."""
    run = running_run(s)
    if run is not None:
        raise HostError(409, "busy", detail=f"maintenance run {run.run_id} runs")
    turn = next((t for t in s.turns.values() if t.phase != "settled"), None)
    if starting in ("run", "prompt") and turn is not None:
        raise HostError(409, "busy", detail=f"turn {turn.turn_id} runs")


def prompt(host: Any, s: HostSession, body: dict) -> dict:
    prompt_id = text_of(body, "prompt_id")
    text = text_of(body, "text", MAX_TEXT_CHARS)
    live(s)
    if prompt_id not in s.prompts:
        one_at_a_time(s, "prompt")
        turn = start_turn(host, s, "user_prompt", prompt_id=prompt_id, text=text)
        s.prompts[prompt_id] = turn.turn_id
        host._effect("prompt", s, prompt_id=prompt_id, turn_id=turn.turn_id, text=text)
    return {"turn_id": s.prompts[prompt_id]}


def cancel(host: Any, s: HostSession, turn_id: str, body: dict) -> dict:
    op = text_of(body, "operation_id")
    if body.get("require_live"):
        live(s)
    if op in host.answers:
        return host.answers[op]
    turn = s.turns.get(turn_id)
    if turn is None:
        raise HostError(404, "not_found")
    if turn.phase == "settled":
        answer = {"result": "already_settled"}
    else:
        host._effect("cancel", s, turn_id=turn_id, operation_id=op)
        ended = host.agent.cancel_turn(host, s, turn)
        if ended:  # ended now: settled, whether or not the agent said so itself
            host.settle(s.workspace_id, s.session_id, turn_id, "canceled")
        answer = {"result": "canceled" if ended else "accepted"}
    return host._keep_answer(op, answer)


def start_run(host: Any, s: HostSession, body: dict) -> dict:
    run_id, kind, args = maintenance_of(body)
    live(s)
    if run_id in s.runs and s.runs[run_id].state == REFUSED:
        raise HostError(422, "rejected", detail="the run was cancelled before it started")
    if run_id not in s.runs:
        one_at_a_time(s, "run")
        run = s.runs[run_id] = Run(run_id, kind, args)
        host._effect("maintenance", s, run_id=run_id, maintenance_kind=kind)

        def start() -> None:
            try:
                host.agent.start_run(host, s, run)
            except Exception:  # noqa: BLE001 - the agent's failure ends its run
                log.exception("agent host: the agent could not start run %s", run_id)
                host.finish(s.workspace_id, s.session_id, run_id, error="agent_failed")

        host._change.starts.append(start)
    return {"state": "running"}


def _run_of(s: HostSession, run_id: str) -> Run:
    run = s.runs.get(run_id)
    if run is None or run.state == REFUSED:
        raise HostError(404, "not_found")
    return run


def refuse_unknown_run(s: HostSession, run_id: str) -> bool:
    """A cancel of a run the host does not know: it never starts here (its start may still
    be on the wire, and agent-radar takes the run as ended: docs/protocol.md). True if it is
    refused now; the call still answers `404 not_found`. An id past the protocol's bound is
    refused `422` and kept nowhere."""
    text_of({"run_id": run_id}, "run_id")
    if run_id in s.runs:
        return False
    s.runs[run_id] = Run(run_id, kind="", args={}, state=REFUSED)
    return True


def run_status(host: Any, s: HostSession, run_id: str) -> dict:
    run = _run_of(s, run_id)
    if run.state == "running":
        return {"state": "running"}
    return {"state": "done"} | {k: getattr(run, k) for k in RUN_RESULT}


def cancel_run(host: Any, s: HostSession, run_id: str) -> dict:
    run = _run_of(s, run_id)
    if run.state == "running":
        host.agent.cancel_run(host, s, run)
    return {}

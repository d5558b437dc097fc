"""The simulator's `/sim/` endpoints (state.Simulator's `control` and `snapshot`): a session
changed behind the protocol's back (offline, restarted, moved here anew, a turn planted or
ended, a run finished, its agent's settings), defaults for sessions not met yet, the faults,
and the effects and calls recorded."""

import re
import time
from typing import Any
from urllib.parse import unquote

from ...host.sessions import HostSession, Turn
from .agent import finish
from .sessions import SESSION_SETTINGS, SimError

PLANTED_TURN_FIELDS = {
    "turn_id",
    "origin",
    "source_goal_operation_id",
    "source_goal_revision",
    "prompt_id",
}

# The longest an effects poller may wait for a new effect, and how often it looks anyway.
MAX_WAIT_S = 5.0
WAIT_SLICE_S = 0.05
# Effects in one answer of /sim/effects: well under a client's answer limit (1 MiB).
EFFECTS_PAGE = 1000


def control(sim: Any, path: str, body: dict) -> dict:
    with sim.lock:
        if path == "/sim/reset":
            sim.reset()
            return {}
        match = re.match(r"^/sim/sessions/([^/]+)/([^/]+)$", path)
        if match:
            return _session(sim, unquote(match[1]), unquote(match[2]), body)
        if path == "/sim/defaults":
            unknown = set(body) - set(SESSION_SETTINGS)
            if unknown:
                raise SimError(422, "rejected", detail=f"unknown settings {sorted(unknown)}")
            sim.defaults.update(body)
            return dict(sim.defaults)
        result = sim.faults.control(path, body)
        if result is not None:
            return result
    raise SimError(404, "not_found")


def _session(sim: Any, ws: str, sid: str, body: dict) -> dict:
    if body.get("fresh"):
        # The session arrives here anew (a move): nothing of an earlier stay at this host,
        # a process of its own.
        old = sim.session(ws, sid)
        sim._end_process(old)  # what it had accepted never takes effect here
        sim.settings.pop((ws, sid), None)
        live = sim.defaults.get("live", True)
        sim.sessions[(ws, sid)] = HostSession(
            ws, sid, live=live, runtime_epoch=old.runtime_epoch + 1
        )
    s, settings = sim.session(ws, sid), sim.settings_of(ws, sid)
    if body.get("restart"):
        # The host process restarts: a new epoch, and everything it held in memory —
        # fences, turns, maintenance runs — is gone.
        sim._end_process(s)
        s.runtime_epoch += 1
    for key in SESSION_SETTINGS:
        if key in body:
            setattr(s if key == "live" else settings, key, body[key])
    if body.get("report") and (body.get("restart") or "live" in body):
        # The change as a host in production makes it: reported (a session gone offline, a
        # new epoch). Without `report` it is silent, as the faults tests make are
        # (docs/host-check.md: test hooks).
        sim.later(0, sim.post, sim.signed(s, session={"live": s.live}))
    if body.get("settle_turn") in s.turns:
        # The turn ends on its own now (and its report goes out).
        sim.later(0, sim.settle, ws, sid, body["settle_turn"], "completed")
    if body.get("finish_run") in s.runs:
        # The run ends on its own now, as the session's settings say.
        sim.later(0, finish, sim, ws, sid, body["finish_run"], settings.maintenance_outcome)
    if body.get("turn"):
        _plant_turn(s, body["turn"])
    return {
        "live": s.live,
        "runtime_epoch": s.runtime_epoch,
        "goal": s.goal,
        "applied_revision": s.revision,
        "fences": sorted(s.fences),
        "turns": {
            t.turn_id: {
                "phase": t.phase,
                "outcome": t.outcome,
                "source_goal_operation_id": t.source_goal_operation_id,
                "source_goal_revision": t.source_goal_revision,
            }
            for t in s.turns.values()
        },
        "runs": {
            r.run_id: {"running": r.state == "running", "state": r.state, "cancelled": r.cancelled}
            for r in s.runs.values()
        },
    }


def _plant_turn(s: HostSession, fields: Any) -> None:
    """A turn that runs here until it is cancelled, with no report of it (a test's own turn,
    of an agent that lost its reports)."""
    if (
        not isinstance(fields, dict)
        or set(fields) - PLANTED_TURN_FIELDS
        or not isinstance(fields.get("turn_id"), str)
    ):
        raise SimError(422, "rejected", detail="turn: an object of turn fields with a turn_id")
    turn = Turn(**{"origin": "user_prompt", "runtime_epoch": s.runtime_epoch, **fields})
    s.turns[turn.turn_id] = turn


def snapshot(sim: Any, path: str, since: int = 0, wait_s: float = 0.0) -> dict:
    """`since`: only the effects after the first `since` (a poller that has seen them asks
    for the rest), at most EFFECTS_PAGE of them (an answer stays under a client's limit
    however long the run; ask again from there); `total` counts them all. `wait_s` (at most
    MAX_WAIT_S): wait that long for more than `since` effects before answering, so a poller
    that wants the next effect at once need not ask over and over (each ask costs this
    process the time it would spend answering the calls under test)."""
    if not 0 <= wait_s <= MAX_WAIT_S:
        raise SimError(422, "rejected", detail=f"wait_s must be 0 to {MAX_WAIT_S}")
    with sim.lock:
        if path == "/sim/effects":
            deadline = time.monotonic() + wait_s
            while len(sim.effects) <= since and (left := deadline - time.monotonic()) > 0:
                # In slices: effects made outside a protocol call (a delayed apply or
                # report) notify nobody.
                sim.changed.wait(min(left, WAIT_SLICE_S))
            start = max(since, 0)
            page = sim.effects[start : start + EFFECTS_PAGE]
            return {"effects": page, "total": len(sim.effects)}
        if path == "/sim/calls":
            return {"calls": list(sim.calls), "holding": sim.faults.holding}
        if path == "/sim/health":
            return {"ok": True}
    raise SimError(404, "not_found")

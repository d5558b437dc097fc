"""The simulated agent host: it records every call and effect, keeps its sessions, runs its
timers and sends its reports, and answers the `/sim/` control and snapshot endpoints."""

import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

from ...adapters import report_auth
from .calls import answer_call
from .faults import HostFaults
from .sessions import (
    SESSION_SETTINGS,
    SimError,
    SimSession,
    SimTurn,
)
from .turns import _settle

log = logging.getLogger(__name__)

PLANTED_TURN_FIELDS = {
    "turn_id",
    "origin",
    "source_goal_operation_id",
    "source_goal_revision",
    "prompt_id",
}

Reporter = Callable[[dict[str, Any]], Any]

# The longest an effects poller may wait for a new effect, and how often it looks anyway.
MAX_WAIT_S = 5.0
WAIT_SLICE_S = 0.05
# Effects in one answer of /sim/effects: well under a client's answer limit (1 MiB).
EFFECTS_PAGE = 1000


class Simulator:
    def __init__(
        self, reporter: Reporter | None = None, host_id: str = "default", token: str | None = None
    ) -> None:
        self.lock = threading.RLock()
        # Notified after each protocol call, for pollers that wait for new effects.
        self.changed = threading.Condition(self.lock)
        # Failures, latency, holds and trickles set through /sim/ (reset with the rest).
        self.faults = HostFaults(self.changed)
        self.reporter = reporter
        # The host this simulator is (docs/lifecycles.md: sessions): every report names it.
        self.host_id = host_id
        # With a token, every report is signed with it (docs/protocol.md: signing a report).
        self.token = token
        # After close(): no timer fires, no report goes out (see close).
        self.closed = False
        self._timers: set[threading.Timer] = set()
        self._reporting = 0
        # Turn ids are never given twice, a reset included (see turns._new_turn_id).
        self.turn_seq = 0
        self.reset()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop reporting: the pending timers (turns that would settle, goals that would
        apply later) are cancelled, and reports already on their way are waited for, so that
        the reporter (a publisher, with its broker connection) can be closed after this."""
        with self.changed:
            self.closed = True
            for timer in self._timers:
                timer.cancel()
            self._timers.clear()
            self.changed.wait_for(lambda: not self._reporting, timeout_s)

    def reset(self) -> None:
        with self.lock:
            self.sessions: dict[tuple[str, str], SimSession] = {}
            self.answers: dict[str, dict] = {}
            self.effects: list[dict] = []
            self.calls: list[dict] = []
            self.faults.reset()
            self.defaults: dict[str, Any] = {}

    def session(self, ws: str, sid: str) -> SimSession:
        sess = self.sessions.get((ws, sid))
        if sess is None:
            sess = self.sessions[(ws, sid)] = SimSession(**self.defaults)
        return sess

    # -- protocol --------------------------------------------------------------------------
    def handle(self, call: str, ws: str, sid: str, body: dict) -> dict:
        with self.lock:
            self.calls.append(
                {
                    "call": call,
                    "workspace_id": ws,
                    "session_id": sid,
                    "operation_id": body.get("operation_id"),
                    "require_live": body.get("require_live"),
                    "at": time.time(),
                }
            )
            self.faults.inject(call, ws, sid)
            delay_ms = self.faults.delay_ms(call, sid)
            self.faults.wait_while_held(call)
        if delay_ms:
            time.sleep(delay_ms / 1000)
        with self.lock:
            try:
                return answer_call(self, call, ws, sid, body)
            finally:
                self.changed.notify_all()

    # -- timers and reports ------------------------------------------------------------------
    def later(self, delay_ms: int, fn, *args) -> None:
        """fn(*args) after `delay_ms`, on a timer of its own, unless closed by then."""

        def fire() -> None:
            with self.lock:
                self._timers.discard(timer)
                if self.closed:
                    return
            fn(*args)

        timer = threading.Timer(delay_ms / 1000, fire)
        timer.daemon = True
        with self.lock:
            if self.closed:
                return
            self._timers.add(timer)
        timer.start()

    def report(self, report: dict) -> None:
        if self.reporter is None:
            return
        # Every report names the host that sends it and the epoch of its process
        # (docs/lifecycles.md: sessions).
        sess = self.sessions.get((report["workspace_id"], report["session_id"]))
        if "session" not in report:
            facts: dict[str, Any] = {"host_id": self.host_id}
            if sess is not None:
                facts["runtime_epoch"] = sess.epoch
            report = {**report, "session": facts}
        if self.token:
            report = report_auth.sign(report, self.host_id, self.token)
        with self.changed:
            if self.closed:
                return
            self._reporting += 1
        try:
            self.reporter(report)
        except Exception:  # noqa: BLE001 - an agent host keeps running if reporting fails
            log.exception("runtime-sim: report failed")
        finally:
            with self.changed:
                self._reporting -= 1
                if self.closed and not self._reporting:
                    self.changed.notify_all()  # close() waits for this

    # -- control ---------------------------------------------------------------------------
    def control(self, path: str, body: dict) -> dict:
        with self.lock:
            if path == "/sim/reset":
                self.reset()
                return {}
            match = re.match(r"^/sim/sessions/([^/]+)/([^/]+)$", path)
            if match:
                key = (unquote(match[1]), unquote(match[2]))
                if body.get("fresh"):
                    # The session arrives here anew (a move): nothing of an earlier stay
                    # at this host, a process of its own.
                    old = self.session(*key)
                    self.sessions[key] = SimSession(**{**self.defaults, "epoch": old.epoch + 1})
                sess = self.session(*key)
                if body.get("restart"):
                    # The host process restarts: a new epoch, and everything it held in
                    # memory — fences, turns, maintenance runs — is gone.
                    sess.epoch += 1
                    sess.fences = set()
                    sess.turns = {}
                    sess.runs = {}
                    sess.prompt_turns = {}
                    sess.turn_number = 0
                for key in SESSION_SETTINGS:
                    if key in body:
                        setattr(sess, key, body[key])
                if body.get("report") and (body.get("restart") or "live" in body):
                    # The change as a host in production makes it: reported (a session gone
                    # offline, a new epoch). Without `report` it is silent, as the faults
                    # tests make are (docs/host-check.md: test hooks).
                    facts = {
                        "host_id": self.host_id,
                        "live": sess.live,
                        "runtime_epoch": sess.epoch,
                    }
                    self.later(
                        0,
                        self.report,
                        {
                            "workspace_id": unquote(match[1]),
                            "session_id": unquote(match[2]),
                            "occurred_at_ms": int(time.time() * 1000),
                            "session": facts,
                        },
                    )
                if body.get("settle_turn") in sess.turns:
                    # The turn ends on its own now (and its report goes out).
                    ws, sid = unquote(match[1]), unquote(match[2])
                    self.later(0, _settle, self, ws, sid, body["settle_turn"], "completed")
                if body.get("turn"):
                    # A turn that runs here until it is cancelled, with no report of it
                    # (a test's own turn, of an agent that lost its reports).
                    fields = body["turn"]
                    if not isinstance(fields, dict) or set(fields) - PLANTED_TURN_FIELDS:
                        raise SimError(422, "rejected", detail="turn: an object of turn fields")
                    turn = SimTurn(
                        **{
                            "origin": "user_prompt",
                            "source_goal_operation_id": None,
                            "source_goal_revision": None,
                            **fields,
                        }
                    )
                    sess.turns[turn.turn_id] = turn
                return {
                    "live": sess.live,
                    "runtime_epoch": sess.epoch,
                    "goal": sess.goal,
                    "applied_revision": sess.applied_revision,
                    "fences": sorted(sess.fences),
                    "turns": {
                        t.turn_id: {
                            "phase": t.phase,
                            "outcome": t.outcome,
                            "source_goal_operation_id": t.source_goal_operation_id,
                            "source_goal_revision": t.source_goal_revision,
                        }
                        for t in sess.turns.values()
                    },
                    "runs": {
                        r.run_id: {"running": time.time() < r.done_at, "cancelled": r.cancelled}
                        for r in sess.runs.values()
                    },
                }
            if path == "/sim/defaults":
                unknown = set(body) - set(SESSION_SETTINGS)
                if unknown:
                    raise SimError(422, "rejected", detail=f"unknown settings {sorted(unknown)}")
                self.defaults.update(body)
                return dict(self.defaults)
            result = self.faults.control(path, body)
            if result is not None:
                return result
        raise SimError(404, "not_found")

    def snapshot(self, path: str, since: int = 0, wait_s: float = 0.0) -> dict:
        """`since`: only the effects after the first `since` (a poller that has seen them
        asks for the rest), at most EFFECTS_PAGE of them (an answer stays under a client's
        limit however long the run; ask again from there); `total` counts them all. `wait_s`
        (at most MAX_WAIT_S): wait
        that long for more than `since` effects before answering, so a poller that wants
        the next effect at once need not ask over and over (each ask costs this process
        the time it would spend answering the calls under test)."""
        if not 0 <= wait_s <= MAX_WAIT_S:
            raise SimError(422, "rejected", detail=f"wait_s must be 0 to {MAX_WAIT_S}")
        with self.lock:
            if path == "/sim/effects":
                deadline = time.monotonic() + wait_s
                while len(self.effects) <= since and (left := deadline - time.monotonic()) > 0:
                    # In slices: effects made outside a protocol call (a delayed apply or
                    # report) notify nobody.
                    self.changed.wait(min(left, WAIT_SLICE_S))
                start = max(since, 0)
                page = self.effects[start : start + EFFECTS_PAGE]
                return {"effects": page, "total": len(self.effects)}
            if path == "/sim/calls":
                return {"calls": list(self.calls), "holding": self.faults.holding}
            if path == "/sim/health":
                return {"ok": True}
        raise SimError(404, "not_found")

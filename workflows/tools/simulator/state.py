"""The simulated agent host's state and behaviour: sessions, goals, turns, prompts,
maintenance runs, fences, injected faults; every effect and call recorded."""

import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

from workflows.tools.simulator.faults import HostFaults
from workflows.tools.simulator.sessions import (
    SESSION_SETTINGS,
    SimError,
    SimRun,
    SimSession,
    SimTurn,
)

log = logging.getLogger(__name__)

SESSION_PATH = re.compile(
    r"^/v1/workspaces/([^/]+)/sessions/([^/]+)/(liveness|resume|goal|goal-fences|prompts"
    r"|turns/[^/]+/cancel|maintenance|maintenance/[^/]+|maintenance/[^/]+/cancel)$"
)
Reporter = Callable[[dict[str, Any]], Any]

# The longest an effects poller may wait for a new effect, and how often it looks anyway.
MAX_WAIT_S = 5.0
WAIT_SLICE_S = 0.05


class Simulator:
    def __init__(self, reporter: Reporter | None = None, host_id: str = "default") -> None:
        self.lock = threading.RLock()
        # Notified after each protocol call, for pollers that wait for new effects.
        self.changed = threading.Condition(self.lock)
        # Failures, latency, holds and trickles set through /sim/ (reset with the rest).
        self.faults = HostFaults(self.changed)
        self.reporter = reporter
        # The host this simulator is (DESIGN 4.9): every report names it.
        self.host_id = host_id
        # After close(): no timer fires, no report goes out (see close).
        self.closed = False
        self._timers: set[threading.Timer] = set()
        self._reporting = 0
        # Turn ids are never given twice, a reset included (see _new_turn_id).
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
            delay_ms = self.faults.delay_ms(call)
            self.faults.wait_while_held(call)
        if delay_ms:
            time.sleep(delay_ms / 1000)
        with self.lock:
            try:
                return self._answer(call, ws, sid, body)
            finally:
                self.changed.notify_all()

    def _answer(self, call: str, ws: str, sid: str, body: dict) -> dict:
        with self.lock:
            sess = self.session(ws, sid)
            if sess.missing:
                raise SimError(404, "session_not_found")
            if call == "liveness":
                return {"live": sess.live, "runtime_epoch": sess.epoch}
            if call == "resume":
                return self._resume(ws, sid, sess, body)
            if call == "goal-fences":
                return self._install_fence(ws, sid, sess, body)
            if call.startswith("turns/"):
                return self._cancel_turn(ws, sid, sess, unquote(call.split("/")[1]), body)
            if call == "prompts":
                return self._prompt(ws, sid, sess, body)
            if call.startswith("maintenance"):
                return self._maintenance(ws, sid, sess, call.split("/"), body)
            return self._goal(ws, sid, sess, body)

    def _resume(self, ws: str, sid: str, sess: SimSession, body: dict) -> dict:
        fences = body.get("fences") or []
        if not sess.live:
            # A new provider process (a new epoch): what the old one ran ended with it, and
            # it holds the fences it was given, no others.
            sess.live = True
            sess.epoch += 1
            sess.fences, sess.turns, sess.runs, sess.prompt_turns = set(), {}, {}, {}
            self.effects.append(
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

    def _goal(self, ws: str, sid: str, sess: SimSession, body: dict) -> dict:
        op_id, revision = body["operation_id"], int(body["revision"])
        if not sess.live:
            raise SimError(409, "disconnected")
        if op_id in self.answers:
            return self.answers[op_id]  # a retry: same answer, no second effect
        if (op_id, revision) in sess.fences:
            raise SimError(422, "rejected", detail="fenced generation")
        if revision <= sess.applied_revision:
            raise SimError(409, "stale_revision", current_revision=sess.applied_revision)
        if sess.goal_mode == "accepted":
            answer = {"phase": "accepted", "goal": None, "evidence": {"acknowledged": True}}
            self.answers[op_id] = answer
            self._later(sess.apply_delay_ms, self._apply_later, ws, sid, body)
            return answer
        goal = self._apply(ws, sid, sess, body)
        answer = {"phase": "applied", "goal": goal, "evidence": {"applied_revision": revision}}
        self.answers[op_id] = answer
        return answer

    def _apply(self, ws: str, sid: str, sess: SimSession, body: dict) -> dict | None:
        action, revision = body["action"], int(body["revision"])
        if action == "set":
            sess.goal = {"objective": body["objective"], "status": "active"}
        elif action == "clear":
            sess.goal = None
        elif sess.goal is not None:
            sess.goal = {**sess.goal, "status": "paused" if action == "pause" else "active"}
        sess.applied_revision = revision
        self.effects.append(
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
            self._start_turn(ws, sid, sess, body["operation_id"], revision)
        return sess.goal

    # -- turns, fences and cancels -----------------------------------------------------------
    def _new_turn_id(self) -> str:
        """A turn id this host never gave before, whatever its sessions did (they restart,
        leave and come back anew): the protocol's turn ids are unique for good, as a real
        agent's UUIDs are; the control plane keys turns and their cancels by them."""
        self.turn_seq += 1
        return f"turn-{self.host_id}-{self.turn_seq}"

    def _start_turn(
        self, ws: str, sid: str, sess: SimSession, operation_id: str, revision: int
    ) -> None:
        turn = SimTurn(
            turn_id=self._new_turn_id(),
            origin="goal_continuation",
            source_goal_operation_id=operation_id,
            source_goal_revision=revision,
        )
        sess.turns[turn.turn_id] = turn
        self._report_turn_later(ws, sid, turn, sess.report_delay_ms)
        if sess.turn_duration_ms:
            self._later(sess.turn_duration_ms, self._settle, ws, sid, turn.turn_id, "completed")

    def _settle(self, ws: str, sid: str, turn_id: str, outcome: str) -> None:
        with self.lock:
            turn = self.session(ws, sid).turns.get(turn_id)
            if turn is None or turn.phase == "settled":
                return
            turn.phase, turn.outcome = "settled", outcome
            self.effects.append(
                {
                    "kind": "turn_settled",
                    "workspace_id": ws,
                    "session_id": sid,
                    "turn_id": turn_id,
                    "outcome": outcome,
                    "at": time.time(),
                }
            )
        self._report_turn_later(ws, sid, turn, 0)

    def _report_turn_later(self, ws: str, sid: str, turn: SimTurn, delay_ms: int) -> None:
        snapshot = {
            "turn_id": turn.turn_id,
            "phase": turn.phase,
            "outcome": turn.outcome,
            "origin": turn.origin,
            "source_goal_operation_id": turn.source_goal_operation_id,
            "source_goal_revision": turn.source_goal_revision,
            "prompt_id": turn.prompt_id,
        }
        self._later(
            delay_ms,
            self.report,
            {
                "workspace_id": ws,
                "session_id": sid,
                "occurred_at_ms": int(time.time() * 1000),
                "turn": snapshot,
            },
        )

    def _later(self, delay_ms: int, fn, *args) -> None:
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

    def _prompt(self, ws: str, sid: str, sess: SimSession, body: dict) -> dict:
        if not sess.live:
            raise SimError(409, "disconnected")
        prompt_id = body["prompt_id"]
        if prompt_id not in sess.prompt_turns:
            turn = SimTurn(
                turn_id=self._new_turn_id(),
                origin="user_prompt",
                source_goal_operation_id=None,
                source_goal_revision=None,
                prompt_id=prompt_id,
            )
            sess.turns[turn.turn_id] = turn
            sess.prompt_turns[prompt_id] = turn.turn_id
            self.effects.append(
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
            self._report_turn_later(ws, sid, turn, 0)
            if sess.turn_duration_ms:
                self._later(sess.turn_duration_ms, self._settle, ws, sid, turn.turn_id, "completed")
        return {"turn_id": sess.prompt_turns[prompt_id]}

    def _maintenance(
        self, ws: str, sid: str, sess: SimSession, parts: list[str], body: dict
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
                self.effects.append(
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
        run = sess.runs.get(unquote(parts[1]))
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

    def _install_fence(self, ws: str, sid: str, sess: SimSession, body: dict) -> dict:
        if body.get("require_live") and not sess.live:
            raise SimError(409, "disconnected")
        fence = (body["target_operation_id"], int(body["target_revision"]))
        if fence not in sess.fences:
            sess.fences.add(fence)
            self.effects.append(
                {
                    "kind": "fence",
                    "workspace_id": ws,
                    "session_id": sid,
                    "target_operation_id": fence[0],
                    "target_revision": fence[1],
                    "at": time.time(),
                }
            )
        return {}

    def _cancel_turn(self, ws: str, sid: str, sess: SimSession, turn_id: str, body: dict) -> dict:
        if body.get("require_live") and not sess.live:
            raise SimError(409, "disconnected")
        op_id = body["operation_id"]
        if op_id in self.answers:
            return self.answers[op_id]
        turn = sess.turns.get(turn_id)
        if turn is None:
            raise SimError(404, "not_found")
        self.effects.append(
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
            self._report_turn_later(ws, sid, turn, 0)
            answer = {"result": "canceled"}
        else:
            if sess.cancel_mode == "accepted":
                self._later(sess.cancel_delay_ms, self._settle, ws, sid, turn_id, "canceled")
            answer = {"result": "accepted"}
        self.answers[op_id] = answer
        return answer

    def _apply_later(self, ws: str, sid: str, body: dict) -> None:
        with self.lock:
            sess = self.session(ws, sid)
            if int(body["revision"]) <= sess.applied_revision:
                return  # a newer revision got there first; this one is stale now
            goal = self._apply(ws, sid, sess, body)
        self.report(
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

    def report(self, report: dict) -> None:
        if self.reporter is None:
            return
        # Every report names the host that sends it and the epoch of its process
        # (DESIGN 4.9).
        sess = self.sessions.get((report["workspace_id"], report["session_id"]))
        if "session" not in report:
            facts: dict[str, Any] = {"host_id": self.host_id}
            if sess is not None:
                facts["runtime_epoch"] = sess.epoch
            report = {**report, "session": facts}
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
                for key in SESSION_SETTINGS:
                    if key in body:
                        setattr(sess, key, body[key])
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
                }
            if path == "/sim/defaults":
                unknown = set(body) - set(SESSION_SETTINGS)
                if unknown:
                    raise SimError(422, "rejected", detail=f"unknown settings {sorted(unknown)}")
                self.defaults.update(body)
                return dict(self.defaults)
            answer = self.faults.control(path, body)
            if answer is not None:
                return answer
        raise SimError(404, "not_found")

    def snapshot(self, path: str, since: int = 0, wait_s: float = 0.0) -> dict:
        """`since`: only the effects after the first `since` (a poller that has seen them
        asks for the rest); `total` counts them all. `wait_s` (at most MAX_WAIT_S): wait
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
                return {"effects": self.effects[max(since, 0) :], "total": len(self.effects)}
            if path == "/sim/calls":
                return {"calls": list(self.calls), "holding": self.faults.holding}
            if path == "/sim/health":
                return {"ok": True}
        raise SimError(404, "not_found")

"""An agent host's side of the protocol, kept (docs/hosts.md): every call answered as
docs/protocol.md promises — answers kept by their keys, revisions only forward, fences held,
`require_live`, epochs, sessions met on first use — with goals, revisions, fences, epochs and
answers kept in a file across restarts, and every report signed and handed to a reporter.

What runs is the agent's (`Agent`): the host tells it when a turn starts (a goal set, a
prompt), when a turn is to be cancelled and when a maintenance run starts or is to stop; the
agent says when a turn ends (`AgentHost.settle`) and when a run is done (`AgentHost.finish`).
`TimerAgent` is an agent whose turns and runs are timers, for trying a host out.
"""

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

from ..adapters import report_auth
from .server import HostError, HostServer, item_of
from .sessions import HostSession, Run, Turn, int_of, list_of, text_of

Reporter = Callable[[dict[str, Any]], Any]
GOAL_ACTIONS = ("set", "clear", "pause", "resume")


class Agent(Protocol):
    """What runs turns and maintenance: yours."""

    def start_turn(self, host: "AgentHost", session: HostSession, turn: Turn) -> None: ...

    def cancel_turn(self, host: "AgentHost", session: HostSession, turn: Turn) -> bool:
        """True if the turn ended now (settle it first); False: it ends later."""
        ...

    def start_run(self, host: "AgentHost", session: HostSession, run: Run) -> None: ...

    def cancel_run(self, host: "AgentHost", session: HostSession, run: Run) -> None: ...


class AgentHost:
    """The host's sessions and every call's answer (thread-safe: one lock)."""

    def __init__(
        self,
        agent: Agent,
        *,
        token: str,
        host_id: str = "default",
        state_file: str | os.PathLike | None = None,
        reporter: Reporter | None = None,
        effects_log: str | os.PathLike | None = None,
    ) -> None:
        self.agent, self.token, self.host_id = agent, token, host_id
        self.reporter = reporter
        self.state_file = Path(state_file) if state_file else None
        # Every effect, one JSON line each (goal, fence, prompt, cancel, maintenance): what
        # reached the session, countable at the host.
        self.effects_log = Path(effects_log) if effects_log else None
        self.lock = threading.RLock()
        self.sessions: dict[tuple[str, str], HostSession] = {}
        self.answers: dict[str, dict] = {}  # goal and cancel operation ids: the answer
        self.turn_seq = 0
        self._load()

    # -- keeping ---------------------------------------------------------------------------
    def _load(self) -> None:
        """A restart: what the file keeps comes back, and every session's process is new
        (a new epoch, reported); what the old one ran ended with it."""
        if self.state_file is None or not self.state_file.exists():
            return
        saved = json.loads(self.state_file.read_text())
        self.answers, self.turn_seq = saved["answers"], saved["turn_seq"]
        for kept in saved["sessions"]:
            s = HostSession(**kept)
            self.sessions[(s.workspace_id, s.session_id)] = s
            self._new_epoch(s)
        self._save()

    def _save(self) -> None:
        """Written before the answer that depends on it goes out."""
        if self.state_file is None:
            return
        kept = {
            "sessions": [s.kept() for s in self.sessions.values()],
            "answers": self.answers,
            "turn_seq": self.turn_seq,
        }
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(kept))
        os.replace(tmp, self.state_file)

    def _effect(self, kind: str, s: HostSession, **fields: Any) -> None:
        if self.effects_log is None:
            return
        line = {"kind": kind, "workspace_id": s.workspace_id, "session_id": s.session_id}
        with self.effects_log.open("a") as log:
            log.write(json.dumps(line | fields | {"at": time.time()}) + "\n")

    def session(self, ws: str, sid: str) -> HostSession:
        """A session is met at the first call that names it, live."""
        found = self.sessions.get((ws, sid))
        if found is None:
            found = self.sessions[(ws, sid)] = HostSession(ws, sid)
        return found

    def _new_epoch(self, s: HostSession) -> None:
        s.live, s.runtime_epoch = True, s.runtime_epoch + 1
        s.turns, s.prompts, s.runs = {}, {}, {}
        self.report(s, session={"live": True, "runtime_epoch": s.runtime_epoch})

    # -- reports (docs/protocol.md: reports, signing a report) -------------------------------
    def report(self, s: HostSession, **fields: Any) -> None:
        if self.reporter is None:
            return
        facts = {"host_id": self.host_id, "runtime_epoch": s.runtime_epoch}
        report = {
            "workspace_id": s.workspace_id,
            "session_id": s.session_id,
            "occurred_at_ms": int(time.time() * 1000),
            **fields,
            "session": facts | fields.get("session", {}),
        }
        self.reporter(report_auth.sign(report, self.host_id, self.token))

    def _report_turn(self, s: HostSession, turn: Turn) -> None:
        shown = {k: v for k, v in asdict(turn).items() if v is not None}
        shown.pop("runtime_epoch")
        shown.pop("text", None)
        self.report(s, turn=shown)

    # -- what the agent tells -------------------------------------------------------------
    def settle(self, ws: str, sid: str, turn_id: str, outcome: str = "completed") -> bool:
        """A turn ended (`completed`, `failed`, `canceled`, `interrupted`); reported."""
        with self.lock:
            s = self.session(ws, sid)
            turn = s.turns.get(turn_id)
            if turn is None or turn.phase == "settled":
                return False
            turn.phase, turn.outcome = "settled", outcome
        self._report_turn(s, turn)
        return True

    def finish(self, ws: str, sid: str, run_id: str, **result: Any) -> None:
        """A maintenance run is done: `applied`, `cancelled`, `error`, `input_tokens`,
        `result_tokens`, `summary`."""
        with self.lock:
            run = self.session(ws, sid).runs.get(run_id)
            if run is not None and run.state == "running":
                run.state = "done"
                for name, value in result.items():
                    setattr(run, name, value)

    def go_offline(self, ws: str, sid: str) -> None:
        """The session's process stopped: offline until a resume; reported."""
        with self.lock:
            s = self.session(ws, sid)
            s.live = False
            self._save()
        self.report(s, session={"live": False})

    def restart(self, ws: str, sid: str) -> None:
        """The session's process is new: a new epoch, reported."""
        with self.lock:
            s = self.session(ws, sid)
            self._new_epoch(s)
            self._save()

    # -- the calls --------------------------------------------------------------------------
    def handle(self, call: str, ws: str, sid: str, body: dict) -> dict:
        """One call of docs/protocol.md (HostServer's `handle`)."""
        with self.lock:
            s = self.session(ws, sid)
            if call == "liveness":
                return {"live": s.live, "runtime_epoch": s.runtime_epoch}
            if call == "state":
                return self._state(s)
            if call == "resume":
                return self._resume(s, body)
            if call == "goal":
                return self._goal(s, body)
            if call == "goal-fences":
                return self._fence(s, body)
            if call == "prompts":
                return self._prompt(s, body)
            if call.startswith("turns/"):
                return self._cancel(s, item_of(call), body)
            if call == "maintenance":
                return self._start_run(s, body)
            return self._run(s, item_of(call), call.endswith("/cancel"))

    @staticmethod
    def _live(s: HostSession) -> None:
        if not s.live:
            raise HostError(409, "disconnected")

    def _state(self, s: HostSession) -> dict:
        running = next((r for r in s.runs.values() if r.state == "running"), None)
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
            "maintenance": None
            if running is None
            else {"run_id": running.run_id, "state": "running"},
        }

    def _resume(self, s: HostSession, body: dict) -> dict:
        for fence in list_of(body, "fences"):
            pair = [text_of(fence, "target_operation_id"), int_of(fence, "target_revision")]
            if pair not in s.fences:
                s.fences.append(pair)
        if not s.live:
            self._new_epoch(s)
        self._save()
        return {"live": True, "runtime_epoch": s.runtime_epoch}

    def _goal(self, s: HostSession, body: dict) -> dict:
        op, revision = text_of(body, "operation_id"), int_of(body, "revision")
        action = text_of(body, "action")
        if action not in GOAL_ACTIONS:
            raise HostError(422, "rejected", detail=f"action must be one of {GOAL_ACTIONS}")
        self._live(s)
        if op in self.answers:
            return self.answers[op]
        if s.fenced(op, revision):
            raise HostError(422, "rejected", detail="fenced generation")
        if revision <= s.revision:
            raise HostError(409, "stale_revision", current_revision=s.revision)
        if action == "set":
            s.goal = {"objective": text_of(body, "objective"), "status": "active"}
        elif action == "clear":
            s.goal = None
        elif s.goal is not None:
            s.goal = {**s.goal, "status": "paused" if action == "pause" else "active"}
        s.revision, s.applied_operation_id = revision, op
        self._effect("goal", s, operation_id=op, action=action, revision=revision)
        answer = {"phase": "applied", "goal": s.goal, "evidence": {"applied_revision": revision}}
        self.answers[op] = answer
        self._save()
        if action == "set":
            self._start_turn(
                s, "goal_continuation", source_goal_operation_id=op, source_goal_revision=revision
            )
        return answer

    def _fence(self, s: HostSession, body: dict) -> dict:
        pair = [text_of(body, "target_operation_id"), int_of(body, "target_revision")]
        if body.get("require_live"):
            self._live(s)
        if pair not in s.fences:
            s.fences.append(pair)
            self._save()
            self._effect("fence", s, target_operation_id=pair[0], target_revision=pair[1])
        running = [
            t.turn_id
            for t in s.turns.values()
            if t.phase != "settled" and [t.source_goal_operation_id, t.source_goal_revision] == pair
        ]
        return {"running_turns": running}

    def _start_turn(self, s: HostSession, origin: str, **provenance: Any) -> Turn:
        self.turn_seq += 1
        turn = Turn(f"turn-{self.host_id}-{self.turn_seq}", s.runtime_epoch, origin, **provenance)
        s.turns[turn.turn_id] = turn
        self._save()
        self._report_turn(s, turn)
        self.agent.start_turn(self, s, turn)
        return turn

    def _prompt(self, s: HostSession, body: dict) -> dict:
        prompt_id, text = text_of(body, "prompt_id"), text_of(body, "text")
        self._live(s)
        if prompt_id not in s.prompts:
            turn = self._start_turn(s, "user_prompt", prompt_id=prompt_id, text=text)
            s.prompts[prompt_id] = turn.turn_id
            self._effect("prompt", s, prompt_id=prompt_id, turn_id=turn.turn_id)
        return {"turn_id": s.prompts[prompt_id]}

    def _cancel(self, s: HostSession, turn_id: str, body: dict) -> dict:
        op = text_of(body, "operation_id")
        if body.get("require_live"):
            self._live(s)
        if op in self.answers:
            return self.answers[op]
        turn = s.turns.get(turn_id)
        if turn is None:
            raise HostError(404, "not_found")
        if turn.phase == "settled":
            answer = {"result": "already_settled"}
        else:
            ended = self.agent.cancel_turn(self, s, turn)
            self._effect("cancel", s, turn_id=turn_id)
            answer = {"result": "canceled" if ended else "accepted"}
        self.answers[op] = answer
        self._save()
        return answer

    def _start_run(self, s: HostSession, body: dict) -> dict:
        run_id, kind = text_of(body, "run_id"), text_of(body, "kind")
        args = body.get("args") or {}
        if not isinstance(args, dict):
            raise HostError(422, "rejected", detail="args must be an object")
        self._live(s)
        if run_id not in s.runs:
            run = s.runs[run_id] = Run(run_id, kind, args)
            self._effect("maintenance", s, run_id=run_id, maintenance_kind=kind)
            self.agent.start_run(self, s, run)
        return {"state": "running"}

    def _run(self, s: HostSession, run_id: str, cancel: bool) -> dict:
        run = s.runs.get(run_id)
        if run is None:
            raise HostError(404, "not_found")
        if cancel:
            if run.state == "running":
                self.agent.cancel_run(self, s, run)
            return {}
        if run.state == "running":
            return {"state": "running"}
        return {"state": "done"} | {
            k: getattr(run, k)
            for k in ("applied", "cancelled", "error", "input_tokens", "result_tokens", "summary")
        }

    # -- test hooks (docs/host-check.md) -----------------------------------------------------
    def hook(self, method: str, path: str, query: str, body: dict) -> tuple[int, dict]:
        """`POST /sim/sessions/{ws}/{sid}` with `{"live": false}` or `{"restart": true}`: the
        change, reported. Offer it in test builds only (`serve(test_hooks=True)`)."""
        from urllib.parse import unquote

        parts = path.split("/")
        if method != "POST" or len(parts) != 5 or parts[:3] != ["", "sim", "sessions"]:
            return 404, {"error": "not_found"}
        ws, sid = unquote(parts[3]), unquote(parts[4])
        if body.get("live") is False:
            self.go_offline(ws, sid)
        if body.get("restart"):
            self.restart(ws, sid)
        s = self.session(ws, sid)
        return 200, {"live": s.live, "runtime_epoch": s.runtime_epoch}

    def serve(
        self, host: str = "127.0.0.1", port: int = 8765, test_hooks: bool = False
    ) -> HostServer:
        """This host on a real socket, behind its token (`.start()` serves in a thread)."""
        return HostServer(self.handle, host, port, self.token, self.hook if test_hooks else None)

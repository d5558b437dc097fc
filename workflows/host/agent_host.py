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
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from ..adapters import report_auth
from . import calls
from .reports import Reporter, ReportSender
from .server import HostError, HostServer, item_of
from .sessions import (
    RUN_RESULT,
    HostSession,
    Run,
    Turn,
)

log = logging.getLogger(__name__)


@dataclass
class _Change:
    """What one call did besides its state: answers kept (taken back if it fails), effects
    to log and the agent's work to start (once it is saved)."""

    answers: list[str] = field(default_factory=list)
    dropped: dict[str, dict] = field(default_factory=dict)  # answers taken away: put back
    effects: list[dict] = field(default_factory=list)
    starts: list[Callable[[], None]] = field(default_factory=list)


class Agent(Protocol):
    """What runs turns and maintenance: yours. It may also have `takes_goal(host, session,
    goal) -> bool` (`goal`: operation_id, action, objective, revision): False answers the
    goal call `accepted`, and the agent calls `host.goal_applied(ws, sid, operation_id)` once
    it has taken effect (docs/protocol.md: reports, `goal_applied`). Without it, every goal
    is applied at once (call `goal_applied` later, never from inside `takes_goal`: the goal
    is pending only once the call is saved). And `continues_goal(host, session, goal) ->
    bool`: False, and a goal set starts no turn of its own (an agent that pursues goals only
    when prompted).

    Every method runs under the host's one lock: return at once, and do the work on a
    thread of your own (calling `settle`, `finish`, `goal_applied` from it)."""

    def start_turn(self, host: "AgentHost", session: HostSession, turn: Turn) -> None:
        """A goal's turn (its objective is `session.goal`) or a prompt's (`turn.text`)."""
        ...

    def cancel_turn(self, host: "AgentHost", session: HostSession, turn: Turn) -> bool:
        """True if the turn ended now (the kit settles it `canceled`); False: it ends
        later, and the agent settles it then."""
        ...

    def start_run(self, host: "AgentHost", session: HostSession, run: Run) -> None: ...

    def cancel_run(self, host: "AgentHost", session: HostSession, run: Run) -> None: ...


class AgentHost:
    """The host's sessions and every call's answer (thread-safe: one lock). A call that
    changes anything either changes it all — saved before its answer goes out — or, on any
    failure (a refusal, the file, the agent), nothing: the host's memory is put back as it
    was and a failure that is not a refusal answers `500 server_error`, which the workers
    retry. Reports and the effects log go out after the lock is let go."""

    # Only the simulator runs without a token, in tests (tools/simulator/state.py).
    TOKENLESS = False

    def __init__(
        self,
        agent: Agent,
        *,
        token: str | None,
        host_id: str = "default",
        state_file: str | os.PathLike | None = None,
        reporter: Reporter | None = None,
        effects_log: str | os.PathLike | None = None,
    ) -> None:
        if not token and not self.TOKENLESS:
            raise ValueError("a host needs its token: calls without it must be refused")
        self.agent, self.token, self.host_id = agent, token, host_id
        self.state_file = Path(state_file) if state_file else None
        # Every effect, one JSON line each (goal, fence, prompt, cancel, maintenance): what
        # reached the session, countable at the host.
        self.effects_log = Path(effects_log) if effects_log else None
        self.lock = threading.RLock()
        self.sessions: dict[tuple[str, str], HostSession] = {}
        self.answers: dict[str, dict] = {}  # goal and cancel operation ids: the answer
        self.turn_seq = 0
        self._outbox: list[dict] = []  # signed reports of the call under way
        self.sender = ReportSender(reporter) if reporter is not None else None
        self._change, self._in_change = _Change(), False
        with self.lock:
            self._load()
        self._send_reports()

    # -- keeping ---------------------------------------------------------------------------
    def _load(self) -> None:
        """A restart: what the file keeps comes back. A live session's process is new (a new
        epoch, reported); an offline one stays offline until a resume; what the old
        process ran ended with it."""
        if self.state_file is None or not self.state_file.exists():
            return
        saved = json.loads(self.state_file.read_text())
        self.answers, self.turn_seq = saved["answers"], saved["turn_seq"]
        for kept in saved["sessions"]:
            s = HostSession.from_kept(kept)
            self.sessions[(s.workspace_id, s.session_id)] = s
            if s.live:
                self._new_epoch(s)
            else:
                self._end_process(s)
        self._save()

    def _save(self) -> None:
        """Written whole, then moved into place, before the answer that depends on it."""
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
        """Logged with its call once the call is saved; outside a call (a turn's end), now."""
        line = {"kind": kind, "workspace_id": s.workspace_id, "session_id": s.session_id}
        line |= fields | {"at": time.time()}
        if self._in_change:
            self._change.effects.append(line)
        else:
            self._log_effects([line])

    def session(self, ws: str, sid: str) -> HostSession:
        """A session is met at the first call that names it, live."""
        found = self.sessions.get((ws, sid))
        if found is None:
            found = self.sessions[(ws, sid)] = HostSession(ws, sid)
        return found

    def new_turn_id(self, s: HostSession) -> str:
        """A turn id this host never gave before, whatever its sessions did."""
        self.turn_seq += 1
        return f"turn-{self.host_id}-{self.turn_seq}"

    def _new_epoch(self, s: HostSession) -> None:
        self._end_process(s)
        s.live, s.runtime_epoch = True, s.runtime_epoch + 1
        self.report(s, session={"live": True, "runtime_epoch": s.runtime_epoch})

    def _end_process(self, s: HostSession) -> None:
        """The session's process is gone: its turns with it, its runs done (not applied),
        and the goals it had accepted but not applied never take effect: their `accepted`
        answers go too, so a retry of one applies it anew (nothing of it had happened)."""
        s.turns = {}
        for run in list(s.runs.values()):
            if run.state == "running":
                s.runs[run.run_id] = replace(run, state="done", error="the process ended")
        for operation_id in s.pending_goals:
            self._drop_answer(operation_id)
        s.pending_goals = {}

    # -- reports (docs/protocol.md: reports, signing a report) -------------------------------
    def report(self, s: HostSession, **fields: Any) -> None:
        """Sign a report; it goes out once the lock is let go (`_send_reports`)."""
        if self.sender is not None:
            with self.lock:
                self._outbox.append(self.signed(s, **fields))

    def signed(self, s: HostSession, **fields: Any) -> dict:
        """A report of the session, now, naming this host and the session's epoch; signed with
        the token (a host without one, the simulator in tests, sends it unsigned)."""
        facts = {"host_id": self.host_id, "runtime_epoch": s.runtime_epoch}
        report = {
            "workspace_id": s.workspace_id,
            "session_id": s.session_id,
            "occurred_at_ms": int(time.time() * 1000),
            **fields,
            "session": facts | fields.get("session", {}),
        }
        return self.sign(report)

    def sign(self, report: dict) -> dict:
        return report_auth.sign(report, self.host_id, self.token) if self.token else report

    def _send_reports(self) -> None:
        """Hand the waiting reports to the sender (host/reports.py), in order."""
        with self.lock:
            waiting, self._outbox = self._outbox, []
            if self.sender is not None:
                self.sender.send(waiting)

    def close(self, timeout_s: float = 5.0) -> None:
        """Send no more reports, and wait for those on their way (see ReportSender.close)."""
        if self.sender is not None:
            self.sender.close(timeout_s)

    def _report_turn(self, s: HostSession, turn: Turn) -> None:
        self.report(s, turn=turn.reported())

    # -- what the agent tells -------------------------------------------------------------
    def settle(self, ws: str, sid: str, turn_id: str, outcome: str = "completed") -> bool:
        """A turn ended (`completed`, `failed`, `canceled`, `interrupted`); reported."""
        with self.lock:
            s = self.session(ws, sid)
            turn = s.turns.get(turn_id)
            ended = turn is not None and turn.phase != "settled"
            if turn is not None and ended:
                # A new Turn, not the old one changed: a call's snapshot of the session
                # (`_changing`) shares the old one.
                s.turns[turn_id] = turn = replace(turn, phase="settled", outcome=outcome)
                self._report_turn(s, turn)
                self._effect("turn_settled", s, turn_id=turn_id, outcome=outcome)
                s.prune_settled()
            if self._in_change:
                return ended  # its report goes out with the call's
        self._send_reports()
        return ended

    def finish(self, ws: str, sid: str, run_id: str, **result: Any) -> None:
        """A maintenance run is done: `applied`, `cancelled`, `error`, `input_tokens`,
        `result_tokens`, `summary`. Any other name: the run ends with an error saying so,
        and ValueError is raised (an agent's bug, told where it happens)."""
        unknown = sorted(set(result) - set(RUN_RESULT))
        if unknown:
            result = {"error": f"the agent finished the run with unknown fields {unknown}"}
        with self.lock:
            s = self.session(ws, sid)
            run = s.runs.get(run_id)
            if run is not None and run.state == "running":
                s.runs[run_id] = replace(run, state="done", **result)  # as settle's Turn
                self._save()
        if unknown:
            raise ValueError(f"finish takes {list(RUN_RESULT)}, not {unknown}")

    def goal_applied(self, ws: str, sid: str, operation_id: str) -> bool:
        """A goal answered `accepted` has taken effect: applied and reported `goal_applied`
        (the workers then ask the state call, whose answer completes the operation). False
        if it is not pending, or a newer revision got there first (it is dropped)."""

        def apply(s: HostSession) -> bool:
            wanted = s.pending_goals.pop(operation_id, None)
            if wanted is None:
                return False
            if wanted["revision"] <= s.revision or not s.live:
                # Never to take effect: its `accepted` goes too, so that a retry is
                # answered as it is now (stale, or applied anew after a resume).
                self._drop_answer(operation_id)
                return False
            calls.apply_goal(self, s, wanted)
            applied = {k: wanted[k] for k in ("operation_id", "revision")}
            self.report(s, goal_applied=applied | {"goal": s.goal})
            return True

        return bool(self._changing(ws, sid, apply))

    def go_offline(self, ws: str, sid: str) -> None:
        """The session's process stopped: offline until a resume; reported."""
        self._changing(ws, sid, lambda s: self._offline(s))

    def restart(self, ws: str, sid: str) -> None:
        """The session's process is new: a new epoch, reported."""
        self._changing(ws, sid, self._new_epoch)

    def _offline(self, s: HostSession) -> None:
        self._end_process(s)
        s.live = False
        self.report(s, session={"live": False})

    # -- the calls --------------------------------------------------------------------------
    def handle(self, call: str, ws: str, sid: str, body: dict) -> dict:
        """One call of docs/protocol.md (HostServer's `handle`)."""
        if call in ("liveness", "state") or (
            call.startswith("maintenance/") and not call.endswith("/cancel")
        ):
            with self.lock:
                s = self.session(ws, sid)
                if call == "liveness":
                    return {"live": s.live, "runtime_epoch": s.runtime_epoch}
                if call == "state":
                    return calls.state(self, s)
                return calls.run_status(self, s, item_of(call))
        if call.startswith("maintenance/"):  # a cancel: one of a run not known is kept
            with self.lock:  # refused, though the call answers 404 (which undoes a change)
                if calls.refuse_unknown_run(self.session(ws, sid), item_of(call)):
                    self._save()
                    raise HostError(404, "not_found")
        return self._changing(ws, sid, lambda s: self._call(call, s, body))

    def _call(self, call: str, s: HostSession, body: dict) -> dict:
        if call == "resume":
            return calls.resume(self, s, body)
        if call == "goal":
            return calls.goal(self, s, body)
        if call == "goal-fences":
            return calls.fence(self, s, body)
        if call == "prompts":
            return calls.prompt(self, s, body)
        if call.startswith("turns/"):
            return calls.cancel(self, s, item_of(call), body)
        if call == "maintenance":
            return calls.start_run(self, s, body)
        return calls.cancel_run(self, s, item_of(call))

    def _changing(self, ws: str, sid: str, change: Callable[[HostSession], Any]) -> Any:
        """Run `change` on the session as one unit (see the class): saved, then its effects
        logged and the agent's work started; or, on a failure, nothing changed."""
        with self.lock:
            s = self.session(ws, sid)
            before = (s.snapshot(), self.turn_seq, len(self._outbox))
            self._change, self._in_change = _Change(), True
            try:
                answer = change(s)
                self._save()
            except BaseException as exc:
                self._in_change = False
                undone, self._change = self._change, _Change()
                self.sessions[(ws, sid)] = before[0]
                self.turn_seq = before[1]
                del self._outbox[before[2] :]
                for key in undone.answers:
                    self.answers.pop(key, None)
                self.answers.update(undone.dropped)
                if isinstance(exc, HostError) or not isinstance(exc, Exception):
                    raise
                log.exception("agent host: a call failed; nothing of it was kept")
                raise HostError(500, "server_error") from None
            done, self._change, self._in_change = self._change, _Change(), False
            self._log_effects(done.effects)
            for start in done.starts:
                start()
        self._send_reports()
        return answer

    def _log_effects(self, effects: list[dict]) -> None:
        if self.effects_log is None or not effects:
            return
        try:
            with self.effects_log.open("a") as out:
                out.writelines(json.dumps(e) + "\n" for e in effects)
        except OSError:
            log.exception("agent host: the effects log could not be written")

    def _keep_answer(self, key: str, answer: dict) -> dict:
        self.answers[key] = answer
        self._change.answers.append(key)
        return answer

    def _drop_answer(self, key: str) -> None:
        """The answer kept for `key` goes (put back if the change fails)."""
        if key in self.answers:
            self._change.dropped[key] = self.answers.pop(key)

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

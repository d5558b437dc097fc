"""The simulated agent host: it records every call and effect, keeps its sessions, runs its
timers and sends its reports, and answers the `/sim/` control and snapshot endpoints."""

import threading
import time
from typing import Any

from ...host.agent_host import AgentHost
from ...host.reports import Reporter
from ...host.sessions import HostSession, Turn
from . import endpoints
from .agent import SimAgent
from .faults import HostFaults
from .sessions import SimError, SimSettings


class Simulator(AgentHost):
    """An agent host on the host kit (host/agent_host.py) with the simulated agent
    (agent.py): the kit answers every call; the simulator records each call and effect in
    memory, fails, delays or holds calls as its faults say (faults.py), and its `/sim/`
    endpoints change sessions behind the protocol's back. Its sessions live in its process:
    a new epoch (a restart, a resume after offline) forgets fences, turns, runs and prompt
    keys, and the workers give the fences again (docs/protocol.md: epochs)."""

    TOKENLESS = True  # tests run it without a token: its reports then go unsigned

    def __init__(
        self, reporter: Reporter | None = None, host_id: str = "default", token: str | None = None
    ) -> None:
        super().__init__(SimAgent(), token=token, host_id=host_id, reporter=reporter)
        # Notified after each protocol call, for pollers that wait for new effects.
        self.changed = threading.Condition(self.lock)
        # Failures, latency, holds and trickles set through /sim/ (reset with the rest).
        self.faults = HostFaults(self.changed)
        # After close(): no timer fires, no report goes out (see close).
        self.closed = False
        self._timers: set[threading.Timer] = set()
        self.reset()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop reporting: the pending timers (turns that would settle, goals that would
        apply later) are cancelled, and reports already on their way are waited for, so that
        the reporter (a publisher, with its broker connection) can be closed after this."""
        with self.lock:
            self.closed = True
            for timer in self._timers:
                timer.cancel()
            self._timers.clear()
        super().close(timeout_s)

    def reset(self) -> None:
        with self.lock:
            self.sessions = {}
            self.settings: dict[tuple[str, str], SimSettings] = {}
            self.answers = {}
            self.effects: list[dict] = []
            self.calls: list[dict] = []
            self.faults.reset()
            self.defaults: dict[str, Any] = {}

    def settings_of(self, ws: str, sid: str) -> SimSettings:
        found = self.settings.get((ws, sid))
        if found is None:
            knobs = {k: v for k, v in self.defaults.items() if k != "live"}
            found = self.settings[(ws, sid)] = SimSettings(**knobs)
        return found

    def session(self, ws: str, sid: str) -> HostSession:
        found = self.sessions.get((ws, sid))
        if found is None:
            live = self.defaults.get("live", True)
            found = self.sessions[(ws, sid)] = HostSession(ws, sid, live=live)
        return found

    # -- the kit's hooks -----------------------------------------------------------------------
    def new_turn_id(self, s: HostSession) -> str:
        """With `numbered_turns`, the session's process numbers its turns from 1 (again
        after a restart, and at each host): the control plane tells them apart by (host,
        epoch, turn id)."""
        settings = self.settings_of(s.workspace_id, s.session_id)
        if not settings.numbered_turns:
            return super().new_turn_id(s)
        settings.turn_number += 1
        return f"turn-{settings.turn_number}"

    def _end_process(self, s: HostSession) -> None:
        """What the old process held in memory goes with it: fences, runs and prompt keys
        too (a host with nothing on disk)."""
        super()._end_process(s)
        s.fences, s.runs, s.prompts = [], {}, {}
        self.settings_of(s.workspace_id, s.session_id).turn_number = 0

    def _new_epoch(self, s: HostSession) -> None:
        """A resume after offline: a new process, silent (the resume's answer tells it)."""
        self._end_process(s)
        s.live, s.runtime_epoch = True, s.runtime_epoch + 1

    def _report_turn(self, s: HostSession, turn: Turn) -> None:
        """A goal turn's start goes out `report_delay_ms` late if the session says so."""
        delay_ms = self.settings_of(s.workspace_id, s.session_id).report_delay_ms
        if turn.origin != "goal_continuation" or turn.phase == "settled" or not delay_ms:
            super()._report_turn(s, turn)
            return
        self.later(delay_ms, self.post, self.signed(s, turn=turn.reported()))

    def _log_effects(self, effects: list[dict]) -> None:
        self.effects.extend(effects)

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
        try:
            with self.lock:
                missing = self.settings_of(ws, sid).missing
            if missing:
                raise SimError(404, "session_not_found")
            return super().handle(call, ws, sid, body)
        finally:
            with self.lock:
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

    def send_report(self, report: dict) -> None:
        """A report as it is (a test's own), sent after the ones before it; one without
        `session` names this host and the session's epoch, and with a token it is signed."""
        if "session" not in report:
            s = self.sessions.get((report["workspace_id"], report["session_id"]))
            facts = {"host_id": self.host_id}
            if s is not None:
                facts["runtime_epoch"] = s.runtime_epoch
            report = {**report, "session": facts}
        self.post(self.sign(report))

    def post(self, report: dict) -> None:
        """A report made earlier (signed, if it is to be), sent now after those before it."""
        with self.lock:
            self._outbox.append(report)
        self._send_reports()

    # -- /sim/ (endpoints.py) ------------------------------------------------------------------
    def control(self, path: str, body: dict) -> dict:
        return endpoints.control(self, path, body)

    def snapshot(self, path: str, since: int = 0, wait_s: float = 0.0) -> dict:
        return endpoints.snapshot(self, path, since, wait_s)

"""`agent-radar host-check URL`: the agent-host protocol's promises (docs/protocol.md: what a
host must guarantee), checked against a running host in any language, one line per promise,
pass or fail with the evidence (docs/host-check.md).

Every call goes to sessions of a workspace of the check's own (`host-check-<run>`), so a host
in use is not disturbed. Two promises need the session's state changed under the host — an
offline session, a restart — which only the host itself can do: with `--test-hooks` the
check asks for them through the simulator's control calls (`POST /sim/sessions/{ws}/{sid}`
with `{"live": false}` or `{"restart": true}`), which a host under test may offer; without,
those lines say what was not checked.
"""

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..adapters.http_runtime import HttpRuntime
from ..errors import RuntimeDisconnected, RuntimeFault
from ..escape import escape
from .host_reports import ReportFault, check_reports

PASS, FAIL, SKIP = "pass", "fail", "skip"
# A line's evidence is cut here: a host's answers (up to 1 MiB each) are quoted in it.
MAX_EVIDENCE_CHARS = 400


@dataclass
class Line:
    promise: str
    verdict: str
    evidence: str

    def __post_init__(self) -> None:
        if len(self.evidence) > MAX_EVIDENCE_CHARS:
            self.evidence = self.evidence[:MAX_EVIDENCE_CHARS] + "…"

    def __str__(self) -> str:
        return f"{self.verdict.upper():4} {self.promise}: {escape(self.evidence)}"


class Failed(Exception):
    """A promise broken, with the evidence."""


@dataclass
class HostCheck:
    url: str
    token: str | None = None
    deadline_s: float = 10.0
    test_hooks: bool = False
    workspace: str = field(default_factory=lambda: f"host-check-{uuid.uuid4().hex[:8]}")
    reports_from: str | None = None  # a broker the host reports to that no worker reads
    reports_prefix: str = ""  # the Redis key prefix the host publishes under
    host_id: str = "default"  # the id the host signs its reports with
    reports_wait_s: float = 10.0
    slowest_s: float = 0.0
    answered: int = 0
    # What the host must have reported of the calls so far (host_reports.check_reports).
    due: dict[str, Callable[[list[dict]], bool]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.host = self._port()
        self._next_op = 0

    def _port(self) -> HttpRuntime:
        # One per promise: its circuit breaker (adapters/bulkhead.py) must not carry one
        # promise's failures into the next line's evidence.
        return HttpRuntime(self.url, self.token, timeout_s=self.deadline_s)

    # -- calls --------------------------------------------------------------------------
    def _timed(self, call: Callable[[], Any]) -> Any:
        started = time.monotonic()
        try:
            answer = call()
        except (RuntimeFault, RuntimeDisconnected) as exc:
            if exc.http_status is not None:  # a refusal is an answer too
                self.answered += 1
            raise
        finally:
            self.slowest_s = max(self.slowest_s, time.monotonic() - started)
        self.answered += 1
        return answer

    def goal(self, sid: str, revision: int, op: str | None = None, **more: Any) -> dict:
        op = op or self.op_id()
        call = {"action": "set", "objective": f"goal {revision}", "require_live": True} | more
        return self._timed(
            lambda: self.host.apply_goal(
                self.workspace,
                sid,
                operation_id=op,
                revision=revision,
                client_submit_id=op,
                **call,
            )
        )

    def refused(self, call: Callable[[], Any]) -> RuntimeFault | RuntimeDisconnected | None:
        """The refusal a call (timed by the caller: `goal`, `_timed`) got, or None."""
        try:
            call()
        except (RuntimeFault, RuntimeDisconnected) as exc:
            return exc
        return None

    def op_id(self) -> str:
        self._next_op += 1
        return f"{self.workspace}-op-{self._next_op}"

    def hook(self, sid: str, **change: Any) -> dict:
        return self.host.request("POST", f"/sim/sessions/{self.workspace}/{sid}", change)

    # -- the promises ---------------------------------------------------------------------
    def answers_shapes(self) -> str:
        live = self._timed(lambda: self.host.liveness(self.workspace, "shapes"))
        state = self._timed(lambda: self.host.session_state(self.workspace, "shapes"))
        answer = self.goal("shapes", 1)
        self._turns_listed("shapes")
        goal = answer.get("goal")
        if answer["phase"] == "applied" and goal != {"objective": "goal 1", "status": "active"}:
            raise Failed(f"a set answered goal {goal!r}; exactly {{objective, status}} is due")
        return f"liveness {live}, state live={state.live}, goal answer {answer['phase']}"

    def idempotent(self) -> str:
        op = self.op_id()
        first = self.goal("idempotent", 1, op)
        try:
            second = self.goal("idempotent", 1, op)
        except (RuntimeFault, RuntimeDisconnected) as exc:
            raise Failed(f"the same operation_id again was refused: {exc}") from None
        if second != first:
            raise Failed(f"the same operation_id answered {second!r}, first {first!r}")
        return "the same operation_id twice: the same answer"

    def keyed_calls(self) -> str:
        """A prompt, a turn's cancel and a maintenance run, each sent twice with its key."""
        ws, prompt = self.workspace, self.op_id()
        turns = [
            self._timed(lambda: self.host.submit_prompt(ws, "keyed", prompt_id=prompt, text="hi"))
            for _ in range(2)
        ]
        if turns[0] != turns[1]:
            raise Failed(f"the same prompt_id twice answered {turns[0]!r} and {turns[1]!r}")
        cancel, turn_id = self.op_id(), turns[0]["turn_id"]
        call = {"operation_id": cancel, "reason": "host-check", "require_live": True}
        cancels = [
            self._timed(lambda: self.host.cancel_turn(ws, "keyed", turn_id, **call))
            for _ in range(2)
        ]
        if cancels[0] != cancels[1]:
            raise Failed(f"the same cancel twice answered {cancels[0]!r} and {cancels[1]!r}")
        self.due[f"the prompt's turn {turn_id}: its start"] = _turn_reported(
            "keyed", turn_id, ("submitted", "running")
        )
        self.due[f"its end ({cancels[0].get('result')})"] = _turn_reported(
            "keyed", turn_id, ("settled",)
        )
        run = self.op_id()
        for _ in range(2):
            self._run("keyed-run", run)
        state = self._timed(lambda: self.host.maintenance_status(ws, "keyed-run", run))
        return f"prompt, cancel and maintenance run twice each: one turn, {state['state']} run"

    def _run(self, sid: str, run_id: str) -> dict:
        start = {"run_id": run_id, "kind": "compact", "args": {}}
        return self._timed(lambda: self.host.start_maintenance(self.workspace, sid, **start))

    def _prompt(self, sid: str) -> dict:
        ask = {"prompt_id": self.op_id(), "text": "hi"}
        return self._timed(lambda: self.host.submit_prompt(self.workspace, sid, **ask))

    def one_at_a_time(self) -> str:
        """A prompt and a goal beside a running run, a run and a prompt beside a turn: busy."""
        run = self.op_id()
        self._run("one-run", run)
        prompt = self.refused(lambda: self._prompt("one-run"))
        beside = [prompt, self.refused(lambda: self.goal("one-run", 1))]
        running = self._timed(lambda: self.host.maintenance_status(self.workspace, "one-run", run))
        if None in beside and running["state"] == "running":
            raise Failed("a prompt or goal landed beside a running maintenance run; 409 busy due")
        turn = self._prompt("one-turn")["turn_id"]
        prompt = self.refused(lambda: self._prompt("one-turn"))
        beside += [self.refused(lambda: self._run("one-turn", self.op_id())), prompt]
        listed = self._timed(lambda: self.host.session_state(self.workspace, "one-turn")).turns
        if None in beside[2:] and turn in {t.turn_id for t in listed}:
            raise Failed(f"a run or a prompt started beside turn {turn}; 409 busy due")
        if None in beside:
            raise Skipped("the run or the turn ended before the second call: ask a slower one")
        codes = [fault.code for fault in beside if fault is not None]
        return f"a prompt and a goal beside a run, a run and a prompt beside a turn: {codes}"

    def late_start(self) -> str:
        """A run cancelled before the host knew it: `404 not_found`, and its start refused."""
        run = self.op_id()
        cancel = lambda: self.host.cancel_maintenance(self.workspace, "late", run)  # noqa: E731
        fault = self.refused(lambda: self._timed(cancel))
        if not isinstance(fault, RuntimeFault) or fault.code != "not_found":
            raise Failed(f"a cancel of a run never started was {fault or 'answered'}; 404 due")
        fault = self.refused(lambda: self._run("late", run))
        if fault is None:
            raise Failed("a run cancelled before its start came started: it must be refused")
        return f"a cancel of a run not known: 404; its start after: {fault.code}"

    def forward_only(self) -> str:
        self.goal("forward", 2)
        fault = self.refused(lambda: self.goal("forward", 1))
        if not isinstance(fault, RuntimeFault) or fault.code != "stale_revision":
            raise Failed(f"revision 1 after 2 was {fault or 'applied'}; 409 stale_revision due")
        if fault.current_revision != 2:
            raise Failed(f"stale_revision said current_revision {fault.current_revision}, not 2")
        return "revision 1 after 2: 409 stale_revision, current_revision 2"

    def fence_holds(self) -> str:
        fenced = self.op_id()
        self._fence("fence", fenced, 3)
        fault = self.refused(lambda: self.goal("fence", 3, fenced))
        if not isinstance(fault, RuntimeFault) or fault.code != "rejected":
            raise Failed(f"the fenced generation was {fault or 'applied'}; 422 rejected due")
        return "the fenced generation: 422 rejected"

    def _fence(self, sid: str, op: str, revision: int) -> dict:
        return self._timed(
            lambda: self.host.install_fence(
                self.workspace,
                sid,
                target_operation_id=op,
                target_revision=revision,
                require_live=True,
            )
        )

    def require_live(self) -> str:
        self.goal("offline", 1)
        self.hook("offline", live=False, report=True)
        fault = self.refused(lambda: self.goal("offline", 2))
        if not isinstance(fault, RuntimeDisconnected):
            raise Failed(f"a require_live goal call to an offline session was {fault or 'applied'}")
        live = self._timed(lambda: self.host.liveness(self.workspace, "offline"))
        if live.get("live"):
            raise Failed("the session was woken by a require_live call")
        self.due["a session gone offline"] = lambda reports: any(
            r["session_id"] == "offline" and (r.get("session") or {}).get("live") is False
            for r in reports
        )
        return "an offline session: 409 disconnected, and it stays offline"

    def fence_across_restart(self) -> str:
        fenced = self.op_id()
        # The state call's epoch (required there; the liveness answer may leave it out).
        before = self._timed(lambda: self.host.session_state(self.workspace, "restart"))
        self._fence("restart", fenced, 4)
        self.hook("restart", restart=True, report=True)
        after = self._timed(lambda: self.host.session_state(self.workspace, "restart"))
        if after.runtime_epoch > before.runtime_epoch:
            epoch = after.runtime_epoch
            self.due[f"the new epoch {epoch}"] = lambda reports: any(
                r["session_id"] == "restart"
                and (r.get("session") or {}).get("runtime_epoch") == epoch
                for r in reports
            )
            # The host may forget what it held, if it says so: at a new epoch agent-radar
            # installs every fence again before anything else reaches the session.
            return f"a restart moved the epoch ({before.runtime_epoch} -> {after.runtime_epoch})"
        fault = self.refused(lambda: self.goal("restart", 4, fenced))
        if isinstance(fault, RuntimeFault) and fault.code == "rejected":
            return "after a restart at the same epoch the fence still holds"
        raise Failed(
            f"after a restart at the same epoch ({after.runtime_epoch}) the fenced "
            f"generation was {fault or 'applied'}"
        )

    def auth(self) -> str:
        if not self.token:
            raise Skipped("no --token given: a host must refuse calls without its token")
        anonymous = HttpRuntime(self.url, None, timeout_s=self.deadline_s)
        fault = self.refused(
            lambda: self._timed(lambda: anonymous.liveness(self.workspace, "auth"))
        )
        wrong = HttpRuntime(self.url, self.token + "-wrong", timeout_s=self.deadline_s)
        forged = self.refused(lambda: self._timed(lambda: wrong.liveness(self.workspace, "auth")))
        for name, got in (("no token", fault), ("a wrong token", forged)):
            if not isinstance(got, RuntimeFault) or got.http_status not in (401, 403):
                raise Failed(f"a call with {name} was {got or 'answered'}; 401 or 403 due")
        return "no token and a wrong one: refused"

    def _turns_listed(self, sid: str) -> None:
        """Each turn the state call lists must have had its start reported."""
        listed = self._timed(lambda: self.host.session_state(self.workspace, sid)).turns
        for turn in listed:
            name = f"the start of turn {turn.turn_id} of {sid}, which the state call listed"
            self.due[name] = _turn_reported(sid, turn.turn_id, ("submitted", "running"))

    def reports(self) -> str:
        if not self.reports_from:
            raise Skipped(
                "needs --reports-from BROKER_URL, a broker the host reports to and no worker "
                "reads (docs/host-check.md)"
            )
        if not self.token:
            raise Skipped("no --token given: a report is signed with the host's token")
        if not self.due:
            raise Failed("no call that a host must report on was answered")
        try:
            return check_reports(
                self.reports_from,
                self.workspace,
                self.host_id,
                self.token,
                self.due,
                self.reports_wait_s,
                self.reports_prefix,
            )
        except ReportFault as exc:
            raise Failed(str(exc)) from None

    def run(self) -> list[Line]:
        lines = []
        promises: list[tuple[str, Callable[[], str], bool]] = [
            ("answers have their documented shapes", self.answers_shapes, False),
            ("idempotent by operation_id", self.idempotent, False),
            ("prompts, cancels and runs idempotent by their keys", self.keyed_calls, False),
            ("one thing at a time", self.one_at_a_time, False),
            ("a run cancelled before its start never starts", self.late_start, False),
            ("revisions only move forward", self.forward_only, False),
            ("a fence holds", self.fence_holds, False),
            ("require_live never wakes a session", self.require_live, True),
            ("a fence holds across a restart, or the epoch moves", self.fence_across_restart, True),
            ("calls need the host's token", self.auth, False),
            ("reports are signed, well formed and sent", self.reports, False),
        ]
        for promise, check, needs_hooks in promises:
            if needs_hooks and not self.test_hooks:
                lines.append(Line(promise, SKIP, "needs --test-hooks (docs/host-check.md)"))
                continue
            self.host = self._port()
            lines.append(self._one(promise, check))
        within = self.answered > 0 and self.slowest_s <= self.deadline_s
        timing = f"slowest {self.slowest_s * 1000:.0f} ms of {self.deadline_s:g} s"
        lines.append(
            Line(
                "every answer within the deadline",
                PASS if within else FAIL,
                timing if self.answered else "no call was answered at all",
            )
        )
        return lines

    @staticmethod
    def _one(promise: str, check: Callable[[], str]) -> Line:
        try:
            return Line(promise, PASS, check())
        except Skipped as exc:
            return Line(promise, SKIP, str(exc))
        except Failed as exc:
            return Line(promise, FAIL, str(exc))
        except (RuntimeFault, RuntimeDisconnected) as exc:
            return Line(promise, FAIL, f"a call failed: {exc}")
        except Exception as exc:  # noqa: BLE001 - an answer no check foresaw: that line fails
            return Line(promise, FAIL, f"{exc.__class__.__name__}: {exc}")


class Skipped(Exception):
    """A promise this run cannot check, and why."""


def _turn_reported(sid: str, turn_id: str, phases: tuple[str, ...]):
    def met(reports: list[dict]) -> bool:
        return any(
            r["session_id"] == sid
            and (r.get("turn") or {}).get("turn_id") == turn_id
            and (r.get("turn") or {}).get("phase") in phases
            for r in reports
        )

    return met


def check_host(
    url: str,
    token: str | None = None,
    deadline_s: float = 10.0,
    test_hooks: bool = False,
    reports_from: str | None = None,
    host_id: str = "default",
    reports_wait_s: float = 10.0,
    reports_prefix: str = "",
) -> list[Line]:
    return HostCheck(
        url,
        token,
        deadline_s,
        test_hooks,
        reports_from=reports_from,
        host_id=host_id,
        reports_wait_s=reports_wait_s,
        reports_prefix=reports_prefix,
    ).run()

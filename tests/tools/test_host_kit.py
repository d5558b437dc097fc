"""The host kit (`agent_radar.host`, docs/hosts.md): the protocol's promises kept for the agent,
across a restart of the process too; bad calls refused with nothing changed; every report
signed, as a worker takes it. The example hosts behind real workers are
tests/end_to_end/test_example_hosts.py."""

import json
import threading
import time

import pytest

from agent_radar.host import AgentHost, HostError, TimerAgent
from agent_radar.models.base import utcnow
from agent_radar.workflows.activity.activity import parse_report
from agent_radar.workflows.adapters.report_auth import signature_ok
from agent_radar.workflows.host.reports import ReportSender
from tests.helpers import eventually

TOKEN = "kit-token"
WS, SID = "ws-kit", "s1"


@pytest.fixture
def backend():
    return "embedded"  # no database or broker: the kit is the host's side


class Still(TimerAgent):
    """An agent whose turns and runs go on until they are cancelled (no timers)."""

    def start_turn(self, host, session, turn):
        pass

    def start_run(self, host, session, run):
        pass


class Later(Still):
    """An agent that takes every goal later (`host.goal_applied`, called by the test)."""

    def takes_goal(self, host, session, goal):
        return False


def kit(tmp_path, reports=None, agent=None):
    """A host on the kit, with an agent whose turns and runs go on until cancelled unless the
    test gives another."""
    return AgentHost(
        agent or Still(),
        token=TOKEN,
        host_id="gpu-1",
        state_file=tmp_path / "state.json",
        reporter=None if reports is None else reports.append,
        effects_log=tmp_path / "effects.jsonl",
    )


def goal(host, op, revision, action="set", **more):
    body = {
        "operation_id": op,
        "action": action,
        "objective": f"goal {revision}" if action == "set" else None,
        "revision": revision,
        "client_submit_id": op,
        "require_live": True,
    }
    return host.handle("goal", WS, SID, body | more)


def effects(tmp_path):
    path = tmp_path / "effects.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_restart_keeps_goals_fences_and_answers_and_moves_the_epoch(tmp_path):
    reports: list[dict] = []
    host = kit(tmp_path, reports)
    first = goal(host, "op-1", 1)
    assert first == {
        "phase": "applied",
        "goal": {"objective": "goal 1", "status": "active"},
        "evidence": {"applied_revision": 1},
    }
    host.handle("goal-fences", WS, SID, {"target_operation_id": "op-1", "target_revision": 1})
    assert host.handle("state", WS, SID, {})["turns"]  # the goal's turn runs

    again = kit(tmp_path, reports)  # the process restarts
    state = again.handle("state", WS, SID, {})
    assert (state["runtime_epoch"], state["turns"]) == (2, [])
    assert state["goal"] == {
        "operation_id": "op-1",
        "revision": 1,
        "objective": "goal 1",
        "status": "active",
    }
    assert state["fences"] == [{"target_operation_id": "op-1", "target_revision": 1}]
    assert goal(again, "op-1", 1) == first  # a retry: its answer, no second effect
    with pytest.raises(HostError) as stale:
        goal(again, "op-0", 1)
    assert (stale.value.code, stale.value.extra) == ("stale_revision", {"current_revision": 1})
    assert [e["kind"] for e in effects(tmp_path)] == ["goal", "fence"]
    eventually(
        lambda: any((r.get("session") or {}).get("runtime_epoch") == 2 for r in reports),
        what="the new epoch's report",
    )


def test_fences_require_live_and_keys_hold(tmp_path):
    host = kit(tmp_path, agent=TimerAgent(turn_s=5, run_s=0.05))  # its run ends
    host.handle("goal-fences", WS, SID, {"target_operation_id": "op-5", "target_revision": 5})
    with pytest.raises(HostError) as fenced:
        goal(host, "op-5", 5)
    assert (fenced.value.status, fenced.value.code) == (422, "rejected")
    turn = host.handle("prompts", WS, SID, {"prompt_id": "p-1", "text": "hi"})
    assert host.handle("prompts", WS, SID, {"prompt_id": "p-1", "text": "hi"}) == turn
    cancel = {"operation_id": "c-1", "reason": "test", "require_live": True}
    answer = host.handle(f"turns/{turn['turn_id']}/cancel", WS, SID, cancel)
    assert answer == {"result": "canceled"}
    assert host.handle(f"turns/{turn['turn_id']}/cancel", WS, SID, cancel) == answer
    host.go_offline(WS, SID)
    with pytest.raises(HostError) as offline:
        goal(host, "op-6", 6)
    assert offline.value.code == "disconnected"
    assert host.handle("liveness", WS, SID, {})["live"] is False
    resumed = host.handle("resume", WS, SID, {"fences": []})
    assert resumed == {"live": True, "runtime_epoch": 2}
    run = {"run_id": "r-1", "kind": "compact", "args": {}}
    assert host.handle("maintenance", WS, SID, run) == {"state": "running"}
    assert host.handle("maintenance", WS, SID, run) == {"state": "running"}
    done = eventually(
        lambda: (a := host.handle("maintenance/r-1", WS, SID, {}))["state"] == "done" and a,
        what="the run's end",
    )
    assert done["applied"] is True and done["cancelled"] is False
    kinds = [e["kind"] for e in effects(tmp_path)]
    assert (kinds.count("prompt"), kinds.count("cancel"), kinds.count("maintenance")) == (1, 1, 1)


@pytest.mark.parametrize(
    "call, body",
    [
        ("goal", {"operation_id": "op-1", "action": "set", "revision": "1"}),
        ("goal", {"operation_id": "op-1", "action": "explode", "revision": 1}),
        ("goal", {"operation_id": "", "action": "set", "revision": 1, "objective": "x"}),
        ("goal", {"operation_id": "op-1", "action": "set", "revision": True, "objective": "x"}),
        ("goal-fences", {"target_operation_id": "op-1", "target_revision": -1}),
        ("prompts", {"prompt_id": "p-1", "text": 7}),
        ("maintenance", {"run_id": "r-1", "kind": "compact", "args": [1]}),
        ("resume", {"fences": "all"}),
        # One good fence and one bad: neither is held.
        ("resume", {"fences": [{"target_operation_id": "a", "target_revision": 3}, {"x": 1}]}),
        ("goal-fences", {"target_operation_id": "op-1", "target_revision": 0}),
        ("goal", {"operation_id": "x" * 256, "action": "clear", "revision": 2}),
        ("maintenance", {"run_id": "r-1", "kind": "rm -rf", "args": {}}),
        ("maintenance", {"run_id": "r-1", "kind": "summarize_up_to", "args": {"turn": "all"}}),
        ("turns/t-1/cancel", {"reason": "no operation id"}),
    ],
)
def test_a_bad_call_is_refused_and_changes_nothing(tmp_path, call, body):
    host = kit(tmp_path)
    goal(host, "op-0", 1)
    before = (tmp_path / "state.json").read_text(), effects(tmp_path)
    state = host.handle("state", WS, SID, {})
    with pytest.raises(HostError) as refused:
        host.handle(call, WS, SID, body)
    assert (refused.value.status, refused.value.code) == (422, "rejected")
    assert ((tmp_path / "state.json").read_text(), effects(tmp_path)) == before
    assert host.handle("state", WS, SID, {}) == state


def test_every_report_is_signed_and_taken_as_a_worker_takes_it(tmp_path):
    reports: list[dict] = []
    host = kit(tmp_path, reports, TimerAgent(turn_s=0.05))  # its turn ends on its own
    goal(host, "op-1", 1)
    eventually(lambda: any(r.get("turn", {}).get("phase") == "settled" for r in reports))
    host.go_offline(WS, SID)
    eventually(lambda: (reports[-1].get("session") or {}).get("live") is False)
    phases = [r["turn"]["phase"] for r in reports if "turn" in r]
    assert phases == ["running", "settled"]
    for report in reports:
        assert report["signed_by"] == "gpu-1" and signature_ok(report, TOKEN)
        parse_report(report, utcnow())  # refused reports raise
    assert reports[-1]["session"] == {"host_id": "gpu-1", "live": False, "runtime_epoch": 1}


def test_prompts_and_runs_keep_their_answers_across_a_resume_and_a_restart(tmp_path):
    """The same prompt_id or run_id again — a worker's retry across the session's new
    process — gets the same answer and starts nothing new."""
    host = kit(tmp_path)  # the run is still on when its process ends
    turn = host.handle("prompts", WS, SID, {"prompt_id": "p-1", "text": "hi"})
    run = {"run_id": "r-1", "kind": "compact", "args": {}}
    host.handle("maintenance", WS, "s-run", run)  # a session with no turn running
    for sid in (SID, "s-run"):
        host.go_offline(WS, sid)
        host.handle("resume", WS, sid, {"fences": []})
    assert host.handle("prompts", WS, SID, {"prompt_id": "p-1", "text": "hi"}) == turn
    again = kit(tmp_path)
    assert again.handle("prompts", WS, SID, {"prompt_id": "p-1", "text": "hi"}) == turn
    assert again.handle("maintenance", WS, "s-run", run) == {"state": "running"}
    kinds = [e["kind"] for e in effects(tmp_path)]
    assert (kinds.count("prompt"), kinds.count("maintenance")) == (1, 1)
    status = again.handle("maintenance/r-1", WS, "s-run", {})
    assert status["state"] == "done" and status["applied"] is False  # its process ended


def test_one_thing_at_a_time_and_a_run_cancelled_before_it_came_never_starts(tmp_path):
    """A run or a prompt waits for an idle session, a goal for the run's end (409 busy,
    nothing changed); a cancel of a run the host does not know answers 404 and refuses that run's
    start from then on, across a restart of the host too (docs/protocol.md)."""
    host = kit(tmp_path)
    run = {"run_id": "r-1", "kind": "compact", "args": {}}
    host.handle("prompts", WS, SID, {"prompt_id": "p-1", "text": "hi"})  # its turn runs on
    for call, body in (("maintenance", run), ("prompts", {"prompt_id": "p-9", "text": "too"})):
        with pytest.raises(HostError) as busy:
            host.handle(call, WS, SID, body)
        assert (busy.value.status, busy.value.code) == (409, "busy")
    host.handle("maintenance", WS, "s2", run)
    with pytest.raises(HostError) as busy:
        host.handle("prompts", WS, "s2", {"prompt_id": "p-2", "text": "beside it?"})
    assert (busy.value.status, busy.value.code) == (409, "busy")
    with pytest.raises(HostError) as busy:
        host.handle("goal", WS, "s2", {"operation_id": "g-1", "action": "clear", "revision": 1})
    assert (busy.value.status, busy.value.code) == (409, "busy")
    assert host.handle("maintenance", WS, "s2", run) == {"state": "running"}  # its own key
    with pytest.raises(HostError) as unknown:
        host.handle("maintenance/r-late/cancel", WS, "s3", {})
    assert (unknown.value.status, unknown.value.code) == (404, "not_found")
    with pytest.raises(HostError) as too_long:  # past the protocol's bound: nothing kept
        host.handle(f"maintenance/{'r' * 256}/cancel", WS, "s3", {})
    assert (too_long.value.status, too_long.value.code) == (422, "rejected")
    assert set(host.session(WS, "s3").runs) == {"r-late"}
    again = kit(tmp_path)
    late = {"run_id": "r-late", "kind": "compact", "args": {}}
    with pytest.raises(HostError) as refused:
        again.handle("maintenance", WS, "s3", late)
    assert (refused.value.status, refused.value.code) == (422, "rejected")
    with pytest.raises(HostError) as status:
        again.handle("maintenance/r-late", WS, "s3", {})
    assert status.value.code == "not_found"
    assert again.handle("state", WS, "s3", {})["maintenance"] is None
    kinds = [(e["kind"], e["session_id"]) for e in effects(tmp_path)]
    assert kinds == [("prompt", SID), ("maintenance", "s2")]


def test_an_offline_session_stays_offline_across_a_restart(tmp_path):
    host = kit(tmp_path)
    goal(host, "op-1", 1)
    host.go_offline(WS, SID)
    again = kit(tmp_path)
    assert again.handle("liveness", WS, SID, {}) == {"live": False, "runtime_epoch": 1}
    with pytest.raises(HostError) as offline:
        again.handle("prompts", WS, SID, {"prompt_id": "p-1", "text": "hi"})
    assert offline.value.code == "disconnected"


def test_a_failed_save_keeps_nothing_and_answers_a_retryable_error(tmp_path):
    """The state file cannot be written (a full disk): the call answers 500, nothing of it
    is kept in memory or reaches the agent, and the worker's retry applies it once."""
    started = []

    class Agent(TimerAgent):
        def start_turn(self, host, session, turn):
            started.append(turn.turn_id)

    host = AgentHost(Agent(), token=TOKEN, state_file=tmp_path / "state.json")
    goal(host, "op-1", 1)
    (tmp_path / "state.tmp").mkdir()  # where the file is written first: now it cannot be
    with pytest.raises(HostError) as failed:
        goal(host, "op-2", 2)
    assert (failed.value.status, failed.value.code) == (500, "server_error")
    assert host.handle("state", WS, SID, {})["goal"]["revision"] == 1
    assert "op-2" not in host.answers and len(started) == 1
    (tmp_path / "state.tmp").rmdir()
    assert goal(host, "op-2", 2)["phase"] == "applied"
    assert len(started) == 2


def test_a_failing_agent_or_reporter_costs_no_promise(tmp_path):
    """An agent that cannot start a turn ends it `failed` (reported); a reporter that raises
    loses its report and nothing else; a reporter that stalls holds up no call."""
    import threading

    class Broken(TimerAgent):
        def start_turn(self, host, session, turn):
            raise RuntimeError("no model today")

    stalled = threading.Event()
    sent: list[dict] = []

    def reporter(report):
        if not sent:
            sent.append(report)
            stalled.wait(30)  # the broker stalls on the first report
            raise ConnectionError("broker away")
        sent.append(report)

    host = AgentHost(Broken(), token=TOKEN, reporter=reporter)
    answer = goal(host, "op-1", 1)
    assert answer["phase"] == "applied"
    assert goal(host, "op-1", 1) == answer
    assert host.handle("state", WS, SID, {})["turns"] == []  # it ended, failed
    assert host.handle("liveness", "ws-other", "s9", {})["live"] is True  # no call waits
    stalled.set()
    eventually(lambda: any(r.get("turn", {}).get("outcome") == "failed" for r in sent))


def test_a_host_needs_its_token():
    with pytest.raises(ValueError):
        AgentHost(TimerAgent(), token="")


def test_bodies_past_the_bound_or_unreadable_are_refused_over_http(tmp_path):
    import http.client

    server = kit(tmp_path).serve(port=0).start()
    try:
        host, port = server.httpd.server_address[:2]
        path = f"/v1/workspaces/{WS}/sessions/{SID}/goal"
        for length, body in (("-1", b"{}"), (str(2 << 20), b"{}"), ("40", b"[" * 40)):
            conn = http.client.HTTPConnection(host, port, timeout=5)
            conn.putrequest("POST", path)
            conn.putheader("Authorization", f"Bearer {TOKEN}")
            conn.putheader("Content-Length", length)
            conn.endheaders()
            conn.send(body)
            status = conn.getresponse().status
            conn.close()
            assert status in (413, 422), (length, status)
        deep = b"[" * 100_000
        conn = http.client.HTTPConnection(host, port, timeout=5)
        conn.request("POST", path, deep, {"Authorization": f"Bearer {TOKEN}"})
        assert conn.getresponse().status == 422  # too deep to read: refused, not a crash
        conn.close()
    finally:
        server.stop()


def test_an_agent_may_take_a_goal_later(tmp_path):
    """`takes_goal` False: the call answers `accepted` (the same answer again on a retry);
    `goal_applied` applies it and reports `goal_applied`, unless a newer revision got there
    first. At a new epoch a goal still accepted never takes effect: a retry applies it anew."""
    reports: list[dict] = []
    host = kit(tmp_path, reports, Later())
    accepted = goal(host, "op-1", 1)
    assert accepted == {"phase": "accepted", "goal": None, "evidence": {"acknowledged": True}}
    assert goal(host, "op-1", 1) == accepted
    assert host.handle("state", WS, SID, {})["goal"] is None
    assert host.goal_applied(WS, SID, "op-1") is True
    assert host.goal_applied(WS, SID, "op-1") is False  # once
    state = host.handle("state", WS, SID, {})
    assert (state["goal"]["operation_id"], state["goal"]["revision"]) == ("op-1", 1)
    assert [e["kind"] for e in effects(tmp_path)] == ["goal"]
    eventually(lambda: any("goal_applied" in r for r in reports), what="the goal_applied report")
    (applied,) = [r["goal_applied"] for r in reports if "goal_applied" in r]
    assert applied == {
        "operation_id": "op-1",
        "revision": 1,
        "goal": {"objective": "goal 1", "status": "active"},
    }
    parse_report([r for r in reports if "goal_applied" in r][0], utcnow())

    # Two accepted; the newer applied first: the older is dropped, never applied.
    goal(host, "op-2", 2)
    goal(host, "op-3", 3)
    assert host.goal_applied(WS, SID, "op-3") is True
    assert host.goal_applied(WS, SID, "op-2") is False
    assert host.handle("state", WS, SID, {})["goal"]["revision"] == 3

    # Accepted, then the session's process ends: it never takes effect, and a retry of the
    # same operation applies it anew.
    goal(host, "op-4", 4)
    host.restart(WS, SID)
    assert host.goal_applied(WS, SID, "op-4") is False
    host.agent = Still()
    assert goal(host, "op-4", 4)["phase"] == "applied"
    assert [e["revision"] for e in effects(tmp_path) if e["kind"] == "goal"] == [1, 3, 4]


def test_an_agent_may_pursue_goals_only_when_prompted_and_its_turn_ends_are_logged(tmp_path):
    """`continues_goal` False: a goal set is applied and starts no turn. A turn's end, on
    the agent's word or at a cancel, is an effect in the log, reported once."""
    reports: list[dict] = []

    class Prompted(Still):
        def continues_goal(self, host, session, goal):
            return False

    host = kit(tmp_path, reports, Prompted())
    assert goal(host, "op-1", 1)["phase"] == "applied"
    assert host.handle("state", WS, SID, {})["turns"] == []
    first = host.handle("prompts", WS, SID, {"prompt_id": "p-1", "text": "hi"})["turn_id"]
    assert host.settle(WS, SID, first) is True
    assert host.settle(WS, SID, first) is False  # once
    second = host.handle("prompts", WS, SID, {"prompt_id": "p-2", "text": "ho"})["turn_id"]
    cancel = {"operation_id": "c-1", "require_live": True}
    assert host.handle("turns/" + second, WS, SID, cancel) == {"result": "canceled"}
    ended = [(e["turn_id"], e["outcome"]) for e in effects(tmp_path) if e["kind"] == "turn_settled"]
    assert ended == [(first, "completed"), (second, "canceled")]
    (prompted,) = [e for e in effects(tmp_path) if e["kind"] == "prompt" and e["text"] == "ho"]
    assert prompted["turn_id"] == second
    assert [e["operation_id"] for e in effects(tmp_path) if e["kind"] == "cancel"] == ["c-1"]
    eventually(
        lambda: sum(r.get("turn", {}).get("phase") == "settled" for r in reports) == 2,
        what="the two ends reported",
    )
    settled = [r["turn"]["turn_id"] for r in reports if r.get("turn", {}).get("phase") == "settled"]
    assert settled == [first, second]


def _slow_reporter():
    """A reporter that holds each report until `release` is set (`sending` once it has one)."""
    reports: list[dict] = []
    sending, release = threading.Event(), threading.Event()

    def slow(report):
        sending.set()
        release.wait(5)
        reports.append(report)

    return reports, sending, release, slow


def test_a_closed_host_sends_what_was_on_its_way_and_nothing_more(tmp_path):
    """`close` waits for the reports already handed to the sender (the reporter can be
    closed after it); a report made after it goes nowhere."""
    reports, sending, release, slow = _slow_reporter()
    host = kit(tmp_path, agent=TimerAgent(turn_s=60))
    host.sender = ReportSender(slow)
    goal(host, "op-1", 1)  # its turn's start is reported
    assert sending.wait(5)
    closing = threading.Thread(target=host.close)
    closing.start()
    closing.join(0.3)
    assert closing.is_alive()  # waiting for the report on its way
    release.set()
    closing.join(5)
    assert not closing.is_alive()
    started = [r["turn"]["phase"] for r in reports]
    host.go_offline(WS, SID)  # reported, were it open
    assert [r["turn"]["phase"] for r in reports] == started == ["running"]


def test_a_call_undone_leaves_no_effect_behind(tmp_path):
    """Review: a call that failed after its effects were made (here the agent, deciding
    whether a goal starts a turn) kept them in the pending change, and the next turn's end
    logged them with its own: a goal at the host's log that never took effect, twice after
    the retry."""

    class Flaky(Still):
        fail = True

        def continues_goal(self, host, session, goal):
            if self.fail:
                raise RuntimeError("the agent fell over")
            return True

    agent = Flaky()
    host = kit(tmp_path, agent=agent)
    turn_id = host.handle("prompts", WS, SID, {"prompt_id": "p-1", "text": "hi"})["turn_id"]
    with pytest.raises(HostError) as failed:
        goal(host, "op-1", 1)
    assert failed.value.status == 500
    assert host.handle("state", WS, SID, {})["goal"] is None
    host.settle(WS, SID, turn_id)  # a turn's end, outside any call
    assert [e["kind"] for e in effects(tmp_path)] == ["prompt", "turn_settled"]
    agent.fail = False
    assert goal(host, "op-1", 1)["phase"] == "applied"
    assert [e["operation_id"] for e in effects(tmp_path) if e["kind"] == "goal"] == ["op-1"]


def test_a_goal_that_will_never_take_effect_is_answered_anew(tmp_path):
    """Review: a goal accepted while live, whose session was offline when the agent went to
    apply it, lost its pending entry but kept its `accepted` answer: every retry answered
    `accepted` and nothing ever applied it. Its answer goes with it."""
    host = kit(tmp_path, agent=Later())
    assert goal(host, "op-1", 1)["phase"] == "accepted"
    host.sessions[(WS, SID)].live = False  # offline, as a silent drop leaves it
    assert host.goal_applied(WS, SID, "op-1") is False
    host.sessions[(WS, SID)].live = True
    host.agent = Still()
    assert goal(host, "op-1", 1)["phase"] == "applied"
    # A newer revision applied first: the older one's retry is told it is stale.
    host.agent = Later()
    goal(host, "op-2", 2)
    goal(host, "op-3", 3)
    assert host.goal_applied(WS, SID, "op-3") is True
    assert host.goal_applied(WS, SID, "op-2") is False
    with pytest.raises(HostError) as stale:
        goal(host, "op-2", 2)
    assert (stale.value.status, stale.value.code) == (409, "stale_revision")


def test_settled_turns_and_many_fences_stay_bounded(tmp_path):
    """Review: every call copied its whole session, settled turns included, and a resume
    checked each fence against a list: 10,000 fences made each resume seconds long and every
    call slower. A resume holds each fence once; settled turns past the bound are let go
    (a cancel of one answers not_found, an end for the workers too)."""
    from agent_radar.workflows.host.sessions import SETTLED_TURNS_KEPT

    host = kit(tmp_path, agent=TimerAgent(turn_s=60))
    fences = [{"target_operation_id": f"op-{i}", "target_revision": 1} for i in range(10_000)]
    host.handle("resume", WS, SID, {"fences": fences})
    host.handle("resume", WS, SID, {"fences": fences})
    assert len(host.handle("state", WS, SID, {})["fences"]) == 10_000
    ids = []
    for i in range(2 * SETTLED_TURNS_KEPT + 5):
        ids.append(host.handle("prompts", WS, SID, {"prompt_id": f"p-{i}", "text": "x"})["turn_id"])
        host.settle(WS, SID, ids[-1])
    kept = host.sessions[(WS, SID)].turns
    assert SETTLED_TURNS_KEPT <= len(kept) <= 2 * SETTLED_TURNS_KEPT
    assert ids[-1] in kept and ids[0] not in kept
    with pytest.raises(HostError) as gone:
        host.handle("turns/" + ids[0], WS, SID, {"operation_id": "c-old"})
    assert gone.value.status == 404
    assert host.handle("turns/" + ids[-1], WS, SID, {"operation_id": "c-new"}) == {
        "result": "already_settled"
    }


def test_a_close_that_times_out_sends_nothing_more(tmp_path):
    """Review: `close` returned after its wait, and the reports still queued went out
    afterwards, after the reporter was closed. Only the one on its way when the wait ended
    goes; the rest are dropped."""
    reports, sending, release, slow = _slow_reporter()
    host = kit(tmp_path)
    host.sender = ReportSender(slow)
    for i in range(4):
        host.handle("prompts", WS, f"s-{i}", {"prompt_id": f"p-{i}", "text": "x"})
    assert sending.wait(5)
    host.close(timeout_s=0.2)
    release.set()
    eventually(lambda: reports, what="the report on its way")
    time.sleep(0.3)
    assert len(reports) == 1


def test_what_an_agent_gets_wrong_is_caught_where_it_happens(tmp_path):
    """Tried from the docs: an agent whose cancel said the turn had ended without settling
    it left the turn running in the state answer; a `finish` with a field the kit does not
    know raised a TypeError in the agent's thread and left the run running for good. The
    kit settles a turn its agent says has ended; a wrong `finish` ends the run with an
    error that says why, and raises where the agent called it."""

    class Sloppy(Still):
        def cancel_turn(self, host, session, turn):
            return True  # ended, but not settled

    host = kit(tmp_path, agent=Sloppy())
    turn_id = host.handle("prompts", WS, SID, {"prompt_id": "p-1", "text": "hi"})["turn_id"]
    cancel = {"operation_id": "c-1", "require_live": True}
    assert host.handle("turns/" + turn_id, WS, SID, cancel) == {"result": "canceled"}
    assert host.handle("state", WS, SID, {})["turns"] == []

    host.handle("maintenance", WS, SID, {"run_id": "r-1", "kind": "compact", "args": {}})
    with pytest.raises(ValueError, match="tokens"):
        host.finish(WS, SID, "r-1", applied=True, tokens=5)
    status = host.handle("maintenance/r-1", WS, SID, {})
    assert status["state"] == "done" and status["applied"] is False
    assert "tokens" in status["error"]

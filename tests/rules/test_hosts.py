"""Many agent hosts (docs/lifecycles.md: sessions), on both backends: the registry, sessions bound
to a host by their reports or by ensure_session(host_id=), every call sent to the session's host,
and a move to another host handled as a new runtime epoch there."""

import time

import pytest
from sqlalchemy import update

from agent_radar.models.base import utcnow
from agent_radar.models.db import run_transaction
from agent_radar.models.operations import GoalFence, GoalOperation
from agent_radar.models.tables import AgentSession, RuntimeHost, Turn
from agent_radar.workflows.errors import Conflict, InvalidArgument, NotFound, RuntimeFault
from agent_radar.workflows.steps.goals.dispatch import Dispatcher
from agent_radar.workflows.tools.simulator import SimControl
from tests.helpers import row_counts

WS = "ws-hosts"


def report(client, sid, **parts):
    client.report_activity(
        {"workspace_id": WS, "session_id": sid, "occurred_at_ms": int(time.time() * 1000), **parts}
    )


def session_row(client, sid):
    return run_transaction(client.engine, lambda s: s.get(AgentSession, (WS, sid)))


def turn_row(client, sid, turn_id):
    return run_transaction(client.engine, lambda s: s.get(Turn, (WS, sid, turn_id)))


def calls(control: SimControl, sid: str) -> list[str]:
    return [c["call"] for c in control.calls() if c["session_id"] == sid]


def dispatcher(client) -> Dispatcher:
    # The client's runtime is the production router: each call goes to its session's host.
    return Dispatcher(client.engine, client.runtime, worker_id="d", lease_s=5)


def test_the_registry_adds_lists_and_removes_hosts(client, sim_b):
    assert [(h.host_id, h.url) for h in client.list_hosts()] == [
        ("default", client.settings.runtime_url)
    ]
    added = client.add_host("host-b", sim_b.url + "/")
    assert (added.host_id, added.url, added.sessions) == ("host-b", sim_b.url, 0)
    assert client.add_host("host-b", sim_b.url) == added  # the same again: nothing changes
    with pytest.raises(Conflict):
        client.add_host("host-b", "http://127.0.0.1:1")
    moved = client.add_host("host-b", "http://127.0.0.1:1", replace=True)
    assert moved.url == "http://127.0.0.1:1"
    client.add_host("host-b", sim_b.url, replace=True)

    client.ensure_session(WS, "s1", host_id="host-b")
    assert [(h.host_id, h.sessions) for h in client.list_hosts()] == [
        ("default", 0),
        ("host-b", 1),
    ]
    with pytest.raises(Conflict, match="1 session"):
        client.remove_host("host-b")  # its session's calls would have nowhere to go
    client.ensure_session(WS, "s1", host_id="default")
    assert client.remove_host("host-b").host_id == "host-b"
    with pytest.raises(NotFound):
        client.remove_host("host-b")
    assert run_transaction(client.engine, lambda s: s.get(RuntimeHost, "host-b")) is None


@pytest.mark.parametrize(
    "host_id, url",
    [
        ("default", "http://127.0.0.1:9"),  # the default host is AGENT_RADAR_RUNTIME_URL
        ("", "http://127.0.0.1:9"),
        ("h" * 256, "http://127.0.0.1:9"),
        ("h\x00", "http://127.0.0.1:9"),
        (7, "http://127.0.0.1:9"),
        ("h", "ftp://127.0.0.1:9"),
        ("h", "file:///etc/passwd"),
        ("h", "http://user:secret@127.0.0.1:9"),
        ("h", "http://127.0.0.1:9/?token=x"),
        ("h", "http://127.0.0.1:99999"),
        ("h", "http://"),
        ("h", "http://127.0.0.1:9/a b"),
        ("h", "http://" + "a" * 2100),
        ("h", None),
        ("h", ["http://127.0.0.1:9"]),
    ],
)
def test_bad_hosts_are_refused_and_nothing_is_written(client, host_id, url):
    with pytest.raises(InvalidArgument):
        client.add_host(host_id, url)
    assert [h.host_id for h in client.list_hosts()] == ["default"]


def test_removing_the_default_host_is_refused(client):
    with pytest.raises(InvalidArgument):
        client.remove_host("default")


def test_a_report_naming_an_unknown_host_is_refused_and_writes_nothing(client):
    with pytest.raises(InvalidArgument, match="unknown host"):
        report(
            client,
            "s-unknown",
            session={"host_id": "nowhere", "runtime_epoch": 1, "live": True},
            turn={"turn_id": "t1", "phase": "running"},
        )
    assert session_row(client, "s-unknown") is None
    assert turn_row(client, "s-unknown", "t1") is None
    with pytest.raises(InvalidArgument, match="unknown host"):
        client.ensure_session(WS, "s-unknown", host_id="nowhere")
    assert session_row(client, "s-unknown") is None


def test_each_call_goes_to_the_host_of_its_session(client, sim_control, sim_b):
    control_b = SimControl(sim_b.url)
    client.add_host("host-b", sim_b.url)
    report(client, "s-b", session={"host_id": "host-b", "runtime_epoch": 1, "live": True})
    assert session_row(client, "s-b").host_id == "host-b"
    on_a = client.set_goal(WS, "s-a", "work on A", client_submit_id="g")
    on_b = client.set_goal(WS, "s-b", "work on B", client_submit_id="g")
    # Both in one dispatch step: the calls run side by side, each to its own host.
    outcomes = dispatcher(client).dispatch_many([on_a.operation_id, on_b.operation_id])
    assert sorted(r.outcome for r in outcomes) == ["applied", "applied"]
    assert [e["operation_id"] for e in sim_control.effects()] == [on_a.operation_id]
    assert [e["operation_id"] for e in control_b.effects()] == [on_b.operation_id]
    assert calls(sim_control, "s-b") == [] and calls(control_b, "s-a") == []


def test_a_session_bound_by_ensure_session_is_resumed_at_its_host(client, sim_control, sim_b):
    control_b = SimControl(sim_b.url)
    client.add_host("host-b", sim_b.url)
    control_b.session(WS, "s1", live=False)
    info = client.ensure_session(WS, "s1", host_id="host-b")
    epoch_b = control_b.session(WS, "s1")["runtime_epoch"]  # a resume starts a new process
    assert (info.host_id, info.live, info.runtime_epoch) == ("host-b", True, epoch_b)
    assert calls(control_b, "s1")[:2] == ["liveness", "resume"]
    assert calls(sim_control, "s1") == []


def installed_at(client, fence):
    row = run_transaction(client.engine, lambda s: s.get(GoalFence, fence.fence_id))
    return row.installed_host, row.installed_epoch


def test_a_move_to_another_host_is_a_new_epoch_there(client, sim_control, sim_b):
    control_b = SimControl(sim_b.url)
    client.add_host("host-b", sim_b.url)
    sid = "s-move"
    report(client, sid, session={"runtime_epoch": 5, "live": True})
    target = client.set_goal(WS, sid, "fenced", client_submit_id="g1")
    fence = client.fence_goal_generation(WS, sid, target.operation_id, client_submit_id="f1")
    run = client.start_maintenance(WS, sid, client_submit_id="m1")
    prompt = client.submit_prompt(WS, sid, "hello", client_submit_id="p1")
    report(
        client, sid, turn={"turn_id": "t-old", "phase": "running", "prompt_id": prompt.prompt_id}
    )

    # A report naming host-b cannot move a session served at `default`: a client does.
    with pytest.raises(InvalidArgument, match="bound to host 'default'"):
        report(client, sid, session={"host_id": "host-b", "runtime_epoch": 1, "live": True})
    assert session_row(client, sid).host_id == "default"
    # The session moves to host-b, whose own epoch numbering starts at 1.
    info = client.ensure_session(WS, sid, host_id="host-b")
    assert (info.host_id, info.runtime_epoch, info.live) == ("host-b", 1, True)
    assert installed_at(client, fence) == ("host-b", 1)  # every durable fence went there
    old = turn_row(client, sid, "t-old")
    assert (old.phase, old.outcome) == ("settled", "interrupted")
    ended = client.get_maintenance(run.run_id)
    assert (ended.status, ended.error_code) == ("interrupted", "runtime_restarted")
    assert "host-b" in ended.detail
    assert session_row(client, sid).active_turn_id is None

    op = client.set_goal(WS, sid, "the new goal", client_submit_id="g2")
    assert [r.outcome for r in dispatcher(client).dispatch(op.operation_id)] == ["applied"]
    assert calls(control_b, sid) == ["liveness", "goal-fences", "goal"]
    assert control_b.session(WS, sid)["fences"] == [[target.operation_id, 1]]
    assert installed_at(client, fence) == ("host-b", 1)
    assert op.operation_id not in [e["operation_id"] for e in sim_control.effects()]

    # A report from the host it left is refused: the session is bound to host-b now.
    with pytest.raises(InvalidArgument, match="bound to host 'host-b'"):
        client.report_activity(
            {
                "workspace_id": WS,
                "session_id": sid,
                "occurred_at_ms": int(time.time() * 1000) - 30_000,
                "session": {"host_id": "default", "runtime_epoch": 9, "live": False},
                "turn": {"turn_id": "t-forged", "phase": "running"},
            }
        )
    assert turn_row(client, sid, "t-forged") is None
    row = session_row(client, sid)
    assert (row.host_id, row.runtime_epoch, row.live) == ("host-b", 1, True)


def test_a_session_its_host_reported_for_is_not_taken_by_another_host_s_report(client, sim_b):
    """A host that reports for a session serves it, even before any client asks anything of
    it: another registered host's report, signed with its own valid token, cannot take it
    (and with it the turns running at the first host, which the move would cancel)."""
    from agent_radar.workflows.adapters import report_auth

    client.add_host("host-b", sim_b.url, token="b-token")
    report(client, "s-plain", session={"runtime_epoch": 2, "live": True})
    before = row_counts(client.engine)
    claim = {
        "workspace_id": WS,
        "session_id": "s-plain",
        "occurred_at_ms": int(time.time() * 1000),
        "session": {"live": True},
    }
    with pytest.raises(InvalidArgument, match="bound to host 'default'"):
        client.receive_report(report_auth.sign(claim, "host-b", "b-token"))
    assert row_counts(client.engine) == before
    assert session_row(client, "s-plain").host_id == "default"


def test_refused_reports_are_counted_by_the_registered_host_they_name(client, sim_b):
    """A host that sends bad reports learns it from the worker's metrics, not only its log:
    each refusal counts under the registered host the report names, and its code; a report
    naming a host nobody registered counts as `unregistered`, so a forged name makes no
    series of its own."""
    from prometheus_client import REGISTRY

    def refused(host_id):
        labels = {"host": host_id, "code": "invalid_argument"}
        return REGISTRY.get_sample_value("agent_radar_reports_refused_total", labels) or 0.0

    client.add_host("host-b", sim_b.url, token="b-token")
    before = {h: refused(h) for h in ("host-b", "unregistered", "default")}
    unsigned = {
        "workspace_id": WS,
        "session_id": "s-counted",
        "occurred_at_ms": int(time.time() * 1000),
        "session": {"live": True, "host_id": "host-b"},
    }
    with pytest.raises(InvalidArgument):
        client.receive_report(unsigned)  # host-b has a token: unsigned is refused
    with pytest.raises(InvalidArgument):
        client.receive_report({**unsigned, "session": {"live": True, "host_id": "forged\n1"}})
    with pytest.raises(InvalidArgument):
        # No host named: its session's (a session not known yet: `default`).
        client.receive_report({"workspace_id": WS, "session_id": "s-counted", "x": 1})
    assert refused("host-b") == before["host-b"] + 1
    assert refused("unregistered") == before["unregistered"] + 1
    assert refused("default") == before["default"] + 1
    assert session_row(client, "s-counted") is None
    # Names no id may have go to no query at all (NUL, a lone surrogate, not a string).
    from agent_radar.workflows.sessions import hosts

    for odd in (
        {"signed_by": "h\x00"},
        {"session": {"host_id": "h\udc80"}},
        {"workspace_id": "w\x00", "session_id": "s"},
        {"workspace_id": ["w"], "session_id": {"s": 1}},
        ["not", "a", "report"],
    ):
        named = run_transaction(client.engine, lambda s, odd=odd: hosts.named_by_report(s, odd))
        assert named in ("unregistered", "default"), odd


def test_a_session_on_a_removed_host_waits_for_it(client, sim_b):
    client.add_host("host-b", sim_b.url)
    client.ensure_session(WS, "s1", host_id="host-b")
    # Removal is refused while bound; a row deleted behind the registry's back (or a host
    # renamed in a restore) leaves a session whose host is unknown: its calls fail
    # retryably, nothing is called at any other address.
    run_transaction(
        client.engine,
        lambda s: s.delete(s.get(RuntimeHost, "host-b")),
    )
    with pytest.raises(RuntimeFault) as fault:
        client.runtime.liveness(WS, "s1")
    assert fault.value.code == "unknown_host" and fault.value.retryable
    op = client.set_goal(WS, "s1", "goal", client_submit_id="g1")
    assert [r.outcome for r in dispatcher(client).dispatch(op.operation_id)] == ["retry"]
    client.add_host("host-b", sim_b.url)  # back: the operation goes on, to host-b
    run_transaction(
        client.engine,
        lambda s: s.execute(
            update(GoalOperation)
            .where(GoalOperation.operation_id == op.operation_id)
            .values(next_attempt_at=utcnow())
        ),
    )
    assert [r.outcome for r in dispatcher(client).dispatch(op.operation_id)] == ["applied"]
    assert [e["operation_id"] for e in SimControl(sim_b.url).effects()] == [op.operation_id]


@pytest.mark.parametrize("host_id", ["", "h\x00", 7, ["host-b"], "h" * 256])
def test_a_bad_host_id_in_ensure_session_is_refused_and_writes_nothing(client, host_id):
    with pytest.raises(InvalidArgument):
        client.ensure_session(WS, "s-bad", host_id=host_id)
    assert session_row(client, "s-bad") is None


def test_a_report_cannot_move_a_bound_session(client, sim_control, sim_b):
    """One compromised host cannot take over another host's sessions: a report naming
    another host than a bound session's is refused and writes nothing; only a session with
    no host yet is bound by its first report."""
    client.add_host("host-b", sim_b.url)
    client.ensure_session(WS, "s-given", host_id="host-b")  # given by a client
    report(client, "s-first", session={"host_id": "default", "live": True})  # its first report
    target = client.set_goal(WS, "s-first", "confidential objective", client_submit_id="g")
    before = row_counts(client.engine)
    for sid, other in (("s-given", "default"), ("s-first", "host-b")):
        with pytest.raises(InvalidArgument, match="bound to host"):
            report(
                client,
                sid,
                session={"host_id": other, "live": True},
                turn={"turn_id": "t-x", "phase": "running"},
            )
    assert row_counts(client.engine) == before
    assert session_row(client, "s-given").host_id == "host-b"
    assert session_row(client, "s-first").host_id == "default"
    # The goal still goes to its own host only.
    assert [r.outcome for r in dispatcher(client).dispatch(target.operation_id)] == ["applied"]
    assert calls(SimControl(sim_b.url), "s-first") == []
    # A session with no host yet is bound by its first report naming one.
    report(client, "s-new", session={"host_id": "host-b", "live": True})
    row = session_row(client, "s-new")
    assert (row.host_id, row.host_bound) == ("host-b", True)


def test_each_host_is_called_with_its_own_token(client, settings, host):
    """Each registered host has a token of its own; the fleet's AGENT_RADAR_RUNTIME_TOKEN
    goes to the host `default` only, and a host added without one gets none."""
    from agent_radar.workflows.adapters.http_runtime import HostRouter
    from agent_radar.workflows.sessions.hosts import locator

    host.answers["s-a"] = host.answers["s-c"] = (200, b'{"live": true, "runtime_epoch": 1}')
    client.add_host("host-a", host.url, token="token-of-a")
    client.add_host("host-c", host.url + "/", token=None)
    client.ensure_session(WS, "s-a", host_id="host-a")
    client.ensure_session(WS, "s-c", host_id="host-c")
    router = HostRouter(settings.runtime_url, locator(client.engine), token="fleet-token")
    host.seen.clear()
    router.liveness(WS, "s-a")
    router.liveness(WS, "s-c")
    assert host.seen == [("s-a", "Bearer token-of-a"), ("s-c", None)]
    with pytest.raises(Conflict):
        client.add_host("host-a", host.url, token="another")  # a rotation needs --replace
    client.add_host("host-a", host.url, token="rotated", replace=True)
    router.liveness(WS, "s-a")
    assert host.seen[-1] == ("s-a", "Bearer rotated")


@pytest.mark.parametrize("backend", ["production"])
def test_host_remove_and_a_report_cannot_leave_a_session_on_a_removed_host(client, sim_b):
    """`host remove` holds the host's row while it counts the sessions bound to it; a report
    binding a session to that host waits for it, then finds the host gone (and in the other
    order, the remove waits and then sees the session). PostgreSQL: on SQLite writers take
    turns anyway."""
    import threading

    from sqlalchemy import delete, select

    client.add_host("host-b", sim_b.url)
    outcome: list[object] = []
    with client.engine.connect() as conn:
        tx = conn.begin()
        conn.execute(
            select(RuntimeHost).where(RuntimeHost.host_id == "host-b").with_for_update()
        )  # the remove has the host's row, and counted no session bound to it

        def bind_by_report() -> None:
            try:
                report(client, "s-race", session={"host_id": "host-b", "live": True})
                outcome.append("bound")
            except InvalidArgument as exc:
                outcome.append(exc)

        reporter = threading.Thread(target=bind_by_report)
        reporter.start()
        reporter.join(timeout=1.0)
        assert reporter.is_alive()  # the report waits for the remove
        conn.execute(delete(RuntimeHost).where(RuntimeHost.host_id == "host-b"))
        tx.commit()
    reporter.join(timeout=10)
    assert len(outcome) == 1 and isinstance(outcome[0], InvalidArgument), outcome
    row = session_row(client, "s-race")
    assert row is None or row.host_id == "default"


@pytest.mark.parametrize("token", ["", "two words", "line\nbreak", "x" * 256, 7])
def test_a_bad_host_token_is_refused_and_writes_nothing(client, token):
    before = row_counts(client.engine)
    with pytest.raises(InvalidArgument):
        client.add_host("host-t", "http://127.0.0.1:9", token=token)
    assert row_counts(client.engine) == before


def test_refused_reports_show_in_status_per_host_with_one_write_per_interval(
    client, sim_b, monkeypatch
):
    """A host team sees its refused reports in `status` too: the count per host the reports
    named, the last code and time. A worker writes them at most every REFUSALS_FLUSH_S: a
    flood of refused reports is one write, and forged host names make no rows."""
    from agent_radar.workflows.sessions import hosts
    from agent_radar.workflows.tools.cli.status import render_status
    from agent_radar.workflows.tools.status import fleet_status

    client.add_host("host-b", sim_b.url, token="b-token")
    monkeypatch.setattr(hosts, "REFUSALS_FLUSH_S", 3600.0)  # however slow the machine
    unsigned = {
        "workspace_id": WS,
        "session_id": "s-refused",
        "occurred_at_ms": int(time.time() * 1000),
        "session": {"live": True, "host_id": "host-b"},
    }
    for i in range(50):
        forged = {**unsigned, "session": {"live": True, "host_id": f"forged-{i}"}}
        for report in (unsigned, forged):
            with pytest.raises(InvalidArgument):
                client.receive_report(report)
    # The first refusal was written at once; the rest wait for the interval.
    first = fleet_status(client.engine)["report_refusals"]
    assert [(r["host_id"], r["refused"]) for r in first] == [("host-b", 1)]
    assert first[0]["last_code"] == "invalid_argument"
    monkeypatch.setattr(hosts, "REFUSALS_FLUSH_S", 0.0)
    with pytest.raises(InvalidArgument):
        client.receive_report(unsigned)
    status = fleet_status(client.engine)
    counts = {r["host_id"]: r["refused"] for r in status["report_refusals"]}
    assert counts == {"host-b": 51, "unregistered": 50}
    assert any(
        row.startswith("reports refused from host host-b: 51") for row in render_status(status)
    )
    assert session_row(client, "s-refused") is None

"""Bulkheads end to end, on both backends (docs/dispatch.md): a host
that hangs and a host that trickles its answers cost only their own sessions. A real worker
of two pool processes serves three hosts; the healthy host's goals are all applied while
every call to the other two is still in flight; the hanging host's calls then fail at the
deadline, its circuit opens (`status` shows it) and its work is left due, not failed; once
the faults are gone everything settles, each goal applied once."""

from dataclasses import replace

import pytest
from sqlalchemy import select

from agent_radar.models.db import run_read
from agent_radar.models.operations import GoalOperation
from agent_radar.workflows.tools.simulator import SimControl, SimServer
from agent_radar.workflows.tools.stack import free_port
from agent_radar.workflows.tools.status import fleet_status, problems
from tests.helpers import eventually

WS = "ws-bulkheads"
# Calls get this long in all (connection, request and the whole answer): long enough that
# the healthy host's goals are done well before any call to the others ends.
TIMEOUT_S = 6.0


@pytest.fixture
def settings(settings):
    return replace(settings, runtime_timeout_s=TIMEOUT_S, lease_s=TIMEOUT_S + 2)


@pytest.fixture
def sim_c(settings):
    """A third host, `host-c` (it sends no reports)."""
    server = SimServer("127.0.0.1", free_port(), host_id="host-c").start()
    yield server
    server.stop()


def _ops(client, ids: list[str]) -> dict[str, GoalOperation]:
    return run_read(
        client.engine,
        lambda s: {
            op.operation_id: op
            for op in s.execute(
                select(GoalOperation).where(GoalOperation.operation_id.in_(ids))
            ).scalars()
        },
    )


def test_a_hanging_and_a_trickling_host_cost_only_their_own_sessions(
    client, stack, settings, sim_control, sim_b, sim_c
):
    hangs, trickles = SimControl(sim_b.url), SimControl(sim_c.url)
    client.add_host("host-b", sim_b.url)
    client.add_host("host-c", sim_c.url)
    slow_b = [f"b-{i}" for i in range(16)]
    slow_c = [f"c-{i}" for i in range(4)]
    for sid in slow_b:
        client.ensure_session(WS, sid, host_id="host-b")
    for sid in slow_c:
        client.ensure_session(WS, sid, host_id="host-c")
    hangs.hold("goal")
    trickles.trickle(1000)  # one byte a second: ~150 s for an answer, cut at TIMEOUT_S
    stack.start_worker(concurrency=2)
    stack.start_beat()

    # The slow hosts' goals come in among the healthy host's, as a fleet's do: a worker
    # whose pool process waited for its calls would soon have both processes waiting.
    slow_sessions = slow_b + slow_c
    slow, healthy = [], []
    for i, sid in enumerate(slow_sessions):
        slow.append(client.set_goal(WS, sid, f"goal of {sid}", client_submit_id="g1"))
        if i % 2:
            healthy.append(client.set_goal(WS, f"a-{i}", "goal", client_submit_id="g1"))
    slow_ids = [op.operation_id for op in slow]
    healthy_ids = [op.operation_id for op in healthy]

    def all_applied() -> bool:
        return all(op.status == "completed" for op in _ops(client, healthy_ids).values())

    eventually(all_applied, timeout_s=TIMEOUT_S * 2, what="the healthy host's goals")
    # Not one call to the other two hosts has ended yet: the healthy goals waited for none.
    still = _ops(client, slow_ids)
    assert {(op.status, op.last_error) for op in still.values()} == {("dispatched", None)}, sorted(
        (op.session_id, op.status, op.last_error) for op in still.values()
    )
    assert hangs.holding() == len(slow_b)
    assert len(trickles.calls("goal")) == len(slow_c)

    # The hanging host's calls end at the deadline; its circuit opens (the work stays due,
    # nothing fails) and `status` names the host.
    def skipped() -> list[dict]:
        return fleet_status(client.engine)["hosts_skipped"]

    eventually(
        lambda: "host-b" in [h["host_id"] for h in skipped()],
        timeout_s=TIMEOUT_S * 3,
        what="host-b's circuit open",
    )
    assert "host host-b skipped: its calls keep failing" in problems(
        fleet_status(client.engine), settings.sweep_interval_s
    )
    after = _ops(client, slow_ids)
    assert not [op for op in after.values() if op.status == "failed"]
    assert any("timed out" in (op.last_error or "") for op in after.values())

    # The faults end: everything settles, each goal applied exactly once, the circuit shut.
    hangs.hold("goal", hold=False)
    trickles.trickle(0)
    eventually(
        lambda: all(op.status == "completed" for op in _ops(client, slow_ids).values()),
        timeout_s=90,
        what="every goal at the slow hosts",
    )
    applied = [
        e["operation_id"]
        for control in (sim_control, hangs, trickles)
        for e in control.effects()
        if e["operation_id"] in set(slow_ids + healthy_ids)
    ]
    assert sorted(applied) == sorted(slow_ids + healthy_ids)
    eventually(lambda: not skipped(), timeout_s=60, what="host-b's circuit closed")

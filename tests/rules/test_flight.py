"""Calls in flight (workflows/steps/goals/flight.py, docs/dispatch.md): each host's limit and
circuit breaker, a claim given back unattempted costs no budget, a claim whose lease would
not outlast its call is not called, and a drain whose record fails keeps its outcomes."""

from datetime import timedelta

import pytest

from agent_radar.models.db import run_transaction
from agent_radar.workflows.adapters import bulkhead as host_gate
from agent_radar.workflows.adapters.bulkhead import (
    BREAKER_FAILURES,
    FULL,
    FULL_RETRY_MIN_S,
    FULL_RETRY_S,
    GO,
    OPEN,
    HostGate,
)
from agent_radar.workflows.adapters.http_runtime import HttpRuntime
from agent_radar.workflows.errors import RuntimeFault
from agent_radar.workflows.goals.claims import StepResult
from agent_radar.workflows.steps.goals import flight
from agent_radar.workflows.steps.goals.dispatch import Dispatcher
from agent_radar.workflows.steps.goals.flight import Drain
from tests.helpers import Clock

WS = "ws-flight"
TIMEOUT = RuntimeFault("runtime timed out", code="timeout", retryable=True)
REFUSED = RuntimeFault("runtime answered 409", code="stale_revision", retryable=False)


def test_a_host_has_its_own_limit():
    gate = HostGate(limit=2)
    assert [gate.admit("slow")[0] for _ in range(3)] == [GO, GO, FULL]
    assert gate.admit("fast")[0] == GO  # another host's slots are its own
    gate.done("slow", None, trial=False, called=True)
    assert gate.admit("slow")[0] == GO


def test_a_full_hosts_claims_are_due_again_after_about_one_of_its_calls():
    """A claim past a host's slots and queue goes back due again when a slot should be free:
    after about one of the host's recent calls, within bounds (a host with no call yet: the
    longest)."""
    gate = HostGate(limit=1)
    assert gate.admit("h")[0] == GO
    assert gate.admit("h")[:2] == (FULL, FULL_RETRY_S)

    def calls_of(took_s: float) -> None:
        for _ in range(40):
            gate.done("h", None, trial=False, called=True, took_s=took_s)
            assert gate.admit("h")[0] == GO

    calls_of(0.2)
    assert gate.admit("h")[:2] == (FULL, pytest.approx(0.2, abs=0.001))
    assert gate.full_retry_s("h") == pytest.approx(0.2, abs=0.001)
    calls_of(0.001)
    assert gate.admit("h")[:2] == (FULL, FULL_RETRY_MIN_S)
    calls_of(10.0)  # a timeout is the host's time too
    assert gate.admit("h")[:2] == (FULL, FULL_RETRY_S)
    assert gate.full_retry_s("another") == FULL_RETRY_S


def test_a_process_full_of_other_hosts_calls_sends_a_fast_hosts_claims_back_for_longest():
    """Full because the process has MAX_IN_FLIGHT calls to other (hung) hosts: a fast host's
    own calls say nothing of when a slot is free."""
    gate = HostGate(limit=32)
    assert gate.admit("fast")[0] == GO
    for _ in range(40):
        gate.done("fast", None, trial=False, called=True, took_s=0.02)
        assert gate.admit("fast")[0] == GO
    gate.done("fast", None, trial=False, called=True, took_s=0.02)
    assert gate.full_retry_s("fast") == FULL_RETRY_MIN_S
    hung = 0
    while gate.in_flight() < host_gate.MAX_IN_FLIGHT:
        assert gate.admit(f"hung-{hung // 32}")[0] == GO
        hung += 1
    assert gate.admit("fast")[:2] == (FULL, FULL_RETRY_S)
    assert gate.full_retry_s("fast") == FULL_RETRY_S


def test_the_circuit_opens_after_failures_in_a_row_and_one_trial_closes_it(monkeypatch):
    monkeypatch.setattr(host_gate, "BREAKER_OPEN_S", 0.0)  # a trial may go at once
    gate = HostGate(limit=32)
    for _ in range(BREAKER_FAILURES - 1):
        assert gate.admit("h")[0] == GO
        gate.done("h", TIMEOUT, trial=False, called=True)
    # An answer, even an error of the protocol, is the host working: the count starts over.
    gate.admit("h")
    gate.done("h", REFUSED, trial=False, called=True)
    hanging = [gate.admit("h") for _ in range(3)]  # admitted while it was shut
    for _ in range(BREAKER_FAILURES):
        gate.admit("h")
        gate.done("h", TIMEOUT, trial=False, called=True)
    assert gate.take_transitions()[0].open_until is not None
    verdict, _, trial = gate.admit("h")
    assert (verdict, trial) == (GO, True)  # the half-open circuit's one trial
    assert gate.admit("h")[0] == OPEN  # and no other while it is out
    # Calls that hung from before it opened end: they do not count as failed trials.
    for _ in hanging:
        gate.done("h", TIMEOUT, trial=False, called=True)
    assert gate.admit("h")[0] == OPEN
    gate.done("h", None, trial=True, called=True)
    assert [t.open_until for t in gate.take_transitions()] == [None]
    assert gate.admit("h")[0] == GO and gate.in_flight() == 1


def test_a_failed_trial_opens_it_again_for_longer(monkeypatch):
    monkeypatch.setattr(host_gate, "BREAKER_OPEN_S", 0.0)
    gate = HostGate()
    for _ in range(BREAKER_FAILURES):
        gate.admit("h")
        gate.done("h", TIMEOUT, trial=False, called=True)
    gate.admit("h")
    gate.done("h", TIMEOUT, trial=True, called=True)
    assert len(gate.take_transitions()) == 2  # opened, and opened again
    # A trial that was not made (its lease too short) says nothing: the next may go.
    assert gate.admit("h")[2] is True
    gate.done("h", None, trial=True, called=False)
    assert gate.admit("h")[2] is True


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def dispatcher(client, settings, clock):
    return Dispatcher(
        client.engine,
        HttpRuntime(settings.runtime_url, timeout_s=2),
        worker_id="w",
        lease_s=settings.lease_s,
        clock=clock,
    )


def _claimed(client, dispatcher, clock, sid: str):
    op = client.set_goal(WS, sid, "x", client_submit_id="1")
    clock.advance(1)
    work = run_transaction(
        client.engine, lambda s: dispatcher._open(s, {(WS, sid): op.operation_id}), direct=True
    )
    ((lane, claim),) = work.items()
    return op, lane, claim


def test_a_claim_given_back_costs_nothing(client, dispatcher, clock, sim_control):
    """A claim the drain does not call (its host full or skipped, the worker stopping) goes
    back as it was: no attempt, no first dispatch (the time budget has not started), the
    goal state not `applying`; due when the circuit lets it, and its lane free."""
    op, lane, claim = _claimed(client, dispatcher, clock, "s1")
    assert client.get_goal_operation(op.operation_id).status == "dispatched"
    drain = Drain(dispatcher)
    drain.give_back.append((lane, claim, 5.0))
    assert drain._flush()
    back = client.get_goal_operation(op.operation_id)
    assert (back.status, back.attempt, back.first_dispatched_at, back.lease_token) == (
        "prepared",
        0,
        None,
        None,
    )
    assert back.next_attempt_at == clock.now + timedelta(seconds=5)
    assert client.goal_state(WS, "s1").sync_status != "applying"
    assert sim_control.effects() == []
    clock.advance(6)
    assert [r.outcome for r in dispatcher.dispatch(op.operation_id)] == ["applied"]


def test_a_claim_whose_lease_would_not_outlast_its_call_is_not_called(
    client, dispatcher, clock, sim_control, backend
):
    """The claim is given back as it was, uncalled, and its operation is due: on PostgreSQL
    the flush that gives it back takes it again (a flush takes due work anywhere), under a
    lease of its own, and that claim is called; on SQLite it waits for a message or the
    sweeper."""
    op, lane, claim = _claimed(client, dispatcher, clock, "s1")
    clock.advance(dispatcher.lease_s - 1.5)  # the call may take 2 s: the lease ends first
    called, attempt = [], dispatcher.attempt
    dispatcher.attempt = lambda c: called.append(c.op.lease_token) or attempt(c)
    drain = Drain(dispatcher)
    drain.add({lane: claim})
    results = drain.run()
    assert claim.op.lease_token not in called and drain.gate.in_flight() == 0
    back = client.get_goal_operation(op.operation_id)
    if backend == "embedded":
        assert results == [] and sim_control.effects() == []
        assert (back.status, back.attempt, back.lease_token) == ("prepared", 0, None)
        return
    assert results == [StepResult(op.operation_id, "applied")] and len(called) == 1
    assert [e["operation_id"] for e in sim_control.effects()] == [op.operation_id]
    assert (back.status, back.attempt, back.lease_token) == ("completed", 1, None)


def test_a_drain_whose_record_fails_keeps_its_outcomes(client, dispatcher, clock, monkeypatch):
    """The database away when a call's outcome is to be recorded: the drain keeps it and
    records it on the next try; the host's slot went back when the call ended."""
    op, lane, claim = _claimed(client, dispatcher, clock, "s1")
    drain = Drain(dispatcher)
    drain.add({lane: claim})
    real = flight.run_transaction
    failures = iter([True])

    def flaky(engine, work, **kw):
        if next(failures, False):
            raise ConnectionError("the database is away")
        return real(engine, work, **kw)

    monkeypatch.setattr(flight, "run_transaction", flaky)
    monkeypatch.setattr(flight, "FLUSH_RETRY_S", 0.01)
    assert drain.run() == [StepResult(op.operation_id, "applied")]
    assert client.get_goal_operation(op.operation_id).status == "completed"
    assert drain.gate.in_flight() == 0


def test_a_handed_claim_is_called_at_once_by_the_thread_that_hands_it(
    client, dispatcher, clock, sim_control
):
    """A dispatch task starts the calls whose hosts have a slot itself (`start_now`), not
    waiting for the drain's thread, which may be recording other outcomes; the drain learns
    of each call before its end, and takes the rest (a full host's, or all while stopping)."""
    op1, lane1, claim1 = _claimed(client, dispatcher, clock, "s1")
    op2, lane2, claim2 = _claimed(client, dispatcher, clock, "s2")
    drain = Drain(dispatcher)
    drain.gate.limit = 1  # the host has one slot: the second claim waits for the drain
    rest = drain.start_now({lane1: claim1, lane2: claim2})
    assert rest == {lane2: claim2}
    event = drain.events.get(timeout=5)
    assert event[:3] == ("started", lane1, claim1)
    assert event[3].result(timeout=5).answer is not None  # called with no drain running
    assert [e["operation_id"] for e in sim_control.effects()] == [op1.operation_id]
    drain._take(event)
    drain.add(rest)
    assert sorted(drain.run(), key=lambda r: r.operation_id) == sorted(
        [StepResult(op1.operation_id, "applied"), StepResult(op2.operation_id, "applied")],
        key=lambda r: r.operation_id,
    )
    assert drain.gate.in_flight() == 0
    drain.stopping = True  # a stopping drain starts nothing more
    assert drain.start_now({lane1: claim1}) == {lane1: claim1}
    assert drain.gate.in_flight() == 0

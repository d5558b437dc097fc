"""Operator actions (docs/operations.md), on both backends: retry a failed goal operation or fence
(same id, a fresh budget), resolve a run in recovery, drain and undrain a session — each with
a required reason, audited in the session's events, and refused with a typed error (writing
nothing) where it does not apply."""

from datetime import timedelta

import pytest
from sqlalchemy import update

from agent_radar.beat.sweeper import sweep_once
from agent_radar.models.base import utcnow
from agent_radar.models.db import run_transaction
from agent_radar.models.operations import GoalFence, GoalOperation, MaintenanceRun
from agent_radar.workflows import budgets
from agent_radar.workflows.adapters.http_runtime import HttpRuntime
from agent_radar.workflows.errors import Conflict, InvalidArgument, NotFound, RuntimeDraining
from agent_radar.workflows.goals.operations import fail_operation
from agent_radar.workflows.maintenance import runs
from agent_radar.workflows.steps.fence_apply import FenceApplier
from agent_radar.workflows.steps.goals.dispatch import Dispatcher
from tests.helpers import row_counts

WS, SID = "ws-operators", "s1"


def operator_events(client, sid=SID):
    return [r.payload for r in client.history(WS, sid, limit=100) if r.kind == "operator-action"]


def fail(client, op):
    run_transaction(
        client.engine,
        lambda s: fail_operation(s, s.get(GoalOperation, op.operation_id), "rejected", utcnow()),
    )


def test_a_failed_goal_operation_is_retried_with_a_fresh_budget(client, settings, sim_control):
    op = client.set_goal(WS, SID, "ship it", client_submit_id="g1")
    run_transaction(
        client.engine,
        lambda s: s.execute(update(GoalOperation).values(attempt=budgets.MAX_ATTEMPTS)),
    )
    fail(client, op)
    assert client.goal_state(WS, SID).sync_status == "failed"
    for bad in ("", None, "x" * 5000):
        with pytest.raises(InvalidArgument):
            client.retry_operation(op.operation_id, reason=bad)
    with pytest.raises(NotFound):
        client.retry_operation(op.operation_id, reason="why", workspace_id="other")

    again = client.retry_operation(op.operation_id, reason="the agent host is fixed")
    assert (again.operation_id, again.status, again.attempt) == (op.operation_id, "prepared", 0)
    state = client.goal_state(WS, SID)
    assert (state.sync_status, state.pending_operation_id) == ("pending", op.operation_id)
    dispatcher = Dispatcher(
        client.engine, HttpRuntime(settings.runtime_url, timeout_s=2), worker_id="d", lease_s=5
    )
    assert [r.outcome for r in dispatcher.dispatch(op.operation_id)] == ["applied"]
    assert client.goal_state(WS, SID).sync_status == "synced"
    assert operator_events(client) == [
        {
            "action": "retry",
            "target_id": op.operation_id,
            "reason": "the agent host is fixed",
            "target_kind": "goal",
        }
    ]
    before = row_counts(client.engine)
    with pytest.raises(Conflict, match="only a failed one"):
        client.retry_operation(op.operation_id, reason="again")
    assert row_counts(client.engine) == before


def test_an_older_failed_revision_is_not_retried(client):
    old = client.set_goal(WS, SID, "first", client_submit_id="g1")
    fail(client, old)
    client.set_goal(WS, SID, "second", client_submit_id="g2")
    before = row_counts(client.engine)
    with pytest.raises(Conflict, match="revision"):
        client.retry_operation(old.operation_id, reason="bring it back")
    assert row_counts(client.engine) == before


def test_a_failed_fence_is_retried_with_its_clear(client, settings, sim_control):
    target = client.set_goal(WS, SID, "shared goal", client_submit_id="g1")
    fence = client.fence_goal_generation(WS, SID, target.operation_id, client_submit_id="f1")
    run_transaction(
        client.engine,
        lambda s: s.execute(update(GoalFence).values(attempt=budgets.MAX_ATTEMPTS)),
    )
    applier = FenceApplier(
        client.engine,
        HttpRuntime(settings.runtime_url),
        worker_id="a",
        lease_s=5,
        publish=lambda *a: True,
    )
    assert applier.apply(fence.fence_id) == "failed"
    assert client.get_goal_operation(fence.clear_operation_id).status == "failed"

    again = client.retry_operation(fence.fence_id, reason="host back", workspace_id=WS)
    assert (again.status, again.attempt, again.last_error) == ("pending", 0, None)
    assert client.get_goal_operation(fence.clear_operation_id).status == "prepared"
    assert applier.apply(fence.fence_id) == "completed"
    assert client.get_fence(fence.fence_id).status == "completed"
    assert client.goal_state(WS, SID).desired is None  # the clear went through
    assert [e["target_kind"] for e in operator_events(client)] == ["fence"]


def stuck_run(client, sid=SID):
    run = client.start_maintenance(WS, sid, client_submit_id="m1")
    run_transaction(
        client.engine,
        lambda s: s.execute(
            update(MaintenanceRun).values(lease_owner="gone", lease_expires_at=utcnow())
        ),
    )
    sweep_once(client.engine, lambda *a: True, utcnow() + timedelta(hours=1), owner="t")
    assert client.get_maintenance(run.run_id).status == "recovery_required"
    return run


@pytest.mark.parametrize("to", ["failed", "completed"])
def test_a_run_in_recovery_is_resolved_and_the_session_released(client, to):
    run = stuck_run(client)
    held = client.set_goal(WS, SID, "after the run", client_submit_id="g1")
    assert run_transaction(client.engine, lambda s: runs.session_held(s, WS, SID))
    for bad_to in ("cancelled", "", None):
        with pytest.raises(InvalidArgument):
            client.resolve_maintenance(run.run_id, to=bad_to, reason="r")
    with pytest.raises(NotFound):
        client.resolve_maintenance(run.run_id, to=to, reason="r", workspace_id="other")

    done = client.resolve_maintenance(run.run_id, to=to, reason="the host lost it for good")
    assert done.status == to
    assert done.error_code == ("operator_resolved" if to == "failed" else None)
    assert "the host lost it for good" in done.detail
    assert not run_transaction(client.engine, lambda s: runs.session_held(s, WS, SID))
    assert client.get_goal_operation(held.operation_id).next_attempt_at is not None
    assert operator_events(client)[-1] == {
        "action": "resolve",
        "target_id": run.run_id,
        "reason": "the host lost it for good",
        "target_kind": "maintenance",
        "to": to,
    }
    with pytest.raises(Conflict, match="only a run in recovery"):
        client.resolve_maintenance(run.run_id, to=to, reason="twice")


def test_drain_and_undrain_are_audited(client):
    # Only a session the control plane knows: a typo is refused, and makes no session.
    with pytest.raises(NotFound, match="unknown session"):
        client.drain_session(WS, "s-typo", reason="rollout of host 7")
    with pytest.raises(NotFound):
        client.session_info(WS, "s-typo")
    client.set_goal(WS, SID, "known", client_submit_id="g1")  # the session is known now
    drained = client.drain_session(WS, SID, reason="rollout of host 7")
    assert drained.admission == "draining"
    # Again: nothing changes, nothing more in the history (found by a new user's trial).
    assert client.drain_session(WS, SID, reason="again").admission == "draining"
    with pytest.raises(RuntimeDraining):
        client.start_maintenance(WS, SID, client_submit_id="m1")
    with pytest.raises(InvalidArgument):
        client.undrain_session(WS, SID, reason="")
    assert client.undrain_session(WS, SID, reason="rollout done").admission == "open"
    assert client.undrain_session(WS, SID, reason="again").admission == "open"
    client.start_maintenance(WS, SID, client_submit_id="m1")
    assert [(e["action"], e["reason"]) for e in operator_events(client)] == [
        ("drain", "rollout of host 7"),
        ("undrain", "rollout done"),
    ]

"""A session's restore (docs/lifecycles.md: fences, sessions), on both backends: the row's
restore_due_at is the outbox — a report asks for it, the sweeper publishes what a lost message left
due, a restore asked for again while it ran stays due, and an offline session waits for its next
return."""

import time
from datetime import timedelta

from agent_radar.beat.sweeper import OUTBOX_GRACE_S, sweep_once
from agent_radar.models.base import utcnow
from agent_radar.models.db import run_transaction
from agent_radar.models.operations import GoalFence
from agent_radar.models.tables import AgentSession
from agent_radar.workflows.adapters.http_runtime import HttpRuntime
from agent_radar.workflows.fences.restores import OFFLINE_RECHECK_S
from agent_radar.workflows.fences.restores import request as request_restore
from agent_radar.workflows.steps.fence_apply import FenceApplier
from agent_radar.workflows.task_names import RESTORE_TASK
from tests.helpers import restorer

WS, SID = "ws-restore", "s1"


def session_row(client):
    return run_transaction(
        client.engine, lambda s: s.get(AgentSession, (WS, SID), populate_existing=True)
    )


def fence_row(client, fence_id):
    return run_transaction(client.engine, lambda s: s.get(GoalFence, fence_id))


def settled_offline(client, settings, sim_control):
    """A goal applied at the host, then a fence settled locally while the session was
    offline: the fence is installed nowhere and its clear never reached the agent."""
    runtime = HttpRuntime(settings.runtime_url)
    applier = FenceApplier(
        client.engine, runtime, worker_id="a", lease_s=5, publish=lambda *a: True
    )
    target = client.set_goal(WS, SID, "shared", client_submit_id="g1")
    applier.dispatcher.dispatch(target.operation_id)
    sim_control.session(WS, SID, live=False, continuation_turns=False)
    fence = client.fence_goal_generation(WS, SID, target.operation_id, client_submit_id="f1")
    assert applier.apply(fence.fence_id) == "completed_offline"
    row = fence_row(client, fence.fence_id)
    assert (row.installed_host, row.clear_undelivered) == (None, True)
    return target, fence


def report_back(client):
    client.report_activity(
        {
            "workspace_id": WS,
            "session_id": SID,
            "occurred_at_ms": int(time.time() * 1000),
            "session": {"live": True},
        }
    )


def test_a_report_asks_for_the_restore_once_and_it_installs_and_delivers(
    client, settings, sim_control
):
    target, fence = settled_offline(client, settings, sim_control)
    sim_control.session(WS, SID, live=True)
    report_back(client)
    due = session_row(client).restore_due_at
    assert due is not None
    report_back(client)  # already due: the same request, nothing more
    assert session_row(client).restore_due_at == due
    assert restorer(client).restore(WS, SID) == "restored"
    at_host = sim_control.session(WS, SID)
    assert (at_host["fences"], at_host["goal"]) == ([[target.operation_id, 1]], None)
    row = fence_row(client, fence.fence_id)
    assert (row.installed_host, row.clear_undelivered) == ("default", False)
    assert session_row(client).restore_due_at is None
    assert restorer(client).restore(WS, SID) == "skipped"  # nothing is due
    report_back(client)
    assert session_row(client).restore_due_at is None  # nothing left to restore


def test_the_sweeper_publishes_a_restore_whose_message_was_lost(client, settings, sim_control):
    settled_offline(client, settings, sim_control)
    report_back(client)  # its publish is lost: no worker reads it
    published = []
    later = utcnow() + timedelta(seconds=OUTBOX_GRACE_S + 1)
    sweep_once(
        client.engine, lambda task, kw: published.append((task, kw)) or True, later, owner="t"
    )
    assert published == [(RESTORE_TASK, {"workspace_id": WS, "session_id": SID})]
    published.clear()
    sweep_once(
        client.engine, lambda task, kw: published.append((task, kw)) or True, later, owner="t"
    )
    assert published == []  # reserved: its message is on the way


def test_an_offline_session_is_asked_again_while_a_fence_waits_for_it(
    client, settings, sim_control
):
    """Issue row: a session that comes back with no report was never asked again, and its
    fenced goal ran on. While a fence or a clear waits for it, it is asked every
    OFFLINE_RECHECK_S; once back, the fence and the clear reach it."""
    target, _fence = settled_offline(client, settings, sim_control)
    report_back(client)  # a late report: the session is in fact still offline
    before = utcnow()
    assert restorer(client).restore(WS, SID) == "offline"
    row = session_row(client)
    assert row.live is False
    assert row.restore_due_at >= before + timedelta(seconds=OFFLINE_RECHECK_S)
    assert sim_control.session(WS, SID)["fences"] == []
    sim_control.session(WS, SID, live=True)  # back, and it sends no report
    published = []
    sweep_once(
        client.engine,
        lambda task, kw: published.append((task, kw)) or True,
        row.restore_due_at + timedelta(seconds=OUTBOX_GRACE_S),
        owner="t",
    )
    assert published == [(RESTORE_TASK, {"workspace_id": WS, "session_id": SID})]
    assert restorer(client).restore(WS, SID) == "restored"
    at_host = sim_control.session(WS, SID)
    assert (at_host["fences"], at_host["goal"]) == ([[target.operation_id, 1]], None)
    assert client.goal_state(WS, SID).sync_status == "synced"
    assert session_row(client).restore_due_at is None


def test_a_restore_asked_for_again_while_it_ran_stays_due(client, settings, sim_control):
    settled_offline(client, settings, sim_control)
    sim_control.session(WS, SID, live=True)
    report_back(client)
    runtime = HttpRuntime(settings.runtime_url)
    liveness = runtime.liveness

    def liveness_then_a_report(workspace_id, session_id):
        answer = liveness(workspace_id, session_id)
        # Another report asks while this restore runs (after it read what to do).
        run_transaction(
            client.engine,
            lambda s: request_restore(s.get(AgentSession, (WS, SID)), utcnow()),
        )
        return answer

    runtime.liveness = liveness_then_a_report
    assert restorer(client, runtime).restore(WS, SID) == "restored"
    assert session_row(client).restore_due_at is not None  # the sweeper runs it again

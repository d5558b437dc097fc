"""Goal control end to end on both backends: real `agent-radar worker` and `beat`
subprocesses, the real broker, the simulator over HTTP. Faults are real too: SIGKILL,
SIGSTOP past a lease, a publish lost after commit, two beats, an agent outage."""

import os
import re
import signal
import time

import pytest
from sqlalchemy import select

from agent_radar.models.db import run_transaction
from agent_radar.models.operations import GoalOperation
from agent_radar.models.tables import Lease
from agent_radar.workflows.adapters.publisher import TaskPublisher
from agent_radar.workflows.client import AgentRadar
from tests.helpers import dispatching, effects_by_operation, eventually, row_counts

WS = "ws-e2e"
# A worker that does not pull (docs/dispatch.md): goals go by dispatch message only.
NO_PULL = {"AGENT_RADAR_PULL": "false"}


def settled(client, op, timeout_s=60):
    return client.wait(op, timeout=timeout_s)


def test_set_pause_resume_clear(client, stack, sim_control):
    stack.start_worker()
    ops = [client.set_goal(WS, "s1", "write the report", client_submit_id="1")]
    ops.append(settled(client, ops[0]))
    for action in ("pause", "resume", "clear"):
        op = client.goal_control(WS, "s1", action, client_submit_id=action)
        assert settled(client, op).status == "completed"
    state = client.goal_state(WS, "s1")
    assert (state.revision, state.tombstoned, state.sync_status) == (4, True, "synced")
    assert [e["action"] for e in sim_control.effects()] == ["set", "pause", "resume", "clear"]


def test_set_then_clear_reach_the_agent_in_revision_order(client, stack, sim_control):
    stack.start_worker(concurrency=2)
    stack.start_worker(concurrency=2)
    sessions = [f"s{i}" for i in range(12)]
    last = {}
    for sid in sessions:
        client.set_goal(WS, sid, f"goal of {sid}", client_submit_id="set")
    for sid in sessions:
        last[sid] = client.clear_goal(WS, sid, client_submit_id="clear")
    for sid in sessions:
        assert settled(client, last[sid]).status == "completed"
        state = client.goal_state(WS, sid)
        assert state.tombstoned and state.sync_status == "synced" and state.revision == 2
    per_session = {}
    for effect in sim_control.effects():
        per_session.setdefault(effect["session_id"], []).append(effect["revision"])
    for sid in sessions:
        revisions = per_session[sid]
        assert revisions == sorted(revisions) and revisions[-1] == 2, (sid, revisions)
        ops = client.list_goal_operations(WS, sid)
        set_op = ops[0]
        # The set either completed (so it reached the agent) or was superseded by the
        # clear — before its call, or while the call was in flight (then the agent may
        # have applied it, once).
        assert set_op.status in ("completed", "superseded")
        if set_op.status == "completed":
            assert 1 in revisions
    assert all(n == 1 for n in effects_by_operation(sim_control).values())


def test_duplicate_submissions_take_effect_once(client, stack, sim_control):
    stack.start_worker()
    ops = [client.set_goal(WS, "dup", "once", client_submit_id="same") for _ in range(10)]
    assert len({op.operation_id for op in ops}) == 1
    assert settled(client, ops[0]).status == "completed"
    again = client.set_goal(WS, "dup", "once", client_submit_id="same")
    assert again.status == "completed"
    assert effects_by_operation(sim_control) == {ops[0].operation_id: 1}


class LosingPublisher(TaskPublisher):
    """The broker is gone right after the commit: every publish fails."""

    def publish(self, task_name, kwargs=None, queue=None):
        raise ConnectionError("broker unreachable")


def test_a_publish_lost_after_commit_is_republished_by_the_sweeper(
    settings, sim, stack, sim_control
):
    lossy = AgentRadar(settings=settings, publisher=LosingPublisher(settings))
    op = lossy.set_goal(WS, "outbox", "survive", client_submit_id="1")
    assert op.status == "prepared"  # accepted and durable even though publishing failed
    # Not pulling: a worker that pulls looks for due work as it connects and takes it first.
    stack.start_worker(extra_env=NO_PULL)
    time.sleep(0)  # nothing will dispatch it but the sweeper
    assert lossy.get_goal_operation(op.operation_id).status == "prepared"
    stack.start_beat()
    assert settled(lossy, op).status == "completed"
    assert effects_by_operation(sim_control) == {op.operation_id: 1}


def test_agent_outage_is_retried_until_it_applies(client, stack, sim_control):
    stack.start_worker()
    stack.start_beat()
    # Two failed calls, so a retry follows a retry (backoff 1 s, then 2 s); a third adds
    # only another 4 s of waiting.
    sim_control.fault("goal", status=503, count=2, session_id="outage")
    op = client.set_goal(WS, "outage", "keep trying", client_submit_id="1")
    done = settled(client, op, timeout_s=90)
    assert (done.status, done.attempt) == ("completed", 3)
    assert effects_by_operation(sim_control) == {op.operation_id: 1}


def test_worker_killed_mid_dispatch(client, stack, sim_control):
    """SIGKILL the whole worker while the agent call is in flight: the operation still
    completes (sweeper + a new worker) and the agent applied it once."""
    victim = stack.start_worker(concurrency=1)
    stack.start_beat()
    sim_control.latency("goal", 1500)
    op = client.set_goal(WS, "killed", "finish me", client_submit_id="1")
    eventually(lambda: dispatching(client, op), what="the dispatch to start")
    victim.kill()
    sim_control.latency("goal", 0)
    stack.start_worker(concurrency=1)
    done = settled(client, op, timeout_s=90)
    assert done.status == "completed" and done.attempt >= 2
    assert effects_by_operation(sim_control) == {op.operation_id: 1}


def test_a_paused_lease_holder_cannot_write(client, stack, sim_control, settings):
    """SIGSTOP the pool process that holds the lease until the lease expires; another
    worker completes the operation; the resumed process's late write is refused."""
    paused = stack.start_worker(concurrency=1)
    stack.start_beat()
    sim_control.latency("goal", 1000)
    op = client.set_goal(WS, "paused", "fence me", client_submit_id="1")
    holder = eventually(lambda: dispatching(client, op), what="the dispatch to start")
    pool_pid = int(holder.lease_owner.rsplit(":", 1)[1])
    os.kill(pool_pid, signal.SIGSTOP)
    try:
        stack.start_worker(concurrency=1)
        done = settled(client, op, timeout_s=90)
        assert done.status == "completed" and done.lease_owner is None
        assert done.attempt == 2
    finally:
        os.kill(pool_pid, signal.SIGCONT)
    # Resumed, it either finds its lease too short to call, or its call's outcome refused.
    refused = re.compile(
        f"goal operation {op.operation_id}: (not called, its lease would end|its call ended "
        "after its lease was taken over)"
    )
    eventually(
        lambda: refused.search(paused.log_path.read_text()),
        timeout_s=30,
        what="the paused worker's refused write",
    )
    assert client.get_goal_operation(op.operation_id) == done
    assert effects_by_operation(sim_control) == {op.operation_id: 1}


def test_two_beats_sweep_one_at_a_time(client, stack, sim_control, settings):
    stack.start_worker(extra_env=NO_PULL)  # the lost messages left to the sweeps
    stack.start_beat("beat-a")
    stack.start_beat("beat-b")
    lossy = AgentRadar(settings=settings, publisher=LosingPublisher(settings))
    ops = [lossy.set_goal(WS, f"beats-{i}", "swept", client_submit_id="1") for i in range(8)]
    for op in ops:
        assert settled(client, op).status == "completed"
    assert all(n == 1 for n in effects_by_operation(sim_control).values())
    assert len(effects_by_operation(sim_control)) == 8
    sweeper = run_transaction(client.engine, lambda s: s.get(Lease, "sweeper"))
    assert sweeper is not None  # both beats' sweeps went through the one lease


def test_accepted_goals_complete_from_the_agents_report(client, stack, sim_control):
    stack.start_worker()
    sim_control.session(WS, "acc", goal_mode="accepted", apply_delay_ms=200)
    op = client.set_goal(WS, "acc", "acknowledge first", client_submit_id="1")
    done = settled(client, op)
    assert (done.status, done.provider_phase) == ("completed", "applied")
    assert client.goal_state(WS, "acc").sync_status == "synced"


BAD_MESSAGES = [
    (
        "agent_radar.goal_control",
        {
            "workspace_id": 7,
            "session_id": "s",
            "action": "set",
            "objective": "x",
            "client_submit_id": "c",
        },
    ),
    (
        "agent_radar.goal_control",
        {"workspace_id": "w", "session_id": "s", "action": "launch", "client_submit_id": "c"},
    ),
    (
        "agent_radar.goal_control",
        {
            "workspace_id": "w",
            "session_id": "s",
            "action": "set",
            "objective": "x",
            "client_submit_id": "c",
            "colour": "red",
        },
    ),
    ("agent_radar.goal_control", {"workspace_id": "w", "session_id": "s", "action": "set"}),
    ("agent_radar.goal.dispatch", {"operation_id": ["not", "an", "id"]}),
    ("agent_radar.goal.dispatch", {"operation_ids": []}),
    ("agent_radar.goal.dispatch", {"operation_ids": "one-id"}),
    ("agent_radar.goal.dispatch", {"operation_ids": [7]}),
    ("agent_radar.goal.dispatch", {"operation_id": "a", "operation_ids": ["b"]}),
    ("agent_radar.goal.dispatch", {}),
    (
        "agent_radar.goal.dispatch",
        {"operation_ids": ["a", "b"], "workspace_id": "w", "session_id": "s"},
    ),
    ("agent_radar.goal.dispatch", {"operation_id": "a", "workspace_id": "w"}),
    ("agent_radar.goal.dispatch", {"operation_id": "a", "workspace_id": "w", "session_id": ""}),
    ("agent_radar.report_activity", {"report": "not an object"}),
    (
        "agent_radar.report_activity",
        {"report": {"workspace_id": "w", "session_id": "s", "occurred_at_ms": "yesterday"}},
    ),
]


def test_ill_typed_task_messages_are_rejected_and_write_nothing(client, stack, settings):
    worker = stack.start_worker()
    publisher = TaskPublisher(settings)
    before = row_counts(client.engine)
    for task, kwargs in BAD_MESSAGES:
        publisher.publish(task, kwargs)
    # a good message after the bad ones proves the worker went through all of them
    publisher.publish(
        "agent_radar.goal_control",
        {
            "workspace_id": WS,
            "session_id": "good",
            "action": "set",
            "objective": "fine",
            "client_submit_id": "1",
        },
    )
    op = eventually(lambda: client.find_goal_operation(WS, "good", "1"))
    settled(client, op)
    eventually(
        lambda: worker.log_path.read_text().count("rejected agent_radar.") >= len(BAD_MESSAGES),
        timeout_s=30,
        what="every bad message to be rejected",
    )
    after = row_counts(client.engine)
    assert after["goal_operations"] == before["goal_operations"] + 1
    assert after["goal_states"] == before["goal_states"] + 1
    log = worker.log_path.read_text()
    assert "workspace_id must be a string" in log
    assert "unknown goal action 'launch'" in log
    assert "unexpected keyword argument 'colour'" in log
    assert "operation_ids must be a list of 1-16 ids" in log
    assert "give exactly one of operation_id and operation_ids" in log
    assert "workspace_id and session_id name the session of one operation" in log
    assert "session_id must be a string" in log
    assert "session_id must be 1-" in log
    publisher.close()


@pytest.mark.parametrize("action", ["set"])
def test_public_goal_control_task_is_idempotent(client, stack, settings, sim_control, action):
    stack.start_worker()
    publisher = TaskPublisher(settings)
    message = {
        "workspace_id": WS,
        "session_id": "task",
        "action": action,
        "objective": "via the broker",
        "client_submit_id": "t-1",
    }
    for _ in range(5):
        publisher.publish("agent_radar.goal_control", message)
    op = eventually(lambda: client.find_goal_operation(WS, "task", "t-1"))
    assert settled(client, op).status == "completed"
    eventually(
        lambda: (
            not run_transaction(
                client.engine,
                lambda s: s.execute(
                    select(GoalOperation).where(GoalOperation.status == "prepared")
                ).first(),
            )
        )
    )
    assert effects_by_operation(sim_control) == {op.operation_id: 1}
    publisher.close()

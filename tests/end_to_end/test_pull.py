"""Pulling end to end (docs/dispatch.md), on PostgreSQL with Redis: real worker and beat
subprocesses. Each pool process of a worker holds a promise from its start; submits notify
one instead of publishing dispatch messages; a notification that reaches nobody (its puller
killed) costs the sweeper's outbox grace, never the operation."""

import time
from dataclasses import replace
from datetime import timedelta

import pytest
from sqlalchemy import select

from agent_radar.models.base import utcnow
from agent_radar.models.coordination import GoalPuller
from agent_radar.models.db import run_transaction
from agent_radar.workflows.kinds.goal import DISPATCH_TASK
from agent_radar.workflows.tools.stack import Stack
from tests.helpers import effects_by_operation, eventually

pytestmark = pytest.mark.parametrize("backend", ["production"])

WS = "ws-pull"


def _live_promises(client) -> list[str]:
    now = utcnow()
    return run_transaction(
        client.engine,
        lambda s: list(
            s.execute(select(GoalPuller.channel).where(GoalPuller.expires_at > now)).scalars()
        ),
    )


def _count_dispatch_messages(client) -> list[dict]:
    """Every dispatch message the client publishes, from now on."""
    sent: list[dict] = []
    publish = client.publisher.publish

    def counting(task_name, kwargs=None, *args, **kw):
        if task_name == DISPATCH_TASK:
            sent.append(kwargs)
        return publish(task_name, kwargs, *args, **kw)

    client.publisher.publish = counting
    return sent


def test_every_pool_process_pulls_from_its_start_and_submits_send_no_messages(
    client, stack, sim_control
):
    stack.start_worker(concurrency=2)
    # Each pool process holds a promise from its start, before any message.
    eventually(lambda: len(_live_promises(client)) == 2, what="a promise per pool process")
    sent = _count_dispatch_messages(client)
    ops = []
    for i in range(30):  # new sessions and sessions seen before
        ops.append(client.set_goal(WS, f"s{i % 12}", f"goal {i}", client_submit_id=f"p{i}"))
    for op in ops:
        assert client.wait(op, timeout=30).status in ("completed", "superseded")
    assert sent == []
    completed = {op.operation_id for op in ops if client.wait(op).status == "completed"}
    assert {k: n for k, n in effects_by_operation(sim_control).items() if k in completed} == {
        op_id: 1 for op_id in completed
    }


def test_a_notification_nobody_takes_is_dispatched_by_the_sweeper(client, stack, sim_control):
    # A puller killed a moment ago: its promise still reads live, and nobody listens.
    run_transaction(
        client.engine,
        lambda s: s.add(
            GoalPuller(channel="agent_radar_pull_killed", expires_at=utcnow() + timedelta(hours=1))
        ),
    )
    sent = _count_dispatch_messages(client)
    op = client.set_goal(WS, "lost", "still applied", client_submit_id="1")
    assert client.flush()
    assert sent == []  # notified, not published
    stack.start_worker(concurrency=2)
    stack.start_beat()
    started = time.monotonic()
    assert client.wait(op, timeout=60).status == "completed"
    assert time.monotonic() - started < 30
    assert effects_by_operation(sim_control) == {op.operation_id: 1}


def test_a_notified_operation_is_claimed_by_name_whatever_the_clocks_say(
    client, stack, sim_control, monkeypatch
):
    """A client whose clock runs a minute ahead makes operations that are not yet due by the
    worker's clock: the notification names them, and the drain claims them by name as their
    message's dispatch would. No beat runs: nothing else could dispatch them."""
    stack.start_worker(concurrency=2)
    eventually(lambda: len(_live_promises(client)) == 2, what="a promise per pool process")
    sent = _count_dispatch_messages(client)
    ahead = utcnow() + timedelta(minutes=1)
    monkeypatch.setattr("agent_radar.workflows.client.goals.utcnow", lambda: ahead)
    ops = [client.set_goal(WS, f"s{i}", "ahead", client_submit_id="2") for i in range(4)]
    for op in ops:
        assert client.wait(op, timeout=30).status == "completed"
    assert sent == []
    assert all(effects_by_operation(sim_control)[op.operation_id] == 1 for op in ops)


def test_workers_told_not_to_pull_keep_the_messages(client, settings, sim, sim_control):
    stack = Stack(replace(settings, pull=False))
    stack.prepare()
    try:
        stack.start_worker(concurrency=2)
        sent = _count_dispatch_messages(client)
        ops = []
        for i in range(3):
            ops.append(client.set_goal(WS, f"s{i}", "by message", client_submit_id="1"))
            assert client.wait(ops[-1], timeout=30).status == "completed"
        assert len(sent) == 3 and _live_promises(client) == []
        assert effects_by_operation(sim_control) == {op.operation_id: 1 for op in ops}
    finally:
        stack.kill()

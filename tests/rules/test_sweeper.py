"""The sweeper as a function (docs/lifecycles.md: leases): outbox re-publish, expired leases,
budgets, and mutual exclusion between two sweeps."""

import threading
from datetime import timedelta

from sqlalchemy import update

from agent_radar.beat.sweeper import OUTBOX_GRACE_S, REPUBLISH_INTERVAL_S, sweep_once
from agent_radar.models.db import run_transaction
from agent_radar.models.operations import GoalOperation
from agent_radar.workflows import leases
from agent_radar.workflows.adapters.http_runtime import HttpRuntime
from agent_radar.workflows.kinds.goal import DISPATCH_TASK
from agent_radar.workflows.steps.goals.dispatch import Dispatcher
from agent_radar.workflows.task_names import COALESCE_MAX_ITEMS
from tests.helpers import Clock


class RecordingPublisher:
    def __init__(self):
        self.published = []

    def __call__(self, task, kwargs):
        self.published.append((task, kwargs))
        return True


def test_fresh_work_is_left_to_its_own_publish(client):
    op = client.set_goal("ws", "s", "x", client_submit_id="a")
    pub = RecordingPublisher()
    counts = sweep_once(client.engine, pub, op.next_attempt_at, owner="t")
    assert counts.ran and pub.published == []


def test_lost_publish_is_republished_once_per_interval(client):
    op = client.set_goal("ws", "s", "x", client_submit_id="a")
    pub = RecordingPublisher()
    now = op.next_attempt_at + timedelta(seconds=OUTBOX_GRACE_S)
    assert sweep_once(client.engine, pub, now, owner="t").republished == 1
    assert pub.published == [(DISPATCH_TASK, {"operation_id": op.operation_id})]
    # the message is on its way: the next sweeps leave it alone for a while
    assert sweep_once(client.engine, pub, now + timedelta(seconds=1), owner="t").republished == 0
    later = now + timedelta(seconds=REPUBLISH_INTERVAL_S + OUTBOX_GRACE_S)
    assert sweep_once(client.engine, pub, later, owner="t").republished == 1


def test_a_backlog_of_lost_publishes_goes_out_in_batches(client):
    ops = [client.set_goal("ws", f"s{i}", "x", client_submit_id="a") for i in range(20)]
    pub = RecordingPublisher()
    now = max(op.next_attempt_at for op in ops) + timedelta(seconds=OUTBOX_GRACE_S)
    assert sweep_once(client.engine, pub, now, owner="t").republished == 20
    assert [(task, len(kwargs["operation_ids"])) for task, kwargs in pub.published] == [
        (DISPATCH_TASK, COALESCE_MAX_ITEMS),
        (DISPATCH_TASK, 20 - COALESCE_MAX_ITEMS),
    ]
    sent = [i for _, kwargs in pub.published for i in kwargs["operation_ids"]]
    assert sorted(sent) == sorted(op.operation_id for op in ops)


def test_a_held_operation_lease_is_not_taken_over_until_it_expires(client, settings):
    clock = Clock()
    op = client.set_goal("ws", "s", "x", client_submit_id="a")
    d = Dispatcher(
        client.engine,
        HttpRuntime(settings.runtime_url),
        worker_id="w",
        lease_s=settings.lease_s,
        clock=clock,
    )
    claim = run_transaction(client.engine, lambda s: d.claim(s, op.operation_id))
    assert claim.token
    pub = RecordingPublisher()
    soon = clock.now + timedelta(seconds=OUTBOX_GRACE_S + 0.5)
    assert sweep_once(client.engine, pub, soon, owner="t").republished == 0
    expired = clock.now + timedelta(seconds=settings.lease_s + OUTBOX_GRACE_S)
    assert sweep_once(client.engine, pub, expired, owner="t").republished == 1


def test_sweeper_enforces_budgets_without_a_worker(client):
    op = client.set_goal("ws", "s", "x", client_submit_id="a")
    # seed the row at the point where a worker used its last attempt and then died
    run_transaction(
        client.engine,
        lambda s: s.execute(
            update(GoalOperation).values(
                status="dispatched", attempt=24, first_dispatched_at=op.created_at
            )
        ),
    )
    pub = RecordingPublisher()
    counts = sweep_once(client.engine, pub, op.created_at + timedelta(seconds=5), owner="t")
    assert counts.failed == 1 and pub.published == []
    failed = client.get_goal_operation(op.operation_id)
    assert failed.status == "failed" and "budget" in failed.last_error
    assert client.goal_state("ws", "s").sync_status == "failed"


def test_only_one_sweep_runs_at_a_time(client):
    for i in range(5):
        client.set_goal("ws", f"s{i}", "x", client_submit_id="a")
    now = client.get_goal_operation(
        client.find_goal_operation("ws", "s0", "a").operation_id
    ).next_attempt_at + timedelta(seconds=OUTBOX_GRACE_S + 1)
    inside = threading.Event()
    release = threading.Event()

    def slow_publish(task, kwargs):
        inside.set()
        release.wait(10)
        return True

    results = {}
    first = threading.Thread(
        target=lambda: results.setdefault(
            "a", sweep_once(client.engine, slow_publish, now, owner="beat-a")
        )
    )
    first.start()
    assert inside.wait(10)
    second = sweep_once(client.engine, RecordingPublisher(), now, owner="beat-b")
    release.set()
    first.join(10)
    assert second.ran is False
    assert results["a"].ran and results["a"].republished == 5
    # the lease is free again afterwards
    token = run_transaction(client.engine, lambda s: leases.claim(s, "sweeper", "x", 5, now))
    assert token


def test_publishing_into_a_second_embedded_broker_before_any_worker(tmp_path):
    """One process, two broker folders: the second must get its own bindings, or a message
    published before a worker binds there is routed nowhere."""
    from agent_radar.workflows.adapters.config import Settings
    from agent_radar.workflows.adapters.publisher import TaskPublisher

    for name in ("first", "second"):
        settings = Settings(
            home=tmp_path / name, database_url="sqlite://", broker_url="filesystem://"
        )
        publisher = TaskPublisher(settings)
        publisher.publish("agent_radar.fence.apply", {"fence_id": name})
        publisher.close()
        queued = list((tmp_path / name / "broker" / "queue").glob("*.default.msg"))
        assert len(queued) == 1, name

"""Retention (docs/operations.md), on both backends: settled operations and events older than the
window go in bounded batches; open, live, still-pointed-at and fence rows stay; never under
a day; a dry run deletes nothing."""

from datetime import timedelta

import pytest
from sqlalchemy import func, select, text, update

from agent_radar.beat.schedule import beat_schedule
from agent_radar.models.base import utcnow
from agent_radar.models.db import engine_for, run_transaction
from agent_radar.models.dialects import dialect_of
from agent_radar.models.operations import GoalFence, GoalOperation, MaintenanceRun, Prompt
from agent_radar.models.tables import SessionEvent, Turn
from agent_radar.workflows.adapters.config import Settings
from agent_radar.workflows.errors import InvalidArgument, NotFound
from agent_radar.workflows.goals.operations import fail_operation
from agent_radar.workflows.operators.retention import RULES, prune_batch
from agent_radar.workflows.task_names import PRUNE_TASK
from tests.helpers import query_plan, row_counts

WS = "ws-retention"


def age_everything(client, days: float) -> None:
    then = utcnow() - timedelta(days=days)

    def age(s):
        s.execute(update(GoalOperation).values(created_at=then, completed_at=then))
        s.execute(update(GoalFence).values(created_at=then, completed_at=then))
        s.execute(update(Prompt).values(created_at=then))
        s.execute(update(MaintenanceRun).values(started_at=then, finished_at=then))
        s.execute(update(Turn).values(settled_at=then))
        s.execute(update(SessionEvent).values(created_at=then))

    run_transaction(client.engine, age)


def count(client, table) -> int:
    return run_transaction(
        client.engine, lambda s: s.execute(select(func.count()).select_from(table)).scalar_one()
    )


def test_old_settled_rows_go_and_everything_else_stays(client):
    # settled: an operation replaced by a newer one, a failed one, a completed prompt
    old = client.set_goal(WS, "s1", "first", client_submit_id="g1")
    newest = client.set_goal(WS, "s1", "second", client_submit_id="g2")  # supersedes g1
    failed = client.set_goal(WS, "s2", "x", client_submit_id="g1")
    run_transaction(
        client.engine,
        lambda s: fail_operation(s, s.get(GoalOperation, failed.operation_id), "no", utcnow()),
    )
    fence = client.fence_goal_generation(WS, "s1", old.operation_id, client_submit_id="f1")
    prompt = client.submit_prompt(WS, "s3", "hello", client_submit_id="p1")
    run_transaction(
        client.engine,
        lambda s: s.execute(update(Prompt).values(status="completed")),
    )
    live_run = client.start_maintenance(WS, "s4", client_submit_id="m1")  # still running
    age_everything(client, days=40)

    preview = client.prune(dry_run=True)
    assert preview["dry_run"] and preview["rows"]["goal_operations"] >= 2
    before = row_counts(client.engine)
    assert client.prune(dry_run=True)["rows"] == preview["rows"]
    assert row_counts(client.engine) == before  # a dry run deletes nothing

    done = client.prune(max_batches=5)
    assert done["rows"]["prompts"] == 1
    remaining = {
        r.operation_id
        for r in run_transaction(
            client.engine, lambda s: s.execute(select(GoalOperation)).scalars().all()
        )
    }
    assert old.operation_id not in remaining and failed.operation_id not in remaining
    assert newest.operation_id in remaining  # open: the goal state points at it
    assert count(client, GoalFence) == 1  # fences are permanent
    assert client.get_maintenance(live_run.run_id).status == "running"
    assert client.history(WS, "s4")  # a live run's records stay
    assert client.get_fence(fence.fence_id).fence_id == fence.fence_id
    with pytest.raises(NotFound):
        client.get_prompt(prompt.prompt_id)


def test_recent_rows_stay(client):
    client.set_goal(WS, "s1", "first", client_submit_id="g1")
    client.set_goal(WS, "s1", "second", client_submit_id="g2")
    age_everything(client, days=2)
    assert sum(client.prune(max_batches=5)["rows"].values()) == 0
    assert sum(client.prune(retention_days=1.5, max_batches=5)["rows"].values()) > 0


def test_batches_are_bounded(client):
    for n in range(7):
        client.set_goal(WS, f"s{n}", "x", client_submit_id="g1")
        client.set_goal(WS, f"s{n}", "y", client_submit_id="g2")
    age_everything(client, days=40)
    first = client.prune(batch=3)
    assert first["rows"]["goal_operations"] == 3
    # a run whose time is spent stops after the batch in hand; the next one goes on
    assert client.prune(batch=2, max_batches=10, budget_s=0)["rows"]["goal_operations"] == 2
    assert client.prune(batch=1, max_batches=10, budget_s=60)["rows"]["goal_operations"] == 2


def test_a_batch_is_deleted_by_address_and_each_goal_state_read_by_key(client):
    """Retention's delete takes each row it found by its address in the table (PostgreSQL's
    ctid, SQLite's rowid), not through the primary key's index, whose pages a long history
    does not keep in memory, and looks up each row's goal state by its key (docs/operations.md;
    which index finds the rows is the planner's choice on a table this small: test_counts
    shows the one on age is there for it)."""
    client.set_goal(WS, "s1", "x", client_submit_id="g1")
    engine = client.engine
    rule = next(r for r in RULES if r.name == "goal_operations")
    statement = dialect_of(engine).delete_some(
        rule.table, rule.prunable(utcnow() - timedelta(days=30)), 500
    )
    postgres = dialect_of(engine).name == "postgresql"
    shown = query_plan(engine, statement)
    by_address = "Tid Scan" if postgres else "USING INTEGER PRIMARY KEY (rowid=?)"
    assert by_address in shown, shown
    # each row's goal state by its key, not a scan of every session's
    state_by_key = "pk_goal_states" if postgres else "goal_states USING INDEX"
    assert state_by_key in shown and "SCAN goal_states" not in shown, shown


def test_a_row_another_transaction_is_changing_is_passed_over(client):
    """On PostgreSQL retention locks what it deletes as it finds it and passes over rows
    another transaction holds (a retry reopening an operation): it neither waits for them
    nor deletes them; the next run takes them once they are free and still settled."""
    if dialect_of(client.engine).name != "postgresql":
        pytest.skip("SQLite has one write lock: nothing else writes while retention does")
    held = client.set_goal(WS, "s1", "x", client_submit_id="g1")
    client.set_goal(WS, "s1", "y", client_submit_id="g2")
    client.set_goal(WS, "s2", "x", client_submit_id="g1")
    client.set_goal(WS, "s2", "y", client_submit_id="g2")
    age_everything(client, days=40)
    other = engine_for(client.settings.database_url).connect()
    try:
        other.execute(
            select(GoalOperation)
            .where(GoalOperation.operation_id == held.operation_id)
            .with_for_update()
        )

        def prune(s):
            s.execute(text("SET LOCAL lock_timeout = '2s'"))  # waiting would fail the test
            return prune_batch(s, utcnow(), 30, 500, dry_run=False).rows["goal_operations"]

        assert run_transaction(client.engine, prune) == 1
    finally:
        other.rollback()
        other.close()
    assert client.get_goal_operation(held.operation_id).operation_id == held.operation_id
    assert run_transaction(client.engine, prune) == 1


@pytest.mark.parametrize("days", [0, 0.5, -1, "30", True])
def test_a_window_under_a_day_is_refused(client, days):
    with pytest.raises(InvalidArgument):
        client.prune(retention_days=days)


@pytest.mark.parametrize(
    "bad",
    [
        {"max_batches": 0},
        {"max_batches": 100_001},
        {"max_batches": "5"},
        {"max_batches": True},
        {"budget_s": -1},
        {"budget_s": float("nan")},
        {"budget_s": float("inf")},
        {"budget_s": "60"},
        {"budget_s": True},
    ],
)
def test_a_bad_batch_count_or_time_budget_is_refused_and_deletes_nothing(client, bad):
    client.set_goal(WS, "s1", "x", client_submit_id="g1")
    client.set_goal(WS, "s1", "y", client_submit_id="g2")
    age_everything(client, days=40)
    with pytest.raises(InvalidArgument) as refused:
        client.prune(**bad)
    assert refused.value.field == next(iter(bad))
    assert count(client, GoalOperation) == 2


def test_the_retention_setting_and_the_beat_entry():
    with pytest.raises(ValueError, match="at least 1"):
        Settings.from_env({"AGENT_RADAR_RETENTION_DAYS": "0.5"})
    settings = Settings.from_env({"AGENT_RADAR_RETENTION_DAYS": "45"})
    assert settings.retention_days == 45
    assert Settings.from_env(settings.to_env()).retention_days == 45
    entries = beat_schedule(settings)
    assert [e["task"] for e in entries.values() if e["task"] == PRUNE_TASK] == [PRUNE_TASK]


@pytest.mark.parametrize("batch", [0, -1, 10**6, "5", None])
def test_a_bad_batch_is_refused_and_nothing_is_deleted(client, batch):
    client.set_goal(WS, "s1", "first", client_submit_id="g1")
    client.set_goal(WS, "s1", "second", client_submit_id="g2")
    age_everything(client, days=40)
    before = row_counts(client.engine)
    with pytest.raises(InvalidArgument):
        client.prune(batch=batch)
    assert row_counts(client.engine) == before

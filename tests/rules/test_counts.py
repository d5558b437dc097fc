"""Kept counts (docs/operations.md: counts), on both backends: `status` and the metrics read
settled counts the sweeper keeps plus the rows not counted yet, and the answer equals a count
of every row — before and after the sweeper counts, after an operator reopens a counted row,
after retention deletes, and over a history an upgrade left uncounted. The readers reach the
rows through the partial index of uncounted rows, not the history."""

from datetime import timedelta

import pytest
from sqlalchemy import func, select, text, update

from agent_radar.beat.sweeper import count_settled
from agent_radar.models.base import utcnow
from agent_radar.models.db import run_read, run_transaction
from agent_radar.models.dialects import dialect_of
from agent_radar.models.operations import GoalOperation
from agent_radar.models.tables import SettledCount
from agent_radar.workflows.goals.operations import fail_operation
from agent_radar.workflows.operators import counts
from agent_radar.workflows.tools.status import fleet_status
from tests.helpers import query_plan
from tests.rules.test_retention import age_everything

WS = "ws-counts"


def every_row(engine) -> counts.Counts:
    """The slow, obvious answer: every row of every counted kind, counted."""

    def read(s):
        found = {}
        for kind, declared in counts.COUNTED.items():
            table = declared.table
            for status, workspace_id, n in s.execute(
                select(table.status, table.workspace_id, func.count()).group_by(
                    table.status, table.workspace_id
                )
            ).all():
                found[(kind, status, workspace_id)] = n
        return found

    return run_read(engine, read)


def kept(engine) -> counts.Counts:
    return run_read(engine, counts.operation_counts)


def uncounted_goal_statuses(engine) -> list[str]:
    return run_read(
        engine,
        lambda s: sorted(
            s.execute(select(GoalOperation.status).where(counts.uncounted(GoalOperation))).scalars()
        ),
    )


def fail(engine, operation_id: str) -> None:
    run_transaction(
        engine,
        lambda s: fail_operation(s, s.get(GoalOperation, operation_id), "no", utcnow()),
    )


def test_counts_equal_every_row_before_and_after_the_sweeper_counts(client):
    client.set_goal(WS, "s1", "first", client_submit_id="g1")
    client.set_goal(WS, "s1", "second", client_submit_id="g2")  # supersedes g1
    failed = client.set_goal(WS, "s2", "x", client_submit_id="g1")
    fail(client.engine, failed.operation_id)
    client.set_goal("ws-other", "s1", "open", client_submit_id="g1")
    client.submit_prompt(WS, "s3", "hello", client_submit_id="p1")
    assert kept(client.engine) == every_row(client.engine)
    assert ("goal", "superseded", WS) in kept(client.engine)

    assert count_settled(client.engine) == 2  # the superseded and the failed one
    assert count_settled(client.engine) == 0
    assert kept(client.engine) == every_row(client.engine)
    # what is left outside the counts is open work only
    assert uncounted_goal_statuses(client.engine) == ["prepared", "prepared"]
    status = fleet_status(client.engine)
    assert status["goal_operations"] == {"failed": 1, "prepared": 2, "superseded": 1}
    assert status["prompts"] == {"queued": 1}


def test_a_reopened_row_leaves_its_count(client):
    op = client.set_goal(WS, "s1", "x", client_submit_id="g1")
    fail(client.engine, op.operation_id)
    count_settled(client.engine)
    client.retry_operation(op.operation_id, reason="the host is fixed")
    # counted as failed, prepared again: the reader takes it out of `failed` at once
    assert kept(client.engine) == every_row(client.engine)
    assert fleet_status(client.engine)["goal_operations"] == {"prepared": 1}
    assert count_settled(client.engine) == 1
    assert kept(client.engine) == every_row(client.engine)
    assert (
        run_read(
            client.engine,
            lambda s: s.execute(
                select(SettledCount.count).where(SettledCount.status == "failed")
            ).scalar_one(),
        )
        == 0
    )
    fail(client.engine, op.operation_id)
    assert count_settled(client.engine) == 1
    assert kept(client.engine) == every_row(client.engine) == {("goal", "failed", WS): 1}


def test_retention_takes_what_it_deletes_out_of_the_counts(client):
    for i in range(3):
        op = client.set_goal(WS, f"s{i}", "x", client_submit_id="g1")
        client.set_goal(WS, f"s{i}", "y", client_submit_id="g2")  # supersedes g1
        if i == 2:
            fail(client.engine, op.operation_id)  # superseded already: stays as it is
    count_settled(client.engine)
    client.set_goal(WS, "s0", "z", client_submit_id="g3")  # one more, not counted yet
    age_everything(client, days=40)
    assert client.prune(dry_run=False)["rows"]["goal_operations"] == 4
    assert kept(client.engine) == every_row(client.engine)
    assert kept(client.engine) == {("goal", "prepared", WS): 3}


def test_an_upgraded_history_is_counted_exactly_and_then_kept(client):
    for i in range(5):
        client.set_goal(WS, f"s{i}", "x", client_submit_id="g1")
        client.set_goal(WS, f"s{i}", "y", client_submit_id="g2")
    count_settled(client.engine)
    # as migration 0013 leaves a history: nothing counted
    run_transaction(
        client.engine,
        lambda s: (
            s.execute(update(GoalOperation).values(counted_as=None)),
            s.execute(SettledCount.__table__.delete()),
        ),
    )
    assert kept(client.engine) == every_row(client.engine)
    assert count_settled(client.engine) == 5
    assert kept(client.engine) == every_row(client.engine)


def test_the_readers_use_the_index_of_uncounted_rows(client):
    """The reader's part over a table goes through ix_<table>_uncounted: its cost follows the
    open work, not the history."""
    client.set_goal(WS, "s1", "x", client_submit_id="g1")
    reader = (
        select(GoalOperation.status, GoalOperation.workspace_id, func.count())
        .where(counts.uncounted(GoalOperation))
        .group_by(GoalOperation.status, GoalOperation.workspace_id)
    )
    engine = client.engine
    shown = query_plan(engine, reader)
    assert "ix_goal_operations_uncounted" in shown, shown
    # retention's search goes by age, and `op list` of a workspace newest first by both
    old = utcnow() - timedelta(days=31)
    for query, index in (
        (
            select(GoalOperation.operation_id).where(GoalOperation.created_at < old).limit(5),
            "ix_goal_operations_created",
        ),
        (
            select(GoalOperation)
            .where(GoalOperation.workspace_id == WS)
            .order_by(GoalOperation.created_at.desc())
            .limit(50),
            "ix_goal_operations_workspace_created",
        ),
    ):
        shown = query_plan(engine, query)
        assert index in shown, shown


def test_postgresql_compiles_no_statement(client):
    """JIT would compile the counts' read over a long history (its estimate is millions of
    rows, the truth a few): every connection turns it off."""
    if dialect_of(client.engine).name != "postgresql":
        pytest.skip("SQLite has no JIT")
    assert run_read(client.engine, lambda s: s.execute(text("SHOW jit")).scalar_one()) == "off"

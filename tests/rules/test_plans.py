"""Plans of the dispatcher's statements on PostgreSQL where the tables have no statistics yet
(a new deployment, or a new workspace whose sessions arrive faster than autovacuum analyzes):
a statement about a few sessions reads those few, not the whole busy workspace."""

import json

import pytest
from sqlalchemy import event, text

from agent_radar.models.db import engine_for
from agent_radar.workflows.goals.operations import _LOCK_STATES
from agent_radar.workflows.goals.statements import CLAIM_LOOKUP, LOCK_SESSIONS_OF_OPS
from tests.conftest import throwaway_pg_database

SESSIONS = 2000
WS = "busy-workspace"


@pytest.fixture(scope="module")
def unanalyzed():
    """A database of its own: 2,000 sessions of one workspace, each with a goal state and an
    operation, and autovacuum off, so no table has statistics."""
    with throwaway_pg_database("agent_radar_plans") as url:
        engine = engine_for(url)
        with engine.begin() as conn:
            for table in ("agent_sessions", "goal_states", "goal_operations"):
                conn.execute(text(f"ALTER TABLE {table} SET (autovacuum_enabled = false)"))
            conn.execute(
                text(
                    "INSERT INTO agent_sessions (workspace_id, session_id, runtime_epoch,"
                    " host_id, admission, event_sequence)"
                    " SELECT :ws, 's' || g, 0, 'default', 'open', 1"
                    " FROM generate_series(1, :n) g"
                ),
                {"ws": WS, "n": SESSIONS},
            )
            conn.execute(
                text(
                    "INSERT INTO goal_states (workspace_id, session_id, revision, tombstoned,"
                    " sync_status, pending_operation_id)"
                    " SELECT :ws, 's' || g, 1, false, 'pending', 'op-' || g"
                    " FROM generate_series(1, :n) g"
                ),
                {"ws": WS, "n": SESSIONS},
            )
            conn.execute(
                text(
                    "INSERT INTO goal_operations (operation_id, workspace_id, session_id,"
                    " client_submit_id, origin, action, objective, goal_revision, status,"
                    " provider_phase, attempt, next_attempt_at, created_at)"
                    " SELECT 'op-' || g, :ws, 's' || g, '1', 'client', 'set', 'o', 1,"
                    " 'dispatched', 'dispatched', 1, now(), now()"
                    " FROM generate_series(1, :n) g"
                ),
                {"ws": WS, "n": SESSIONS},
            )
        yield engine


def rows_read_and_dropped(engine, statement, params) -> int:
    """EXPLAIN ANALYZE: the rows the plan's nodes read only to drop them again (by a filter
    or a join filter)."""
    with engine.connect() as conn:

        @event.listens_for(conn, "before_cursor_execute", retval=True)
        def explain(_conn, _cursor, sql, parameters, _context, _many):
            return "EXPLAIN (ANALYZE, FORMAT JSON) " + sql, parameters

        result = conn.execute(statement, params)
        (plan,) = result.cursor.fetchone()
        result.close()
        conn.rollback()  # the FOR UPDATE took locks
    plan = plan if isinstance(plan, list) else json.loads(plan)

    def dropped(node) -> int:
        own = node.get("Rows Removed by Filter", 0) + node.get("Rows Removed by Join Filter", 0)
        return own * node.get("Actual Loops", 1) + sum(dropped(n) for n in node.get("Plans", []))

    return dropped(plan[0]["Plan"])


@pytest.mark.parametrize(
    "name, statement",
    [
        ("completion lock", _LOCK_STATES),
        ("claim lock", LOCK_SESSIONS_OF_OPS),
        ("claim lookup", CLAIM_LOOKUP),
    ],
)
def test_a_statement_about_sixteen_sessions_does_not_read_the_workspace(
    unanalyzed, name, statement
):
    ops = [f"op-{i}" for i in range(100, 1700, 100)]
    # Reading a table once (a sequential scan, where a table looks small) is fine; reading
    # the workspace again for each session (a join on its first key column only) is not.
    assert rows_read_and_dropped(unanalyzed, statement, {"b_ops": ops}) < 2 * SESSIONS, name

"""The bench's phase (d) (`agent-radar bench --settled N`, docs/benchmarks.md): a sweep over a large
settled history costs about what a sweep over none does."""

import statistics
import time
import uuid
from collections.abc import Callable

from sqlalchemy import func, insert, select

from agent_radar.models.base import utcnow
from agent_radar.models.db import engine_for, run_transaction
from agent_radar.models.dialects import dialect_of
from agent_radar.models.enums import TERMINAL_OPERATION_STATUSES
from agent_radar.models.tables import GoalOperation as GoalOperationRow
from agent_radar.workflows.adapters.config import Settings

SWEEP_REPEATS = 25
SETTLED_CHUNK = 10_000


def _sweep_ms(engine) -> float:
    """Median wall time of one sweep over this database, in ms."""
    from agent_radar.beat.sweeper import sweep_once

    times = []
    for i in range(SWEEP_REPEATS):
        started = time.perf_counter()
        sweep_once(engine, lambda _task, _kwargs: True, utcnow(), owner=f"bench-sweep-{i}")
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def _settled_count(engine) -> int:
    return run_transaction(
        engine,
        lambda s: s.execute(
            select(func.count())
            .select_from(GoalOperationRow)
            .where(GoalOperationRow.status.in_(TERMINAL_OPERATION_STATUSES))
        ).scalar_one(),
    )


def _add_settled(engine, workspace_id: str, count: int, say: Callable) -> None:
    """Add `count` completed goal operations, as a long history leaves behind."""
    now = utcnow()
    for start in range(0, count, SETTLED_CHUNK):
        rows = [
            {
                "operation_id": str(uuid.uuid4()),
                "workspace_id": workspace_id,
                "session_id": f"h{i}",
                "client_submit_id": "1",
                "origin": "client",
                "action": "set",
                "objective": "settled",
                "goal_revision": 1,
                "status": "completed",
                "provider_phase": "applied",
                "attempt": 1,
                "next_attempt_at": now,
                "first_dispatched_at": now,
                "completed_at": now,
                "created_at": now,
            }
            for i in range(start, min(start + SETTLED_CHUNK, count))
        ]
        run_transaction(
            engine,
            lambda s, rows=rows: s.connection().execute(insert(GoalOperationRow.__table__), rows),
        )
        if (start // SETTLED_CHUNK) % 10 == 9:
            say(f"    … {start + SETTLED_CHUNK:,} settled operations added")
    dialect_of(engine).analyze(engine, "goal_operations")


def settled_sweep(settings: Settings, count: int, run_id: str, say: Callable) -> dict:
    """Sweep time over the database as it is, then with `count` more settled operations."""
    engine = engine_for(settings.database_url)
    before = {"settled": _settled_count(engine), "sweep_ms": _sweep_ms(engine)}
    _add_settled(engine, f"bench-{run_id}-history", count, say)
    after = {"settled": _settled_count(engine), "sweep_ms": _sweep_ms(engine)}
    return {
        "before": {"settled": before["settled"], "sweep_ms": round(before["sweep_ms"], 2)},
        "after": {"settled": after["settled"], "sweep_ms": round(after["sweep_ms"], 2)},
        "ratio": round(after["sweep_ms"] / before["sweep_ms"], 2),
    }

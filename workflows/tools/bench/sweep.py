"""The bench's phase (d) (`agent-radar bench --settled N`, docs/benchmarks.md): what runs every few
seconds or per operation — an exporter scrape, `status`, a sweep, and a goal from submit to
applied (submit and dispatch) — timed before and after adding N settled operations."""

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
# Scrapes and `status` reads are slower over a long history: fewer of them.
READ_REPEATS = 5
# Goals timed from submit to applied, one at a time, before and after.
GOAL_SAMPLES = 20
SETTLED_CHUNK = 10_000


def _median_ms(repeats: int, once: Callable[[int], object]) -> float:
    times = []
    for i in range(repeats):
        started = time.perf_counter()
        once(i)
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def _costs(engine, bench, label: str) -> tuple[dict, dict]:
    """Median wall times, in ms, over the database as it is now; the goals' audit."""
    from agent_radar.beat.sweeper import sweep_once
    from agent_radar.workflows.tools.bench.goals import goals_unloaded
    from agent_radar.workflows.tools.metrics import FleetCollector
    from agent_radar.workflows.tools.status import fleet_status

    scrape = FleetCollector(engine)
    settled = _settled_count(engine)  # before this call's own goals
    goal_ms, audit = goals_unloaded(bench, GOAL_SAMPLES, label=f"settled-{label}")
    return {
        "settled": settled,
        "exporter_ms": round(_median_ms(READ_REPEATS, lambda _i: list(scrape.collect())), 2),
        "status_ms": round(_median_ms(READ_REPEATS, lambda _i: fleet_status(engine)), 2),
        "sweep_ms": round(
            _median_ms(
                SWEEP_REPEATS,
                lambda i: sweep_once(
                    engine, lambda _task, _kwargs: True, utcnow(), owner=f"bench-sweep-{i}"
                ),
            ),
            2,
        ),
        "goal_ms": round(statistics.median(goal_ms), 2),
    }, audit


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


# What (d) times, and how it names each in its report.
COSTS = {
    "exporter_ms": "exporter scrape",
    "status_ms": "status",
    "sweep_ms": "sweep",
    "goal_ms": "goal, submit to applied",
}


def settled_costs(settings: Settings, bench, count: int, say: Callable) -> dict:
    """The costs over the database as it is, then with `count` more settled operations;
    each one's ratio after/before; the audits of the goals timed."""
    engine = engine_for(settings.database_url)
    before, audit_before = _costs(engine, bench, "before")
    _add_settled(engine, f"bench-{bench.run_id}-history", count, say)
    after, audit_after = _costs(engine, bench, "after")
    return {
        "added": count,
        "before": before,
        "after": after,
        "ratios": {key: round(after[key] / before[key], 2) for key in COSTS},
        "audits": [audit_before, audit_after],
    }

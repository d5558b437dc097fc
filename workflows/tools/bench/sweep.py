"""The bench's phase (d) (`agent-radar bench --settled N`, docs/benchmarks.md): what runs every few
seconds or per operation — an exporter scrape, `status`, a sweep, a goal from submit to applied
(submit and dispatch) — and what retention pays per operation it deletes, timed before and
after adding N settled operations."""

import statistics
import time
import uuid
from collections.abc import Callable
from datetime import timedelta

from sqlalchemy import insert, text

from ....models.base import utcnow
from ....models.db import engine_for, run_transaction
from ....models.dialects import dialect_of
from ....models.operations import GoalOperation as GoalOperationRow
from ...adapters.config import Settings
from ...kinds.goal import TERMINAL_OPERATION_STATUSES
from ...operators import counts as operation_counts
from ...operators.retention import BATCH, DEFAULT_RETENTION_DAYS, prune_batch

SWEEP_REPEATS = 25
READ_REPEATS = 25
# Goals timed from submit to applied, one at a time, before and after.
GOAL_SAMPLES = 20
# Operations past the retention window that retention deletes while timed, before and after,
# PRUNE_REPEATS times.
PRUNED = 2_000
PRUNE_REPEATS = 3
SETTLED_CHUNK = 10_000
# On PostgreSQL the history is made by the server, a million rows a transaction.
SERVER_CHUNK = 1_000_000


def _median_ms(repeats: int, once: Callable[[int], object]) -> float:
    times = []
    for i in range(repeats):
        started = time.perf_counter()
        once(i)
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def _costs(engine, bench, label: str) -> tuple[dict, dict]:
    """Median wall times, in ms, over the database as it is now; the goals' audit."""
    from ....beat.sweeper import sweep_once
    from ..metrics import FleetCollector
    from ..status import fleet_status
    from .goals import goals_unloaded

    # Both times from a vacuumed table: the history is vacuumed once it is added, and the
    # phases before (d) leave dead rows that autovacuum would be clearing while (d) times.
    dialect_of(engine).analyze(engine, "goal_operations")
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
        "prune_ms": _prune_ms(engine, f"bench-{bench.run_id}-pruned-{label}"),
    }, audit


def _settled_count(engine) -> int:
    counts = run_transaction(engine, operation_counts.operation_counts)
    goal = operation_counts.by_status(counts, "goal")
    return sum(goal.get(status, 0) for status in TERMINAL_OPERATION_STATUSES)


def _prune_ms(engine, workspace_id: str) -> float:
    """Retention's time per 1,000 operations it deletes (the median of PRUNE_REPEATS): each
    time PRUNED settled operations past the retention window are added, then pruned in
    retention's own batches until none is left."""
    old = utcnow() - timedelta(days=DEFAULT_RETENTION_DAYS + 1)

    def prune_all() -> None:
        while run_transaction(
            engine,
            lambda s: prune_batch(s, utcnow(), DEFAULT_RETENTION_DAYS, BATCH, dry_run=False),
        ).rows["goal_operations"]:
            pass

    times = []
    for i in range(PRUNE_REPEATS):
        _add_settled(engine, f"{workspace_id}-{i}", PRUNED, old, lambda _line: None)
        times.append(_median_ms(1, lambda _i: prune_all()) / (PRUNED / 1000))
    return round(statistics.median(times), 2)


def _add_settled(engine, workspace_id: str, count: int, at, say: Callable) -> None:
    """Add `count` completed goal operations accepted and settled at `at`, counted as the
    sweeper would count them, as a long history leaves behind."""
    if dialect_of(engine).name == "postgresql":
        _add_on_server(engine, workspace_id, count, at, say)
    else:
        _add_from_here(engine, workspace_id, count, at, say)
    run_transaction(
        engine,
        lambda s: operation_counts.add_counts(s, {("goal", "completed", workspace_id): count}),
    )
    dialect_of(engine).analyze(engine, "goal_operations")


def _add_from_here(engine, workspace_id: str, count: int, at, say: Callable) -> None:
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
                "counted_as": "completed",
                "provider_phase": "applied",
                "attempt": 1,
                "next_attempt_at": at,
                "first_dispatched_at": at,
                "completed_at": at,
                "created_at": at,
            }
            for i in range(start, min(start + SETTLED_CHUNK, count))
        ]
        run_transaction(
            engine,
            lambda s, rows=rows: s.connection().execute(insert(GoalOperationRow.__table__), rows),
        )
        if (start // SETTLED_CHUNK) % 10 == 9:
            say(f"    … {start + SETTLED_CHUNK:,} settled operations added")


_ADD_ON_SERVER = text(
    "INSERT INTO goal_operations (operation_id, workspace_id, session_id, client_submit_id,"
    " origin, action, objective, goal_revision, status, counted_as, provider_phase, attempt,"
    " next_attempt_at, first_dispatched_at, completed_at, created_at)"
    " SELECT gen_random_uuid()::text, :workspace, 'h' || i, '1', 'client', 'set', 'settled', 1,"
    " 'completed', 'completed', 'applied', 1, :at, :at, :at, :at"
    " FROM generate_series(CAST(:first AS bigint), CAST(:last AS bigint)) AS i"
)


def _add_on_server(engine, workspace_id: str, count: int, at, say: Callable) -> None:
    for start in range(0, count, SERVER_CHUNK):
        last = min(start + SERVER_CHUNK, count) - 1
        run_transaction(
            engine,
            lambda s, start=start, last=last: s.execute(
                _ADD_ON_SERVER, {"workspace": workspace_id, "at": at, "first": start, "last": last}
            ),
        )
        if count > SERVER_CHUNK:
            say(f"    … {last + 1:,} settled operations added")


# What (d) times, and how it names each in its report.
COSTS = {
    "exporter_ms": "exporter scrape",
    "status_ms": "status",
    "sweep_ms": "sweep",
    "goal_ms": "goal, submit to applied",
    "prune_ms": "retention, per 1,000 deleted",
}


def settled_costs(settings: Settings, bench, count: int, say: Callable) -> dict:
    """The costs over the database as it is, then with `count` more settled operations;
    each one's ratio after/before; the audits of the goals timed."""
    engine = engine_for(settings.database_url)
    before, audit_before = _costs(engine, bench, "before")
    _add_settled(engine, f"bench-{bench.run_id}-history", count, utcnow(), say)
    after, audit_after = _costs(engine, bench, "after")
    return {
        "added": count,
        "before": before,
        "after": after,
        "ratios": {key: round(after[key] / before[key], 2) for key in COSTS},
        "audits": [audit_before, audit_after],
    }

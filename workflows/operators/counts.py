"""Operations by kind, workspace and status, at a cost that does not grow with the history
(docs/operations.md: counts).

Settled rows are counted once, by the sweeper, into `settled_counts`: `count_settled` adds each
settled row whose `counted_as` is not its status under its status (and sets `counted_as`), and
takes a row out of the status it was counted under once it has left it (an operator's retry
reopened it). A reader adds those counts to the rows not counted under their status — open
work and what settled since the last sweep, which a partial index holds apart from the
history — in one statement, so it reads one snapshot and is exact at any moment. Retention
takes what it deletes out of the counts in the deleting transaction (`add_counts`).
"""

from collections import Counter
from typing import Any

from sqlalchemy import func, literal_column, or_, select, union_all, update
from sqlalchemy.orm import Session

from ...models.dialects import dialect_of
from ...models.tables import SettledCount
from ..kinds import COUNTED

# Rows per kind per transaction of `count_settled`.
COUNT_BATCH = 1000

Counts = dict[tuple[str, str, str], int]  # (kind, status, workspace) -> rows


def uncounted(table: Any) -> Any:
    """SQL: the row is not counted under its status (the partial index ix_<table>_uncounted
    holds these rows; this is its condition, stated the same way)."""
    return table.counted_as.is_distinct_from(table.status)


def count_settled(session: Session, limit: int = COUNT_BATCH) -> int:
    """Count at most `limit` rows of each kind that settled, or left the status they were
    counted under, since the last call; the number of rows moved (`limit` of a kind: call
    again)."""
    deltas: Counter[tuple[str, str, str]] = Counter()
    moved = 0
    locks_rows = dialect_of(session).locks_rows
    for kind, declared in COUNTED.items():
        table, key, settled = declared.table, declared.key, declared.settled
        query = (
            select(key, table.workspace_id, table.status, table.counted_as)
            .where(uncounted(table), or_(table.status.in_(settled), table.counted_as.is_not(None)))
            # in the index's order: a planner that cannot tell how few rows are uncounted
            # still reads them through it rather than the table
            .order_by(table.status, table.workspace_id, table.counted_as)
            .limit(limit)
        )
        if locks_rows:  # a row a worker is changing now is counted on the next call
            query = query.with_for_update(skip_locked=True)
        by_target: dict[str | None, list[str]] = {}
        for row_id, workspace_id, status, counted_as in session.execute(query).all():
            target = status if status in settled else None
            if target is not None:
                deltas[(kind, target, workspace_id)] += 1
            if counted_as is not None:
                deltas[(kind, counted_as, workspace_id)] -= 1
            by_target.setdefault(target, []).append(row_id)
            moved += 1
        for target, ids in by_target.items():
            session.execute(
                update(table)
                .where(key.in_(ids))
                .values(counted_as=target)
                .execution_options(synchronize_session=False)
            )
    add_counts(session, deltas)
    return moved


def add_counts(session: Session, deltas: Counts) -> None:
    """Add `deltas` to settled_counts, in key order (two writers never wait on each other in a
    cycle)."""
    insert = dialect_of(session).insert
    for (kind, status, workspace_id), n in sorted(deltas.items()):
        if n == 0:
            continue
        statement = insert(SettledCount).values(
            kind=kind, workspace_id=workspace_id, status=status, count=n
        )
        session.execute(
            statement.on_conflict_do_update(
                index_elements=["kind", "workspace_id", "status"],
                set_={"count": SettledCount.count + n},
            )
        )


def operation_counts(session: Session) -> Counts:
    """Rows of every counted kind by (kind, status, workspace), zeros left out: the kept
    counts and, read with them in one statement (one snapshot), the rows not counted under
    their status — each under its status, and out of the status it is counted under."""
    parts: list[Any] = [
        select(
            SettledCount.kind,
            SettledCount.status,
            literal_column("NULL").label("counted_as"),
            SettledCount.workspace_id,
            SettledCount.count,
        )
    ]
    for kind, declared in COUNTED.items():
        table = declared.table
        columns = (table.status, table.workspace_id, table.counted_as)  # the index's
        parts.append(
            select(
                literal_column(f"'{kind}'"),  # a constant of ours, not input
                table.status,
                table.counted_as,
                table.workspace_id,
                func.count(),
            )
            .where(uncounted(table))
            .group_by(*columns)
        )
    found: Counter[tuple[str, str, str]] = Counter()
    for kind, status, counted_as, workspace_id, n in session.execute(union_all(*parts)).all():
        found[(kind, status, workspace_id)] += n
        if counted_as is not None:
            found[(kind, counted_as, workspace_id)] -= n
    return {key: n for key, n in found.items() if n}


def by_status(counts: Counts, kind: str) -> dict[str, int]:
    """One kind's rows by status, over every workspace."""
    found: dict[str, int] = {}
    for (k, status, _workspace), n in counts.items():
        if k == kind:
            found[status] = found.get(status, 0) + n
    return found

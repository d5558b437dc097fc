"""Retention (docs/operations.md): settled operations and events older than the retention window
(default 30 days, never under 24 hours, so a replay within a day always finds its operation)
are deleted by a beat task in bounded batches, each found through an index on its age (so a
batch costs the same however long the history) and taken out of the kept counts
(counts.py) in the deleting transaction. Fence rows are permanent (they forbid their
generation forever) and are never pruned; nothing open, live or still waited on is pruned.
"""

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, and_, literal, select
from sqlalchemy.orm import Session

from ...models.dialects import dialect_of
from ...models.enums import TurnPhase
from ...models.operations import MaintenanceRun
from ...models.tables import SessionEvent, Turn
from ..errors import InvalidArgument
from ..kinds import KINDS
from ..kinds.maintenance import LIVE_MAINTENANCE_STATUSES
from .counts import add_counts

DEFAULT_RETENTION_DAYS = 30.0
MIN_RETENTION_DAYS = 1.0
BATCH = 500


def check_retention_days(value: Any) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not MIN_RETENTION_DAYS <= value <= 36500
    ):
        raise InvalidArgument(
            f"retention must be {MIN_RETENTION_DAYS:g} to 36500 days (a replay within a day "
            "must find its operation)",
            field="retention_days",
        )
    return float(value)


@dataclass(frozen=True)
class Rule:
    """One kind of row: which of them are settled and older than `cutoff`; `counted`: the kind
    whose kept counts (counts.py) its rows are in, if they are."""

    name: str
    table: Any
    prunable: Callable[[datetime], ColumnElement[bool]]
    counted: str | None = None


def _live_run_records() -> Any:
    return select(literal("maintenance:") + MaintenanceRun.run_id).where(
        MaintenanceRun.status.in_(LIVE_MAINTENANCE_STATUSES)
    )


# Each kind's settled rows (fences never: they forbid their generation for ever), then the rows
# of no kind: settled turns, and the session events of no live maintenance run.
RULES = (
    *(
        Rule(
            kind.table.__tablename__, kind.table, kind.prunable, kind.name if kind.settled else None
        )
        for kind in KINDS.values()
        if kind.prunable is not None
    ),
    Rule(
        "turns",
        Turn,
        lambda cutoff: and_(Turn.phase == TurnPhase.SETTLED, Turn.settled_at < cutoff),
    ),
    Rule(
        "session_events",
        SessionEvent,
        lambda cutoff: and_(
            SessionEvent.created_at < cutoff,
            SessionEvent.record_id.not_in(_live_run_records()),
        ),
    ),
)


@dataclass
class PruneResult:
    cutoff: datetime
    dry_run: bool
    rows: dict[str, int] = field(default_factory=dict)  # per table: pruned (or prunable)


def prune_batch(
    session: Session, now: datetime, retention_days: float, batch: int, dry_run: bool
) -> PruneResult:
    """At most `batch` rows of each kind, in the caller's transaction. A dry run counts what
    one batch would delete and deletes nothing."""
    cutoff = now - timedelta(days=check_retention_days(retention_days))
    result = PruneResult(cutoff=cutoff, dry_run=dry_run)
    for rule in RULES:
        where = rule.prunable(cutoff)
        if dry_run:
            found = select(literal(1)).select_from(rule.table).where(where).limit(batch)
            result.rows[rule.name] = len(session.execute(found).all())
        else:
            result.rows[rule.name] = _delete(session, rule, where, batch)
    return result


def _delete(session: Session, rule: Rule, where: ColumnElement[bool], batch: int) -> int:
    """Delete up to `batch` of these rows; take those counted out of the kept counts."""
    table = rule.table
    kind = rule.counted
    deleted = session.execute(
        dialect_of(session)
        .delete_some(table, where, batch)
        .returning(*((table.workspace_id, table.counted_as) if kind else (literal(1),)))
        .execution_options(synchronize_session=False)
    ).all()
    if kind is not None:
        gone: Counter[tuple[str, str, str]] = Counter()
        for workspace_id, counted_as in deleted:
            if counted_as is not None:  # not yet counted: it is gone from what a reader adds
                gone[(kind, counted_as, workspace_id)] -= 1
        add_counts(session, gone)
    return len(deleted)

"""The operation kinds, one module each (docs/architecture.md: adding an operation kind): its
statuses, the client's record of a row, its task names and its declaration (`KIND`), which
the catalog, the counts, retention, the client's `wait`, the sweeper and the CLI iterate."""

from datetime import datetime
from typing import Any

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from ...models.db import rowcount
from .. import leases
from ..task_names import ENSURE_SESSION_TASK, GET_OPERATION_TASK, RETRY_OPERATION_TASK
from . import cancel, fence, goal, maintenance, prompt, stop
from .base import Kind

# In the order the catalog looks an id up, and the sweeper republishes: fences before the
# rest (a revoked target must never replay before its fence).
KINDS: dict[str, Kind] = {
    k.name: k
    for k in (goal.KIND, fence.KIND, cancel.KIND, maintenance.KIND, prompt.KIND, stop.KIND)
}
COUNTED = {name: kind for name, kind in KINDS.items() if kind.settled}
_BY_RECORD = {kind.record_type: kind for kind in KINDS.values()}
# The tasks whose results a producer may read (stored when a result backend is configured).
RESULT_TASKS = (
    *(name for kind in KINDS.values() for name in kind.public_tasks),
    GET_OPERATION_TASK,
    ENSURE_SESSION_TASK,
    RETRY_OPERATION_TASK,
)


def kind_of_record(record: Any) -> Kind | None:
    """The kind whose record this is, or None."""
    return _BY_RECORD.get(type(record))


def _republish_due(kind: Kind, now: datetime, cutoff: datetime) -> list[Any]:
    spec = kind.republish
    if spec is None:
        raise ValueError(f"the sweeper does not republish {kind.noun}s")
    table = kind.table
    due = [table.status.in_(spec.statuses), table.next_attempt_at <= now, leases.unheld(table, now)]
    if spec.grace_first_attempt:
        due.append(or_(table.attempt > 0, table.next_attempt_at <= cutoff))
    return due


def due_to_republish(
    session: Session, kind: Kind, now: datetime, cutoff: datetime, limit: int
) -> list[str]:
    """Ids of a kind's rows that are due and no live lease holds (a row never attempted only
    once due before `cutoff`, with `grace_first_attempt`), oldest due first."""
    due = _republish_due(kind, now, cutoff)
    query = select(kind.key).where(*due).order_by(kind.table.next_attempt_at).limit(limit)
    return list(session.execute(query).scalars())


def reserve_republish(
    session: Session, kind: Kind, row_id: str, now: datetime, cutoff: datetime, until: datetime
) -> bool:
    """The sweeper publishes this row again: reserved until `until` if it is still due, so
    two sweeps never both publish it."""
    result = session.execute(
        update(kind.table)
        .where(kind.key == row_id, *_republish_due(kind, now, cutoff))
        .values(next_attempt_at=until)
    )
    return rowcount(result) == 1

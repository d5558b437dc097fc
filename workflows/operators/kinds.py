"""The operation kinds, one declaration each (docs/architecture.md: adding an operation kind):
what the catalog, the counts, retention, the client's `wait`, the sweeper and the CLI iterate
instead of naming kinds.

A kind is its table and id column, the client's record of a row, every status a record can
have and those it settles in (counted once settled, docs/operations.md: counts), which settled
rows retention may delete, and what the sweeper publishes again when a row's message was lost
or its worker died (`Republish`; a kind with a recovery of its own names none).
"""

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, and_, not_, or_, select, update
from sqlalchemy.orm import Session

from ...models.db import rowcount
from ...models.enums import (
    LIVE_MAINTENANCE_STATUSES,
    TERMINAL_MAINTENANCE_STATUSES,
    TERMINAL_OPERATION_STATUSES,
    CancelStatus,
    FenceStatus,
    MaintenanceStatus,
    OperationStatus,
    PromptStatus,
)
from ...models.tables import (
    CancelOperation,
    GoalFence,
    GoalOperation,
    GoalState,
    MaintenanceRun,
    Prompt,
    SessionStop,
)
from .. import leases, records
from ..activity import stops
from ..task_names import CANCEL_APPLY_TASK, FENCE_APPLY_TASK


@dataclass(frozen=True)
class Republish:
    """The sweeper publishes `task(kwarg=id)` again for a row in `statuses` whose next attempt
    is due and that no live lease holds; with `grace_first_attempt`, a row never attempted
    only once its own publish had time to arrive."""

    statuses: tuple[str, ...]
    task: str
    kwarg: str
    grace_first_attempt: bool


@dataclass(frozen=True)
class Kind:
    name: str  # as `op list --kind` and the counts name it
    noun: str  # as a message names one ("goal operation op-1")
    table: Any
    key: Any  # the id column; the record's field of the same name
    created: Any  # when it was accepted
    error: Any  # why it failed, if it did (None: the kind keeps no error)
    record_type: type
    record: Callable[[Session, Any], Any]
    statuses: tuple[str, ...]  # every status its records can have
    settled: tuple[str, ...] = ()  # counted in these once settled (none: not counted)
    # Retention: its rows that are settled and older than the cutoff (None: kept forever).
    prunable: Callable[[datetime], ColumnElement[bool]] | None = None
    republish: Republish | None = None

    def id_of(self, record: Any) -> str:
        return getattr(record, self.key.key)


def _plain(record_type) -> Callable[[Session, Any], Any]:
    return lambda _s, row: records.record_of(record_type, row)


GOAL_SETTLED = tuple(TERMINAL_OPERATION_STATUSES)


def _goal_prunable(cutoff: datetime) -> ColumnElement[bool]:
    return and_(
        GoalOperation.created_at < cutoff,  # what the index on age finds
        GoalOperation.status.in_(GOAL_SETTLED),
        or_(
            GoalOperation.completed_at < cutoff,
            and_(GoalOperation.completed_at.is_(None), GoalOperation.created_at < cutoff),
        ),
        # the operation a goal state still points at stays (its session's state, found by
        # its key: one lookup per row, however many sessions there are)
        ~select(GoalState.pending_operation_id)
        .where(
            GoalState.workspace_id == GoalOperation.workspace_id,
            GoalState.session_id == GoalOperation.session_id,
            GoalState.pending_operation_id == GoalOperation.operation_id,
        )
        .exists(),
    )


def _stop_prunable(cutoff: datetime) -> ColumnElement[bool]:
    return and_(
        SessionStop.created_at < cutoff,
        not_(
            select(MaintenanceRun.run_id)
            .where(
                MaintenanceRun.run_id == SessionStop.run_id,
                MaintenanceRun.status.in_(LIVE_MAINTENANCE_STATUSES),
            )
            .exists()
        ),
    )


def _settled_before(table: Any, settled: tuple[str, ...], age: Any = None, end: Any = None):
    """Rows in a settled status accepted (`age`, the indexed column) before the cutoff, and,
    given `end`, settled before it too."""
    age = table.created_at if age is None else age
    return lambda cutoff: and_(
        age < cutoff, table.status.in_(settled), *(() if end is None else (end < cutoff,))
    )


CANCEL_SETTLED = (CancelStatus.COMPLETED, CancelStatus.FAILED)
RUN_SETTLED = tuple(TERMINAL_MAINTENANCE_STATUSES)
PROMPT_SETTLED = (PromptStatus.COMPLETED, PromptStatus.FAILED)

# In the order the catalog looks an id up, and the sweeper republishes: fences before the
# rest (a revoked target must never replay before its fence).
KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind(
            "goal",
            "goal operation",
            GoalOperation,
            GoalOperation.operation_id,
            GoalOperation.created_at,
            GoalOperation.last_error,
            records.GoalOperation,
            _plain(records.GoalOperation),
            tuple(OperationStatus),
            settled=GOAL_SETTLED,
            prunable=_goal_prunable,
        ),
        Kind(
            "fence",
            "fence",
            GoalFence,
            GoalFence.fence_id,
            GoalFence.created_at,
            GoalFence.last_error,
            records.Fence,
            _plain(records.Fence),
            tuple(FenceStatus),
            settled=(FenceStatus.COMPLETED, FenceStatus.FAILED),
            # Never pruned: a fence forbids its generation for ever.
            republish=Republish(
                (FenceStatus.PENDING, FenceStatus.PROCESSING),
                FENCE_APPLY_TASK,
                "fence_id",
                grace_first_attempt=True,
            ),
        ),
        Kind(
            "cancel",
            "turn cancel",
            CancelOperation,
            CancelOperation.operation_id,
            CancelOperation.created_at,
            CancelOperation.last_error,
            records.TurnCancel,
            _plain(records.TurnCancel),
            tuple(CancelStatus),
            settled=CANCEL_SETTLED,
            prunable=_settled_before(CancelOperation, CANCEL_SETTLED),
            republish=Republish(
                (CancelStatus.PREPARED, CancelStatus.LEASED),
                CANCEL_APPLY_TASK,
                "operation_id",
                grace_first_attempt=False,
            ),
        ),
        Kind(
            "maintenance",
            "maintenance run",
            MaintenanceRun,
            MaintenanceRun.run_id,
            MaintenanceRun.started_at,
            MaintenanceRun.detail,
            records.MaintenanceRun,
            _plain(records.MaintenanceRun),
            tuple(MaintenanceStatus),
            settled=RUN_SETTLED,
            prunable=_settled_before(
                MaintenanceRun, RUN_SETTLED, MaintenanceRun.started_at, MaintenanceRun.finished_at
            ),
        ),
        Kind(
            "prompt",
            "prompt",
            Prompt,
            Prompt.prompt_id,
            Prompt.created_at,
            Prompt.last_error,
            records.Prompt,
            _plain(records.Prompt),
            tuple(PromptStatus),
            settled=PROMPT_SETTLED,
            prunable=_settled_before(Prompt, PROMPT_SETTLED),
        ),
        Kind(
            "stop",
            "session stop",
            SessionStop,
            SessionStop.stop_id,
            SessionStop.created_at,
            None,
            records.SessionStop,
            stops.record,
            # Stops have no status column: their status is derived (see stops.record).
            ("stopping", "completed"),
            prunable=_stop_prunable,
        ),
    )
}
COUNTED = {name: kind for name, kind in KINDS.items() if kind.settled}
_BY_RECORD = {kind.record_type: kind for kind in KINDS.values()}


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

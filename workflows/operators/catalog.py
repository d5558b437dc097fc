"""Every kind of operation found by id, by (workspace, session, client submit ID), and listed by
kind, status, workspace, session and age (docs/operations.md), for the client and `agent-radar op`.

The kinds: goal operations (fence-made clears included), fences, turn cancels, maintenance runs,
prompts and session stops. A session stop's status is derived from the turn and the run it
named (`stopping` until both ended, then `completed`).
"""

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from ...models.enums import (
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
    MaintenanceRun,
    Prompt,
    SessionStop,
)
from .. import records
from ..activity import stops
from ..errors import InvalidArgument, NotFound
from ..validation import check_choice, check_id, check_limit


@dataclass(frozen=True)
class Kind:
    name: str
    table: Any
    key: Any  # the id column
    created: Any  # when it was accepted
    error: Any  # why it failed, if it did (None: the kind keeps no error)
    record: Callable[[Session, Any], Any]
    statuses: tuple[str, ...]  # every status its records can have


def _plain(record_type) -> Callable[[Session, Any], Any]:
    return lambda _s, row: records.record_of(record_type, row)


KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind(
            "goal",
            GoalOperation,
            GoalOperation.operation_id,
            GoalOperation.created_at,
            GoalOperation.last_error,
            _plain(records.GoalOperation),
            tuple(OperationStatus),
        ),
        Kind(
            "fence",
            GoalFence,
            GoalFence.fence_id,
            GoalFence.created_at,
            GoalFence.last_error,
            _plain(records.Fence),
            tuple(FenceStatus),
        ),
        Kind(
            "cancel",
            CancelOperation,
            CancelOperation.operation_id,
            CancelOperation.created_at,
            CancelOperation.last_error,
            _plain(records.TurnCancel),
            tuple(CancelStatus),
        ),
        Kind(
            "maintenance",
            MaintenanceRun,
            MaintenanceRun.run_id,
            MaintenanceRun.started_at,
            MaintenanceRun.detail,
            _plain(records.MaintenanceRun),
            tuple(MaintenanceStatus),
        ),
        Kind(
            "prompt",
            Prompt,
            Prompt.prompt_id,
            Prompt.created_at,
            Prompt.last_error,
            _plain(records.Prompt),
            tuple(PromptStatus),
        ),
        Kind(
            "stop",
            SessionStop,
            SessionStop.stop_id,
            SessionStop.created_at,
            None,
            stops.record,
            # Stops have no status column: their status is derived (see stops.record).
            ("stopping", "completed"),
        ),
    )
}
RECORD_KINDS = {
    records.GoalOperation: "goal",
    records.Fence: "fence",
    records.TurnCancel: "cancel",
    records.MaintenanceRun: "maintenance",
    records.Prompt: "prompt",
    records.SessionStop: "stop",
}


def kind_of(record: Any) -> str:
    """The kind of an operation's record (as `op show` and `op find` print it)."""
    return RECORD_KINDS[type(record)]


# Every status an operation of some kind can have: a filter on any other finds nothing, so
# it is a typo.
STATUSES = sorted({str(status) for kind in KINDS.values() for status in kind.statuses})


def check_kind(value: Any) -> str:
    return check_choice("kind", value, set(KINDS))


def show(session: Session, op_id: str, workspace_id: str | None) -> tuple[str, Any]:
    """(kind, record) of the operation with this id, of any kind; NotFound if none (or if
    it belongs to another workspace than `workspace_id`)."""
    for kind in KINDS.values():
        row = session.get(kind.table, op_id)
        if row is not None and (workspace_id is None or row.workspace_id == workspace_id):
            return kind.name, kind.record(session, row)
    raise NotFound(f"no operation {op_id}", operation_id=op_id)


def find(
    session: Session, workspace_id: str, session_id: str, client_submit_id: str
) -> list[tuple[str, Any]]:
    """Every operation a client submitted under this ID in this session, one per family that has it
    (client submit IDs are scoped per family, docs/lifecycles.md: accept). Turn cancels have no
    client submit ID."""
    found = []
    for kind in KINDS.values():
        if not hasattr(kind.table, "client_submit_id"):
            continue
        row = session.execute(
            select(kind.table).where(
                kind.table.workspace_id == workspace_id,
                kind.table.session_id == session_id,
                kind.table.client_submit_id == client_submit_id,
            )
        ).scalar_one_or_none()
        if row is not None:
            found.append((kind.name, kind.record(session, row)))
    return found


@dataclass(frozen=True)
class ListQuery:
    kind: str | None = None
    status: str | None = None
    workspace_id: str | None = None
    session_id: str | None = None
    older_than_s: float | None = None
    limit: int = 50
    newer_than_s: float | None = None
    newest_first: bool = False

    @classmethod
    def parse(
        cls,
        kind: Any = None,
        status: Any = None,
        workspace_id: Any = None,
        session_id: Any = None,
        older_than_s: Any = None,
        limit: Any = 50,
        newer_than_s: Any = None,
        newest_first: Any = False,
    ) -> "ListQuery":
        if session_id is not None and workspace_id is None:
            raise InvalidArgument("a session filter needs its workspace", field="session_id")
        for field, age in (("older_than_s", older_than_s), ("newer_than_s", newer_than_s)):
            if age is not None and (
                isinstance(age, bool)
                or not isinstance(age, int | float)
                or not 0 <= age <= 10 * 365 * 86400
            ):
                raise InvalidArgument(
                    f"{field} must be a number of seconds (0 to 10 years)", field=field
                )
        if not isinstance(newest_first, bool):
            raise InvalidArgument("newest_first must be true or false", field="newest_first")
        return cls(
            kind=None if kind is None else check_kind(kind),
            status=None if status is None else check_choice("status", status, set(STATUSES)),
            workspace_id=None if workspace_id is None else check_id("workspace_id", workspace_id),
            session_id=None if session_id is None else check_id("session_id", session_id),
            older_than_s=older_than_s,
            limit=check_limit(limit),
            newer_than_s=newer_than_s,
            newest_first=newest_first,
        )


def list_operations(session: Session, query: ListQuery, now: datetime) -> list[Any]:
    """The operations that match, oldest first (or newest first), at most `query.limit` of
    each kind asked and of the whole answer."""
    found: list[records.OperationSummary] = []
    for kind in KINDS.values():
        if query.kind is not None and kind.name != query.kind:
            continue
        where = []
        if query.workspace_id is not None:
            where.append(kind.table.workspace_id == query.workspace_id)
        if query.session_id is not None:
            where.append(kind.table.session_id == query.session_id)
        if query.older_than_s is not None:
            where.append(kind.created <= now - timedelta(seconds=query.older_than_s))
        if query.newer_than_s is not None:
            where.append(kind.created >= now - timedelta(seconds=query.newer_than_s))
        derived = kind.name == "stop"
        if query.status is not None and not derived:
            where.append(kind.table.status == query.status)
        if query.status is not None and query.status not in kind.statuses:
            continue
        order = kind.created.desc() if query.newest_first else kind.created
        rows = session.execute(
            select(kind.table).where(*where).order_by(order).limit(query.limit)
        ).scalars()
        for row in rows:
            status = row.status if not derived else stops.record(session, row).status
            if query.status is not None and status != query.status:
                continue
            found.append(
                records.OperationSummary(
                    kind=kind.name,
                    id=getattr(row, kind.key.key),
                    workspace_id=row.workspace_id,
                    session_id=row.session_id,
                    client_submit_id=getattr(row, "client_submit_id", None),
                    status=status,
                    created_at=getattr(row, kind.created.key),
                    last_error=getattr(row, kind.error.key) if kind.error is not None else None,
                )
            )
    found.sort(key=lambda o: (o.created_at, o.kind, o.id), reverse=query.newest_first)
    return found[: query.limit]

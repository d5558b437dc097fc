"""Every kind of operation found by id, by (workspace, session, client submit ID), and listed by
kind, status, workspace, session and age (docs/operations.md), for the client and `agent-radar op`.

The kinds (kinds.py): goal operations (fence-made clears included), fences, turn cancels,
maintenance runs, prompts and session stops. A session stop's status is derived from the turn
and the run it named (`stopping` until both ended, then `completed`).
"""

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from .. import records
from ..errors import InvalidArgument, NotFound
from ..kinds import KINDS, kind_of_record
from ..kinds.base import Kind
from ..validation import check_choice, check_id, check_limit

# The oldest age a listing takes (`op list --older-than`, `--since`).
MAX_AGE_S = 10 * 365 * 86400


def kind_of(record: Any) -> str:
    """The kind of an operation's record (as `op show` and `op find` print it)."""
    kind = kind_of_record(record)
    if kind is None:
        raise InvalidArgument(f"{type(record).__name__} is no operation's record")
    return kind.name


# Every status an operation of some kind can have: a filter on any other finds nothing, so
# it is a typo.
STATUSES = sorted({str(status) for kind in KINDS.values() for status in kind.statuses})


def check_kind(value: Any) -> str:
    return check_choice("kind", value, set(KINDS))


def show(session: Session, op_id: str, workspace_id: str | None) -> tuple[str, Any]:
    """(kind, record) of the operation with this id, of any kind; NotFound if none (or if
    it belongs to another workspace than `workspace_id`)."""
    for kind in KINDS.values():
        found = get(session, kind, op_id, workspace_id)
        if found is not None:
            return kind.name, found
    raise NotFound(f"no operation {op_id}", operation_id=op_id)


def get(session: Session, kind: Kind, op_id: str, workspace_id: str | None = None) -> Any:
    """The record of this kind with this id, or None (also if it belongs to another
    workspace than `workspace_id`)."""
    row = session.get(kind.table, op_id)
    if row is None or workspace_id is not None and row.workspace_id != workspace_id:
        return None
    return kind.record(session, row)


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
                or not 0 <= age <= MAX_AGE_S
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
        derived = not hasattr(kind.table, "status")  # its record derives one (a stop)
        if query.status is not None and not derived:
            where.append(kind.table.status == query.status)
        if query.status is not None and query.status not in kind.statuses:
            continue
        order = kind.created.desc() if query.newest_first else kind.created
        rows = session.execute(
            select(kind.table).where(*where).order_by(order).limit(query.limit)
        ).scalars()
        for row in rows:
            status = row.status if not derived else kind.record(session, row).status
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

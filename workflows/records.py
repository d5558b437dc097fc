"""Frozen records returned by the client (docs/packaging.md) that belong to no operation kind
(each kind's is in its module, workflows/kinds/); their fields are the columns of the tables
(models/tables.py)."""

import dataclasses
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

R = TypeVar("R", bound="DataclassInstance")


def from_row(cls: type[R], row: Any, **extra: Any) -> R:
    """A row as a record, field by field (`extra`: the fields a row has no column for)."""
    values = {f.name: getattr(row, f.name) for f in dataclasses.fields(cls) if f.name not in extra}
    return cls(**values, **extra)


def record_of(record_type: type[R], row: Any) -> R:
    """A row as its record: through the record's own `from_row` where it has one (derived
    fields), else field by field."""
    own = getattr(record_type, "from_row", None)
    return own(row) if own is not None else from_row(record_type, row)


def as_dict(record: Any) -> dict[str, Any]:
    def convert(value):
        return value.isoformat() if isinstance(value, datetime) else value

    return {k: convert(v) for k, v in dataclasses.asdict(record).items()}


@dataclass(frozen=True)
class GoalState:
    workspace_id: str
    session_id: str
    revision: int
    desired: dict | None
    observed: dict | None
    tombstoned: bool
    sync_status: str
    pending_operation_id: str | None
    last_error: str | None


@dataclass(frozen=True)
class SessionInfo:
    workspace_id: str
    session_id: str
    provider: str | None
    provider_session_id: str | None
    live: bool | None
    runtime_epoch: int
    host_id: str
    admission: str
    active_turn_id: str | None
    last_report_at: datetime | None


@dataclass(frozen=True)
class Host:
    """A registered agent host (docs/lifecycles.md: sessions) and how many sessions are bound to
    it."""

    host_id: str
    url: str
    sessions: int = 0


@dataclass(frozen=True)
class HistoryRow:
    """One row per record (record_id) at the position of its first event, holding its
    latest revision; a record that is not terminal yet shows as pending."""

    sequence: int
    kind: str
    record_id: str
    revision: int | None
    payload: dict | None
    pending: bool
    created_at: datetime


@dataclass(frozen=True)
class OperationSummary:
    """One line of `op list` (docs/operations.md): any kind of operation."""

    kind: str  # goal, fence, cancel, maintenance, prompt, stop
    id: str
    workspace_id: str
    session_id: str
    client_submit_id: str | None
    status: str
    created_at: datetime
    last_error: str | None

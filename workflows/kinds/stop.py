"""The session stop kind (docs/lifecycles.md: sessions): its record, whose status is derived,
its task name and declaration. Its rules are `activity/stops.py`."""

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import ColumnElement, and_, not_, select
from sqlalchemy.orm import Session

from ...models.enums import TurnPhase
from ...models.operations import MaintenanceRun as MaintenanceRunRow
from ...models.operations import SessionStop as SessionStopRow
from ...models.tables import Turn
from ..records import from_row
from .base import Kind
from .maintenance import LIVE_MAINTENANCE_STATUSES, TERMINAL_MAINTENANCE_STATUSES

STOP_SESSION_TASK = "agent_radar.stop_session"  # public


@dataclass(frozen=True)
class SessionStop:
    """`stop_session`'s record: `status` is `stopping` until the turn and the maintenance run
    it named have ended, then `completed` (`settled`)."""

    stop_id: str
    workspace_id: str
    session_id: str
    client_submit_id: str
    reason: str
    turn_id: str | None
    cancel_operation_id: str | None
    run_id: str | None
    created_at: datetime
    status: str = "stopping"
    settled: bool = False


def read(session: Session, stop_row: SessionStopRow) -> SessionStop:
    """The stop as a record: settled once its turn and its run (if any) have ended."""
    turn_done = stop_row.turn_id is None or _turn_ended(session, stop_row)
    run = session.get(MaintenanceRunRow, stop_row.run_id) if stop_row.run_id else None
    run_done = run is None or run.status in TERMINAL_MAINTENANCE_STATUSES
    settled = turn_done and run_done
    status = "completed" if settled else "stopping"
    return from_row(SessionStop, stop_row, status=status, settled=settled)


def _turn_ended(session: Session, stop_row: SessionStopRow) -> bool:
    turn = session.get(Turn, (stop_row.workspace_id, stop_row.session_id, stop_row.turn_id))
    return turn is None or turn.phase == TurnPhase.SETTLED


def _prunable(cutoff: datetime) -> ColumnElement[bool]:
    return and_(
        SessionStopRow.created_at < cutoff,
        not_(
            select(MaintenanceRunRow.run_id)
            .where(
                MaintenanceRunRow.run_id == SessionStopRow.run_id,
                MaintenanceRunRow.status.in_(LIVE_MAINTENANCE_STATUSES),
            )
            .exists()
        ),
    )


KIND = Kind(
    "stop",
    "session stop",
    SessionStopRow,
    SessionStopRow.stop_id,
    SessionStopRow.created_at,
    None,
    SessionStop,
    # Stops have no status column: their status is derived (`read`).
    ("stopping", "completed"),
    prunable=_prunable,
    read=read,
    public_tasks=(STOP_SESSION_TASK,),
)

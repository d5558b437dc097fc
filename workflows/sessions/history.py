"""`history()`: the session's records, one row per record at its first position."""

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ...models.tables import SessionEvent
from ..kinds.maintenance import TERMINAL_MAINTENANCE_STATUSES
from ..records import HistoryRow


def session_history(
    session: Session, workspace_id: str, session_id: str, limit: int
) -> list[HistoryRow]:
    scope = (SessionEvent.workspace_id == workspace_id, SessionEvent.session_id == session_id)
    firsts = (
        select(
            SessionEvent.record_id,
            func.min(SessionEvent.sequence).label("first"),
            func.max(SessionEvent.sequence).label("last"),
        )
        .where(*scope)
        .group_by(SessionEvent.record_id)
        .order_by(func.min(SessionEvent.sequence))
        .limit(limit)
        .subquery()
    )
    rows = session.execute(
        select(firsts.c.first, SessionEvent)
        .join(SessionEvent, (SessionEvent.sequence == firsts.c.last) & scope[0] & scope[1])
        .order_by(firsts.c.first)
    ).all()
    history = []
    for first, latest in rows:
        record = (latest.payload or {}).get("record") or {}
        pending = (
            latest.kind == "diagnostic"
            and record.get("status") not in TERMINAL_MAINTENANCE_STATUSES
        )
        history.append(
            HistoryRow(
                sequence=first,
                kind=latest.kind,
                record_id=latest.record_id,
                revision=latest.revision,
                payload=latest.payload,
                pending=pending,
                created_at=latest.created_at,
            )
        )
    return history

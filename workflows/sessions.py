"""The per-session row every writer of a session locks first, and the session event log."""

from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from models.db import insert_ignore
from models.tables import AgentSession, SessionEvent


def lock_session(session: Session, workspace_id: str, session_id: str) -> AgentSession:
    """Create the session row if needed and lock it for this transaction.

    Every transaction that changes a session's goal, operations or events takes this lock
    first, so writers of one session take turns in one order and never deadlock.
    """
    query = (select(AgentSession)
             .where(AgentSession.workspace_id == workspace_id,
                    AgentSession.session_id == session_id)
             .with_for_update()
             .execution_options(populate_existing=True))
    row = session.execute(query).scalar_one_or_none()
    if row is None:
        insert_ignore(session, AgentSession.__table__, {
            "workspace_id": workspace_id, "session_id": session_id, "runtime_epoch": 0,
            "admission": "open", "event_sequence": 0})
        row = session.execute(query).scalar_one()
    return row


def append_event(session: Session, row: AgentSession, *, kind: str, record_id: str,
                 idempotency_key: str, now: datetime, revision: int | None = None,
                 payload: dict[str, Any] | None = None, optional: bool = False,
                 new_key: bool = False) -> SessionEvent:
    """Append one event at the next gap-free sequence; a repeated key returns the first.

    `new_key` skips the lookup when the caller just created the record the key names (the
    unique constraint still guards it)."""
    if not new_key:
        existing = session.execute(
            select(SessionEvent).where(SessionEvent.idempotency_key == idempotency_key)
        ).scalar_one_or_none()
        if existing is not None:
            return existing
    row.event_sequence += 1
    event = SessionEvent(
        workspace_id=row.workspace_id, session_id=row.session_id, sequence=row.event_sequence,
        kind=kind, record_id=record_id, revision=revision, payload=payload, optional=optional,
        idempotency_key=idempotency_key, created_at=now)
    session.add(event)
    session.flush()
    return event

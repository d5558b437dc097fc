"""The per-session row every writer of a session locks first, and the session event log."""

from datetime import datetime
from typing import Any

from sqlalchemy import and_, bindparam, insert, select, update
from sqlalchemy.orm import Session

from models.base import table_of
from models.db import insert_ignore
from models.tables import AgentSession, SessionEvent

SESSIONS = table_of(AgentSession)
EVENTS = table_of(SessionEvent)

# Built once: hot paths run these on every operation, and building a statement costs more
# than executing a cached one.
_NEXT_SEQUENCE = (
    update(SESSIONS)
    .where(
        SESSIONS.c.workspace_id == bindparam("b_ws"), SESSIONS.c.session_id == bindparam("b_sid")
    )
    .values(event_sequence=SESSIONS.c.event_sequence + 1)
    .returning(SESSIONS.c.event_sequence)
)
_INSERT_EVENT = insert(EVENTS)


def same_session(a, b):
    """Join condition: rows of `a` and `b` belong to the same session. Each is a mapped
    class, an alias, or a table's columns (`table.c`)."""
    return and_(a.workspace_id == b.workspace_id, a.session_id == b.session_id)


def new_session_values(workspace_id: str, session_id: str) -> dict[str, Any]:
    return {
        "workspace_id": workspace_id,
        "session_id": session_id,
        "runtime_epoch": 0,
        "fences_epoch": 0,
        "host_id": "default",
        "admission": "open",
        "event_sequence": 0,
    }


def lock_session(session: Session, workspace_id: str, session_id: str) -> AgentSession:
    """Create the session row if needed and lock it for this transaction.

    Every transaction that changes a session's goal, operations or events takes this lock
    first, so writers of one session take turns in one order and never deadlock.
    """
    # Sessions do not autoflush, and the re-read below (populate_existing) would discard a
    # change this transaction made to the row and has not flushed yet.
    session.flush()
    query = (
        select(AgentSession)
        .where(AgentSession.workspace_id == workspace_id, AgentSession.session_id == session_id)
        .with_for_update()
        .execution_options(populate_existing=True)
    )
    row = session.execute(query).scalar_one_or_none()
    if row is None:
        insert_ignore(session, SESSIONS, new_session_values(workspace_id, session_id))
        row = session.execute(query).scalar_one()
    return row


def append_event(
    session: Session,
    workspace_id: str,
    session_id: str,
    *,
    kind: str,
    record_id: str,
    idempotency_key: str,
    now: datetime,
    revision: int | None = None,
    payload: dict[str, Any] | None = None,
    optional: bool = False,
) -> int:
    """Append one event at the next gap-free sequence of a session whose row this
    transaction has locked; returns the sequence. The counter is bumped in the database,
    never from a loaded row, so it is right whatever the caller loaded before. The
    idempotency key is unique: callers append only for a record they just created."""
    conn = session.connection()
    sequence = conn.execute(
        _NEXT_SEQUENCE, {"b_ws": workspace_id, "b_sid": session_id}
    ).scalar_one()
    conn.execute(
        _INSERT_EVENT,
        {
            "workspace_id": workspace_id,
            "session_id": session_id,
            "sequence": sequence,
            "kind": kind,
            "record_id": record_id,
            "revision": revision,
            "payload": payload,
            "optional": optional,
            "idempotency_key": idempotency_key,
            "created_at": now,
        },
    )
    return sequence

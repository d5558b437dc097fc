"""The per-session row every writer of a session locks first, and the session event log."""

from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import and_, bindparam, or_, select, update
from sqlalchemy.orm import Session

from ...models.base import table_of
from ...models.db import bound, insert_bound, insert_ignore
from ...models.operations import GoalOperation, Prompt
from ...models.tables import AgentSession, SessionEvent
from .. import ids, leases
from ..kinds.goal import OPEN_OPERATION_STATUSES, ProviderPhase
from ..kinds.prompt import PromptStatus

SESSIONS = table_of(AgentSession)
EVENTS = table_of(SessionEvent)

# Built once: hot paths run these on every operation, and building a statement costs more
# than executing a cached one.
_SESSION_KEY = (
    SESSIONS.c.workspace_id == bindparam("b_ws"),
    SESSIONS.c.session_id == bindparam("b_sid"),
)
_NEXT_SEQUENCE = (
    update(SESSIONS)
    .where(*_SESSION_KEY)
    .values(event_sequence=SESSIONS.c.event_sequence + 1)
    .returning(SESSIONS.c.event_sequence)
)
# Event rows take their values from `ev_`-prefixed parameters (event_params), so the insert
# can also run beside other writes (models.db.execute_writes).
INSERT_EVENT = insert_bound(EVENTS, "ev_", [c.name for c in EVENTS.c if not c.primary_key])
# A session's event counter set to a value read under the session lock (`b_seq`).
SET_SEQUENCE = update(SESSIONS).where(*_SESSION_KEY).values(event_sequence=bindparam("b_seq"))


def prompt_in_flight(session: Session, workspace_id: str, session_id: str) -> str | None:
    """The session's prompt sent (or being sent) to its host and not yet ended, if any: its
    turn may run there before any report of it arrives."""
    return session.execute(
        select(Prompt.prompt_id)
        .where(
            Prompt.workspace_id == workspace_id,
            Prompt.session_id == session_id,
            Prompt.status == PromptStatus.DISPATCHED,
        )
        .limit(1)
    ).scalar_one_or_none()


def may_reach_the_host(
    session: Session, workspace_id: str, session_id: str, now: datetime
) -> tuple[str, dict[str, str]] | None:
    """What of ours may still reach the session's host, where a run admitted now would meet
    it: a goal call on the wire (its operation's lease is live; no call outlives its lease),
    a goal the host accepted and has not applied, a restore's clears and goal on their way,
    a prompt sent, or one whose send failed in a way that may have reached the host (its turn
    may run there before any report of it). Each ends by itself: a call's outcome, the
    accepted budget, the restore's lease, a prompt's turn or its send."""
    goal = session.execute(
        select(GoalOperation.operation_id)
        .where(
            GoalOperation.workspace_id == workspace_id,
            GoalOperation.session_id == session_id,
            GoalOperation.status.in_(OPEN_OPERATION_STATUSES),
            or_(
                GoalOperation.lease_expires_at > now,
                GoalOperation.provider_phase == ProviderPhase.ACCEPTED,
            ),
        )
        .limit(1)
    ).scalar_one_or_none()
    if goal is not None:
        return f"goal operation {goal} may still reach the host", {"operation_id": goal}
    if leases.held(session, ids.delivery_name(workspace_id, session_id), now):
        return "a restore is sending the session's goal", {}
    prompt = session.execute(
        select(Prompt.prompt_id)
        .where(
            Prompt.workspace_id == workspace_id,
            Prompt.session_id == session_id,
            or_(
                Prompt.status == PromptStatus.DISPATCHED,
                # A failed send used budget: it was not an offline answer (which uses none
                # and says only of that send), so one of its sends may still land.
                and_(Prompt.status == PromptStatus.QUEUED, Prompt.attempt > 0),
            ),
        )
        .limit(1)
    ).scalar_one_or_none()
    if prompt is not None:
        return f"prompt {prompt} is in flight", {"prompt_id": prompt}
    return None


def same_session(a, b):
    """Join condition: rows of `a` and `b` belong to the same session. Each is a mapped
    class, an alias, or a table's columns (`table.c`)."""
    return and_(a.workspace_id == b.workspace_id, a.session_id == b.session_id)


def new_session_values(
    workspace_id: str, session_id: str, event_sequence: int = 0
) -> dict[str, Any]:
    return {
        "workspace_id": workspace_id,
        "session_id": session_id,
        "runtime_epoch": 0,
        "host_id": "default",
        "host_bound": False,
        "admission": "open",
        "restore_attempt": 0,
        "event_sequence": event_sequence,
    }


# A new session's row, from `sn_`-prefixed parameters (new_session_params).
INSERT_SESSION = insert_bound(SESSIONS, "sn_", new_session_values("", ""))


def new_session_params(workspace_id: str, session_id: str, event_sequence: int) -> dict[str, Any]:
    """INSERT_SESSION's parameters: a new session whose first events are already counted."""
    return bound("sn_", new_session_values(workspace_id, session_id, event_sequence))


def event_params(
    workspace_id: str,
    session_id: str,
    sequence: int,
    *,
    kind: str,
    record_id: str,
    now: datetime,
    idempotency_key: str | None = None,
    revision: int | None = None,
    payload: dict[str, Any] | None = None,
    optional: bool = False,
) -> dict[str, Any]:
    """INSERT_EVENT's parameters: one event at this sequence, keyed by `idempotency_key`
    (unique), the record's id unless given (a record's first event)."""
    return bound(
        "ev_",
        {
            "workspace_id": workspace_id,
            "session_id": session_id,
            "sequence": sequence,
            "kind": kind,
            "record_id": record_id,
            "revision": revision,
            "payload": payload,
            "optional": optional,
            "idempotency_key": idempotency_key or record_id,
            "created_at": now,
        },
    )


class Heard(NamedTuple):
    """When a host's answer was asked, and which host gave it (None: the session's own, as
    far as the caller knows)."""

    at: datetime
    host: str | None = None


def record_liveness(row: AgentSession, live: bool | None, heard: Heard) -> bool:
    """Record a host's liveness answer on the locked session row, unless an answer asked later
    is on record already, or it is the answer of a host the session has left
    (docs/lifecycles.md: sessions): a worker slowed between its call and its write must not
    undo what a newer answer said. True if recorded."""
    if heard.host is not None and heard.host != row.host_id:
        return False
    if row.live_at is not None and heard.at < row.live_at:
        return False
    row.live, row.live_at = live, heard.at
    return True


def heard_in(exc: Exception, now: datetime) -> Heard:
    """When the host call that raised `exc` was asked and which host answered (the adapter
    stamps both), never later than `now`, the caller's clock: what it says is that old."""
    asked: datetime | None = getattr(exc, "asked_at", None)
    return Heard(now if asked is None else min(asked, now), getattr(exc, "answered_by", None))


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
    now: datetime,
    idempotency_key: str | None = None,
    revision: int | None = None,
    payload: dict[str, Any] | None = None,
    optional: bool = False,
) -> int:
    """Append one event at the next gap-free sequence of a session whose row this
    transaction has locked; returns the sequence. The counter is bumped in the database,
    never from a loaded row, so it is right whatever the caller loaded before. The
    idempotency key (the record's id unless given: a record's first event) is unique:
    callers append only for a record they just created or changed."""
    conn = session.connection()
    sequence = conn.execute(
        _NEXT_SEQUENCE, {"b_ws": workspace_id, "b_sid": session_id}
    ).scalar_one()
    conn.execute(
        INSERT_EVENT,
        event_params(
            workspace_id,
            session_id,
            sequence,
            kind=kind,
            record_id=record_id,
            idempotency_key=idempotency_key,
            now=now,
            revision=revision,
            payload=payload,
            optional=optional,
        ),
    )
    return sequence

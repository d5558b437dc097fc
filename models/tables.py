"""Typed SQLAlchemy models of the tables agent-radar keeps (docs/lifecycles.md); the operation
kinds' are in operations.py."""

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import Mapped, mapped_column

from .base import ID, SHORT, Base, UTCDateTime, partial

# Partial indexes' conditions, with their values: a query uses one only where it states its
# condition the same way.
UNSURE_GOALS = "sync_status IN ('unknown', 'diverged')"
PROMPTED = "prompt_id IS NOT NULL"


class AgentSession(Base):
    __tablename__ = "agent_sessions"
    __table_args__ = (
        # Sessions whose restore is due, for the sweeper (migration 0010).
        Index(
            "ix_agent_sessions_restore_due",
            "restore_due_at",
            **partial("restore_due_at IS NOT NULL"),
        ),
        # Sessions whose restore met faults, for `status` (migration 0015).
        Index(
            "ix_agent_sessions_restore_failing", "restore_attempt", **partial("restore_attempt > 0")
        ),
    )

    workspace_id: Mapped[str] = mapped_column(ID, primary_key=True)
    session_id: Mapped[str] = mapped_column(ID, primary_key=True)
    provider: Mapped[str | None] = mapped_column(ID)
    provider_session_id: Mapped[str | None] = mapped_column(ID)
    live: Mapped[bool | None] = mapped_column(Boolean)
    # When the answer `live` holds was asked: an older one is dropped (docs/lifecycles.md).
    live_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    runtime_epoch: Mapped[int] = mapped_column(Integer, default=0)
    # The agent host the session lives on, where its calls go (docs/lifecycles.md: sessions).
    host_id: Mapped[str] = mapped_column(ID, default="default", server_default="default")
    # The host was given (ensure_session(host_id=)) or named by a report: another is refused.
    host_bound: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    admission: Mapped[str] = mapped_column(SHORT, default="open")
    active_turn_id: Mapped[str | None] = mapped_column(ID)
    last_report_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # A restore is due (docs/lifecycles.md: sessions); the sweeper publishes it once due.
    restore_due_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # When its host was last asked what it runs (docs/lifecycles.md: reconcile).
    reconciled_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # The restore's budget (workflows/budgets.py): failed attempts, since when, last error.
    restore_attempt: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    restore_failing_since: Mapped[datetime | None] = mapped_column(UTCDateTime)
    restore_error: Mapped[str | None] = mapped_column(Text)
    # Bumped under the row lock by each writer of a session event: the sequence has no gaps.
    event_sequence: Mapped[int] = mapped_column(Integer, default=0)


class GoalState(Base):
    __tablename__ = "goal_states"
    __table_args__ = (
        # Goals left unsure, for the sweeper's reconcile and `status` (migration 0015).
        Index("ix_goal_states_unsure", "sync_status", **partial(UNSURE_GOALS)),
    )

    workspace_id: Mapped[str] = mapped_column(ID, primary_key=True)
    session_id: Mapped[str] = mapped_column(ID, primary_key=True)
    revision: Mapped[int] = mapped_column(Integer, default=0)
    desired: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    observed: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    tombstoned: Mapped[bool] = mapped_column(Boolean, default=False)
    sync_status: Mapped[str] = mapped_column(SHORT, default="pending")
    pending_operation_id: Mapped[str | None] = mapped_column(ID)
    last_error: Mapped[str | None] = mapped_column(Text)


class SessionEvent(Base):
    __tablename__ = "session_events"
    __table_args__ = (
        UniqueConstraint(
            "workspace_id", "session_id", "sequence", name="uq_session_events_sequence"
        ),
        UniqueConstraint("idempotency_key", name="uq_session_events_idempotency_key"),
        Index("ix_session_events_created", "created_at"),  # retention
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    workspace_id: Mapped[str] = mapped_column(ID)
    session_id: Mapped[str] = mapped_column(ID)
    sequence: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(64))
    record_id: Mapped[str] = mapped_column(ID)
    revision: Mapped[int | None] = mapped_column(Integer)
    payload: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    optional: Mapped[bool] = mapped_column(Boolean, default=False)
    idempotency_key: Mapped[str] = mapped_column(String(512))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)


class Lease(Base):
    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(String(600), primary_key=True)
    owner: Mapped[str | None] = mapped_column(ID)
    token: Mapped[str | None] = mapped_column(String(64))
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class Turn(Base):
    __tablename__ = "turns"
    __table_args__ = (
        Index("ix_turns_settled", "settled_at"),  # retention
        # A prompt's turn, for the sweeper's reconcile of unreported prompts (migration 0019).
        Index("ix_turns_prompt", "workspace_id", "session_id", "prompt_id", **partial(PROMPTED)),
    )

    workspace_id: Mapped[str] = mapped_column(ID, primary_key=True)
    session_id: Mapped[str] = mapped_column(ID, primary_key=True)
    turn_id: Mapped[str] = mapped_column(ID, primary_key=True)
    phase: Mapped[str] = mapped_column(SHORT)
    outcome: Mapped[str | None] = mapped_column(SHORT)
    origin: Mapped[str | None] = mapped_column(SHORT)
    source_goal_operation_id: Mapped[str | None] = mapped_column(String(36))
    source_goal_revision: Mapped[int | None] = mapped_column(Integer)
    prompt_id: Mapped[str | None] = mapped_column(String(36))
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    settled_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # The runtime epoch it ran in: a newer one at the host ends it (docs/lifecycles.md: sessions).
    runtime_epoch: Mapped[int | None] = mapped_column(Integer)
    # When the mirror first recorded it (the control plane's clock; docs/lifecycles.md: reconcile).
    seen_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # Its identity is (host, epoch, id): the host it ran at, and the host's id for it when the
    # record key is another (workflows/sessions/turns.py).
    host_id: Mapped[str | None] = mapped_column(ID)
    host_turn_id: Mapped[str | None] = mapped_column(ID)


class RuntimeHost(Base):
    """A registered agent host (docs/lifecycles.md: sessions). The host `default` is
    AGENT_RADAR_RUNTIME_URL and has no row; the control plane calls no address that is not
    registered here."""

    __tablename__ = "runtime_hosts"

    host_id: Mapped[str] = mapped_column(ID, primary_key=True)
    url: Mapped[str] = mapped_column(String(2048))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    # The bearer token of this host alone (one host's token opens no other); None: calls
    # carry none. The host `default` uses AGENT_RADAR_RUNTIME_TOKEN.
    token: Mapped[str | None] = mapped_column(String(255))


class SettledCount(Base):
    """Settled rows per kind, workspace and status, kept by the sweeper: `status` and the
    metrics read these and the open rows, never the history (docs/operations.md: counts)."""

    __tablename__ = "settled_counts"

    kind: Mapped[str] = mapped_column(SHORT, primary_key=True)
    workspace_id: Mapped[str] = mapped_column(ID, primary_key=True)
    status: Mapped[str] = mapped_column(SHORT, primary_key=True)
    count: Mapped[int] = mapped_column(BigInteger, default=0)


# The workers' own coordination tables (models/coordination.py) are in the metadata too.
from . import coordination, operations  # noqa: E402, F401

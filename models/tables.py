"""Typed SQLAlchemy models of the tables agent-radar keeps (docs/lifecycles.md)."""

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
    text,
)
from sqlalchemy.orm import Mapped, mapped_column

from .base import Base, UTCDateTime

ID = String(255)
SHORT = String(32)

# Partial indexes' conditions, with their values: a query uses one only where it states its
# condition the same way. Not counted under its status in settled_counts (docs/operations.md:
# counts), as SQLAlchemy renders `counted_as.is_distinct_from(status)`.
UNCOUNTED_PG = "counted_as IS DISTINCT FROM status"
UNCOUNTED_SQLITE = "counted_as IS NOT status"
# The goal operation is open (workflows/kinds/goal.py: OPEN_OPERATION_STATUSES).
OPEN_OPERATION_SQL = "status IN ('prepared', 'dispatched')"
UNSURE_GOALS = "sync_status IN ('unknown', 'diverged')"
PROMPTED = "prompt_id IS NOT NULL"


def history_indexes(table: str, created: str = "created_at") -> tuple[Index, ...]:
    """A table that grows with every operation: listed newest first, by workspace or not, and
    pruned by age (migration 0013), and its uncounted rows found without reading the rest."""
    return (
        Index(f"ix_{table}_created", created),
        Index(f"ix_{table}_workspace_created", "workspace_id", created),
        Index(
            f"ix_{table}_uncounted",
            "status",
            "workspace_id",
            "counted_as",
            postgresql_where=text(UNCOUNTED_PG),
            sqlite_where=text(UNCOUNTED_SQLITE),
        ),
    )


class Counted:
    counted_as: Mapped[str | None] = mapped_column(SHORT)  # in settled_counts (None: not)


def _where(condition: str) -> dict:
    """A partial index's condition, on both dialects."""
    return {"postgresql_where": text(condition), "sqlite_where": text(condition)}


class AgentSession(Base):
    __tablename__ = "agent_sessions"
    __table_args__ = (
        # Sessions whose restore is due, for the sweeper (migration 0010).
        Index(
            "ix_agent_sessions_restore_due",
            "restore_due_at",
            **_where("restore_due_at IS NOT NULL"),
        ),
        # Sessions whose restore met faults, for `status` (migration 0015).
        Index(
            "ix_agent_sessions_restore_failing", "restore_attempt", **_where("restore_attempt > 0")
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
        Index("ix_goal_states_unsure", "sync_status", **_where(UNSURE_GOALS)),
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


class LeaseColumns:
    """The (owner, token, expires_at) triple of docs/lifecycles.md: leases, shared by leased
    rows."""

    lease_owner: Mapped[str | None] = mapped_column(ID)
    lease_token: Mapped[str | None] = mapped_column(String(64))
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class GoalOperation(LeaseColumns, Counted, Base):
    __tablename__ = "goal_operations"
    __table_args__ = (
        UniqueConstraint(
            "workspace_id", "session_id", "client_submit_id", name="uq_goal_operations_submit"
        ),
        Index("ix_goal_operations_due", "status", "next_attempt_at"),
        # Open operations in due order, walked by a due read (migration 0009 says why).
        Index("ix_goal_operations_open_due", "next_attempt_at", **_where(OPEN_OPERATION_SQL)),
        Index("ix_goal_operations_session", "workspace_id", "session_id", "goal_revision"),
        *history_indexes("goal_operations"),
    )

    operation_id: Mapped[str] = mapped_column(String(36), primary_key=True)
    workspace_id: Mapped[str] = mapped_column(ID)
    session_id: Mapped[str] = mapped_column(ID)
    client_submit_id: Mapped[str] = mapped_column(ID)
    origin: Mapped[str] = mapped_column(SHORT)
    action: Mapped[str] = mapped_column(SHORT)
    objective: Mapped[str | None] = mapped_column(Text)
    goal_revision: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(SHORT)
    provider_phase: Mapped[str] = mapped_column(SHORT)
    evidence: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    last_error: Mapped[str | None] = mapped_column(Text)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    first_dispatched_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    accepted_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    completed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)


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


class GoalFence(LeaseColumns, Counted, Base):
    """A permanent ban on one exact (operation, revision); `status` tracks only delivery."""

    __tablename__ = "goal_fences"
    __table_args__ = (
        UniqueConstraint(
            "workspace_id", "session_id", "client_submit_id", name="uq_goal_fences_submit"
        ),
        UniqueConstraint("target_operation_id", name="uq_goal_fences_target"),
        Index("ix_goal_fences_due", "status", "next_attempt_at"),
        Index("ix_goal_fences_session", "workspace_id", "session_id"),
        *history_indexes("goal_fences"),
    )

    fence_id: Mapped[str] = mapped_column(String(36), primary_key=True)
    workspace_id: Mapped[str] = mapped_column(ID)
    session_id: Mapped[str] = mapped_column(ID)
    target_operation_id: Mapped[str] = mapped_column(String(36))
    target_revision: Mapped[int] = mapped_column(Integer)
    client_submit_id: Mapped[str] = mapped_column(ID)
    reason: Mapped[str] = mapped_column(Text, default="")
    status: Mapped[str] = mapped_column(SHORT)
    clear_operation_id: Mapped[str | None] = mapped_column(String(36))
    cancel_operation_id: Mapped[str | None] = mapped_column(String(36))
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    last_error: Mapped[str | None] = mapped_column(Text)
    # When the current run of failed attempts began (the age budget); None while waiting.
    failing_since: Mapped[datetime | None] = mapped_column(UTCDateTime)
    completed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    # The (host, epoch) this fence was last installed at, as known before the call (None: nowhere;
    # another than the session's: not known to be there; docs/lifecycles.md: sessions).
    installed_host: Mapped[str | None] = mapped_column(ID)
    installed_epoch: Mapped[int | None] = mapped_column(Integer)
    # The fence's clear was settled locally without reaching the agent: delivered once the
    # session is live again (docs/lifecycles.md: fences).
    clear_undelivered: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())


class Turn(Base):
    __tablename__ = "turns"
    __table_args__ = (
        Index("ix_turns_settled", "settled_at"),  # retention
        # A prompt's turn, for the sweeper's reconcile of unreported prompts (migration 0019).
        Index("ix_turns_prompt", "workspace_id", "session_id", "prompt_id", **_where(PROMPTED)),
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


class CancelOperation(LeaseColumns, Counted, Base):
    __tablename__ = "cancel_operations"
    __table_args__ = (
        Index("ix_cancel_operations_due", "status", "next_attempt_at"),
        *history_indexes("cancel_operations"),
    )

    operation_id: Mapped[str] = mapped_column(String(36), primary_key=True)
    workspace_id: Mapped[str] = mapped_column(ID)
    session_id: Mapped[str] = mapped_column(ID)
    turn_id: Mapped[str] = mapped_column(ID)
    reason: Mapped[str] = mapped_column(Text, default="")
    status: Mapped[str] = mapped_column(SHORT)
    result: Mapped[str | None] = mapped_column(SHORT)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    last_error: Mapped[str | None] = mapped_column(Text)
    failing_since: Mapped[datetime | None] = mapped_column(UTCDateTime)
    completed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    # A cancel owed to the host a session moved away from (docs/lifecycles.md: sessions): it goes
    # there, not to the session's host; with `run_id`, of that maintenance run instead of a turn.
    host_id: Mapped[str | None] = mapped_column(ID)
    run_id: Mapped[str | None] = mapped_column(String(36))


class MaintenanceRun(LeaseColumns, Counted, Base):
    """Exclusive per-session work; the lease is the executing worker's heartbeat."""

    __tablename__ = "maintenance_runs"
    __table_args__ = (
        UniqueConstraint(
            "workspace_id", "session_id", "client_submit_id", name="uq_maintenance_runs_submit"
        ),
        Index("ix_maintenance_runs_live", "status", "lease_expires_at"),
        Index("ix_maintenance_runs_session", "workspace_id", "session_id", "status"),
        *history_indexes("maintenance_runs", created="started_at"),
    )

    run_id: Mapped[str] = mapped_column(String(36), primary_key=True)
    workspace_id: Mapped[str] = mapped_column(ID)
    session_id: Mapped[str] = mapped_column(ID)
    client_submit_id: Mapped[str] = mapped_column(ID)
    kind: Mapped[str] = mapped_column(SHORT)
    args: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    status: Mapped[str] = mapped_column(SHORT)
    error_code: Mapped[str | None] = mapped_column(SHORT)
    detail: Mapped[str | None] = mapped_column(Text)
    revision: Mapped[int] = mapped_column(Integer)
    runtime_epoch: Mapped[int] = mapped_column(Integer)
    applied: Mapped[bool | None] = mapped_column(Boolean)
    input_tokens: Mapped[int | None] = mapped_column(Integer)
    result_tokens: Mapped[int | None] = mapped_column(Integer)
    summary: Mapped[str | None] = mapped_column(Text)
    cancel_requested_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class Prompt(Counted, Base):
    __tablename__ = "prompts"
    __table_args__ = (
        UniqueConstraint(
            "workspace_id", "session_id", "client_submit_id", name="uq_prompts_submit"
        ),
        Index("ix_prompts_due", "status", "workspace_id", "session_id", "position"),
        *history_indexes("prompts"),
    )

    prompt_id: Mapped[str] = mapped_column(String(36), primary_key=True)
    workspace_id: Mapped[str] = mapped_column(ID)
    session_id: Mapped[str] = mapped_column(ID)
    client_submit_id: Mapped[str] = mapped_column(ID)
    text: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(SHORT)
    position: Mapped[int] = mapped_column(Integer)
    turn_id: Mapped[str | None] = mapped_column(ID)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    dispatched_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    attempt: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    last_error: Mapped[str | None] = mapped_column(Text)
    failing_since: Mapped[datetime | None] = mapped_column(UTCDateTime)


class SessionStop(Base):
    """`stop_session` (docs/lifecycles.md: sessions): what it asked to end. It has settled once the
    turn and the maintenance run it named have ended, which their own rows say."""

    __tablename__ = "session_stops"
    __table_args__ = (
        UniqueConstraint(
            "workspace_id", "session_id", "client_submit_id", name="uq_session_stops_submit"
        ),
        Index("ix_session_stops_created", "created_at"),  # retention
    )

    stop_id: Mapped[str] = mapped_column(String(36), primary_key=True)
    workspace_id: Mapped[str] = mapped_column(ID)
    session_id: Mapped[str] = mapped_column(ID)
    client_submit_id: Mapped[str] = mapped_column(ID)
    reason: Mapped[str] = mapped_column(Text)
    turn_id: Mapped[str | None] = mapped_column(ID)
    cancel_operation_id: Mapped[str | None] = mapped_column(String(36))
    run_id: Mapped[str | None] = mapped_column(String(36))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)


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
from . import coordination  # noqa: E402, F401

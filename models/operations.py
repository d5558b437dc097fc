"""The tables of the operation kinds (docs/architecture.md: adding an operation kind; each
kind's statuses and record are in workflows/kinds/): goal operations, fences, turn cancels,
maintenance runs, prompts and session stops."""

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Boolean, Index, Integer, String, Text, UniqueConstraint, false, text
from sqlalchemy.orm import Mapped, mapped_column

from .base import ID, SHORT, Base, UTCDateTime, partial

# Partial indexes' conditions, with their values: a query uses one only where it states its
# condition the same way. Not counted under its status in settled_counts (docs/operations.md:
# counts), as SQLAlchemy renders `counted_as.is_distinct_from(status)`.
UNCOUNTED_PG = "counted_as IS DISTINCT FROM status"
UNCOUNTED_SQLITE = "counted_as IS NOT status"
# The goal operation is open (workflows/kinds/goal.py: OPEN_OPERATION_STATUSES).
OPEN_OPERATION_SQL = "status IN ('prepared', 'dispatched')"


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
        Index("ix_goal_operations_open_due", "next_attempt_at", **partial(OPEN_OPERATION_SQL)),
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

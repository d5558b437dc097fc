"""The tables worker processes coordinate through: host circuits, heartbeats of periodic jobs,
the goal pullers' promises (docs/dispatch.md) and the hosts' refused reports."""

from datetime import datetime

from sqlalchemy import BigInteger, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from .base import Base, UTCDateTime

ID = String(255)


class HostCircuit(Base):
    """A host whose calls a worker process stopped making for a while (its circuit breaker
    opened after calls kept failing): `status` and the metrics show it,
    and its sessions' work stays due until `open_until`. One row per host, the latest
    opening of any worker; gone when a call there succeeds again."""

    __tablename__ = "host_circuits"

    host_id: Mapped[str] = mapped_column(ID, primary_key=True)
    open_until: Mapped[datetime] = mapped_column(UTCDateTime)
    failures: Mapped[int] = mapped_column(Integer)
    last_error: Mapped[str | None] = mapped_column(String(512))
    opened_by: Mapped[str] = mapped_column(ID)


class Heartbeat(Base):
    """When a periodic job last finished (the sweep: `status` and the metrics read its age,
    so a dead beat shows instead of reading as no lag)."""

    __tablename__ = "heartbeats"

    name: Mapped[str] = mapped_column(ID, primary_key=True)
    owner: Mapped[str] = mapped_column(ID)
    beat_at: Mapped[datetime] = mapped_column(UTCDateTime)


class GoalPuller(Base):
    """A worker pool process's promise to take due goal work when its channel is notified
    (PostgreSQL; docs/dispatch.md: pulling under load): until `expires_at` (the database's
    clock), a goal submit notifies one live puller's channel instead of publishing a
    dispatch message. Renewed while the process's drain runs, deleted when it lets go."""

    __tablename__ = "goal_pullers"

    channel: Mapped[str] = mapped_column(String(63), primary_key=True)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)


class ReportRefusals(Base):
    """Reports refused, per host they named (docs/protocol.md: reports): one row per
    registered host, `default` and `unregistered`, whatever the reports said, so a flood of
    forged reports adds no rows. The workers add their counts at most every
    REFUSALS_FLUSH_S each (workflows/sessions/hosts.py); `status` shows them."""

    __tablename__ = "report_refusals"

    host_id: Mapped[str] = mapped_column(ID, primary_key=True)
    refused: Mapped[int] = mapped_column(BigInteger)
    last_code: Mapped[str] = mapped_column(String(32))
    last_at: Mapped[datetime] = mapped_column(UTCDateTime)

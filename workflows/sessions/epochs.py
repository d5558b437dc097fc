"""Runtime epochs (DESIGN 4.9): an agent host that restarted lost its in-memory state — the
turns it ran, the runs it worked on and the fences it held.

Each session keeps the highest epoch seen at its host (a report, a liveness or resume
answer) and the epoch at which its durable fences were last installed there. A newer epoch
is an authoritative end for the turns and maintenance run of older ones, and before any goal
call, prompt or maintenance start reaches the session again, every durable fence of the
session is installed there once.
"""

from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import exists, select
from sqlalchemy.orm import Session

from models.tables import AgentSession, GoalFence
from workflows.fences import cancels
from workflows.maintenance import runs


@dataclass
class EpochEffects:
    """What a newer epoch set in motion, for the caller to publish after commit."""

    newer: bool = False
    woken_fences: list[str] = field(default_factory=list)
    released: bool = False  # a maintenance run ended: the session's held work drains


def observe_epoch(session: Session, row: AgentSession, epoch: int, now: datetime) -> EpochEffects:
    """Record an epoch seen at the session's host, in the caller's transaction (the session
    row is locked). Epochs only grow. The first epoch learnt (from 0, unknown) is no
    restart; a later, newer one ends the turns and the maintenance run of older epochs."""
    known = row.runtime_epoch or 0
    if epoch <= known:
        return EpochEffects()
    row.runtime_epoch = epoch
    if known == 0 or not _has_fences(session, row):
        # Every durable fence is installed there: there is none, or they were installed
        # while the epoch was still unknown, at this same host process.
        row.fences_epoch = epoch
    session.flush()
    if known == 0:
        return EpochEffects(newer=True)
    woken = cancels.interrupt_running_turns(
        session, row.workspace_id, row.session_id, now, before_epoch=epoch
    )
    released = runs.end_for_restart(session, row.workspace_id, row.session_id, epoch, now)
    return EpochEffects(newer=True, woken_fences=woken, released=released)


def _has_fences(session: Session, row: AgentSession) -> bool:
    return session.execute(
        select(
            exists().where(
                GoalFence.workspace_id == row.workspace_id,
                GoalFence.session_id == row.session_id,
            )
        )
    ).scalar_one()

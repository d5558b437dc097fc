"""Runtime epochs (docs/lifecycles.md: sessions): an agent host that restarted lost its in-memory
state — the turns it ran, the runs it worked on and the fences it held.

Each session keeps the highest epoch seen at its host (a report, a liveness or resume
answer); each fence, the (host, epoch) at which it was last installed
(workflows/fences/reinstall.py). A newer epoch is an authoritative end for the turns and
maintenance run of older ones, and before any goal call, prompt or maintenance start reaches
the session again, every durable fence of the session is installed there once.
"""

from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy.orm import Session

from ...models.enums import SyncStatus
from ...models.tables import AgentSession, GoalState
from ..errors import SessionBusy
from ..fences import cancels, moves
from ..maintenance import runs
from ..sessions import hosts
from ..sessions.rows import lock_session


@dataclass
class EpochEffects:
    """What a newer epoch set in motion, for the caller to publish after commit."""

    newer: bool = False
    woken_fences: list[str] = field(default_factory=list)
    released: bool = False  # a maintenance run ended: the session's held work drains
    cancels: list[str] = field(default_factory=list)  # owed to the host a session left
    goal_owed: bool = False  # a move: the new host is owed the current goal (a restore)

    def then(self, later: "EpochEffects") -> "EpochEffects":
        """Both effects, this one's first."""
        return EpochEffects(
            newer=self.newer or later.newer,
            woken_fences=self.woken_fences + later.woken_fences,
            released=self.released or later.released,
            cancels=self.cancels + later.cancels,
            goal_owed=self.goal_owed or later.goal_owed,
        )


def observe_epoch(session: Session, row: AgentSession, epoch: int, now: datetime) -> EpochEffects:
    """Record an epoch seen at the session's host, in the caller's transaction (the session
    row is locked). Epochs only grow. The first epoch learnt (from 0, unknown) is no restart
    for what was recorded at no known epoch, but ends the turns recorded at an older epoch
    a report claimed; a later, newer one ends the turns and the maintenance run of older
    epochs."""
    known = row.runtime_epoch or 0
    if epoch <= known:
        return EpochEffects()
    # The fences are not known to be installed at this epoch, not even when it is the first
    # one learnt: workflows/fences/reinstall.py compares each fence's record with it.
    row.runtime_epoch = epoch
    session.flush()
    if known == 0:
        # Unconfirmed until now: a turn recorded at an older epoch a report claimed (never
        # confirmed) ended with that process all the same.
        woken = cancels.interrupt_running_turns(
            session,
            row.workspace_id,
            row.session_id,
            now,
            before_epoch=epoch,
            known_epochs_only=True,
        )
        return EpochEffects(newer=True, woken_fences=woken)
    woken = cancels.interrupt_running_turns(
        session, row.workspace_id, row.session_id, now, before_epoch=epoch
    )
    ended = runs.end_for_restart(session, row.workspace_id, row.session_id, epoch, now)
    # Its start may still be on the wire: the host is told to refuse it (moves.stop_run).
    reason = "runtime-restart"
    owed = [] if ended is None else moves.stop_run(session, ended, row.host_id, reason, now)
    return EpochEffects(newer=True, woken_fences=woken, released=ended is not None, cancels=owed)


def move_host(session: Session, row: AgentSession, host_id: str, now: datetime) -> EpochEffects:
    """The session now lives on another host (docs/lifecycles.md: sessions), in the caller's
    transaction (the session row is locked): a new runtime epoch there. Every turn that has not
    settled ends `interrupted` here and gets a cancel at the old host, a live maintenance run ends
    as on a restart and is stopped there too, the epoch known starts again from the new host's own
    numbering, every durable fence goes there before anything else does, then the current goal.
    Nothing happens when the host is the same."""
    if host_id == row.host_id:
        return EpochEffects()
    # What ran at the old host is stopped there (workflows/fences/moves.py); here it ended.
    owed, woken = moves.stop_at_old_host(
        session, row.workspace_id, row.session_id, row.host_id, now
    )
    row.host_id = host_id
    row.runtime_epoch = 0  # no fence is recorded at the new host: they all go there
    # What the old host said of it says nothing of the new one, and an answer of the old host
    # written after this is older than the move.
    row.live, row.live_at = None, now
    session.flush()
    ended = runs.end_for_restart(
        session, row.workspace_id, row.session_id, None, now, moved_to=host_id
    )
    # The new host gets the current goal after the fences (the session's restore).
    goal_state = session.get(GoalState, (row.workspace_id, row.session_id))
    owed_goal = False
    if goal_state is not None and goal_state.revision > 0:
        goal_state.sync_status, owed_goal = SyncStatus.UNKNOWN, True
    return EpochEffects(
        newer=True,
        woken_fences=woken,
        released=ended is not None,
        cancels=owed,
        goal_owed=owed_goal,
    )


def bind_host(
    session: Session, workspace_id: str, session_id: str, host_id: str, now: datetime
) -> EpochEffects:
    """`ensure_session(host_id=)`: the session lives on that registered host from now on."""
    hosts.require_host(session, host_id)
    row = lock_session(session, workspace_id, session_id)
    owed = (
        []
        if host_id == row.host_id
        else moves.stops_barring_return(session, workspace_id, session_id, host_id)
    )
    if owed:
        # Moved away from that host and back: what the first move ended there may still run.
        raise SessionBusy(
            f"session {workspace_id}/{session_id} cannot move back to host {host_id!r} before"
            f" the stop owed there is delivered (cancel {owed[0]}); try again once it is",
            operation_id=owed[0],
        )
    row.host_bound = True  # given: a report naming another host cannot move it
    return move_host(session, row, host_id, now)

"""A turn's identity (docs/lifecycles.md: turns): (host, runtime epoch, turn id). A host may number
its turns and give an id again after a restart or at another host; the record keeps each turn
apart. A turn's record key is the host's id the first time; a turn whose id an earlier turn of
the session had at another host or epoch is kept under a derived key, with the host's id beside
it (`host_turn_id`), which is what every call to the host carries."""

from datetime import datetime

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from ...models.enums import TurnOrigin, TurnPhase
from ...models.tables import Turn
from .. import ids


def same_turn(row: Turn, host_id: str, epoch: int) -> bool:
    """Whether the turn on record is the one `host_id` tells of at `epoch`: a record from before
    hosts were kept, or an epoch not known on either side, says nothing against it; but a
    settled turn of no known epoch (a prompt's, ended by a move before any report) is not one
    told of at a known epoch: its host may have restarted and numbered its turns again."""
    if row.host_id is not None and row.host_id != host_id:
        return False
    if row.runtime_epoch and epoch:
        return row.runtime_epoch == epoch
    return not (epoch and not row.runtime_epoch and row.phase == TurnPhase.SETTLED)


PROVENANCE = ("origin", "source_goal_operation_id", "source_goal_revision", "prompt_id")


def another_turn(row: Turn | None, told: dict, unclaimed_at: datetime | None = None) -> bool:
    """Whether a report's turn (`told`, its parsed fields) is another than the turn on record
    under its key: another origin, goal generation or prompt, or a goal's turn where the record
    has a prompt's (or the reverse); or, for a report that names no epoch (`unclaimed_at`: when
    it was made), one made before the turn on record started. Provenance is written once, so
    it tells of another turn that had the id: one of an older epoch whose report named no
    epoch and came late (docs/lifecycles.md: turns)."""
    if row is None:
        return False
    if unclaimed_at is not None and row.started_at is not None and unclaimed_at < row.started_at:
        return True
    for name in PROVENANCE:
        new, old = told.get(name), getattr(row, name)
        if new is not None and old is not None and new != old:
            return True
    goal, prompt = told.get("source_goal_operation_id"), told.get("prompt_id")
    a_prompt_s = row.prompt_id is not None and row.source_goal_operation_id is None
    a_goal_s = row.source_goal_operation_id is not None and row.prompt_id is None
    return bool(goal and a_prompt_s or prompt and a_goal_s)


def turn_key(
    session: Session, workspace_id: str, session_id: str, host_id: str, epoch: int, turn_id: str
) -> str:
    """The record key of the turn `host_id` calls `turn_id` at `epoch`. A host's id that reads
    as a derived key is never a record key itself: no host can plant a record where another
    turn's would go."""
    if not turn_id.startswith(ids.REUSED_TURN_PREFIX):
        first = session.get(Turn, (workspace_id, session_id, turn_id), populate_existing=True)
        if first is None or same_turn(first, host_id, epoch):
            return turn_id
    return ids.reused_turn_key(workspace_id, session_id, host_id, epoch, turn_id)


def host_turn_id(session: Session, workspace_id: str, session_id: str, key: str) -> str:
    """The id the host knows the turn of record `key` by."""
    row = session.get(Turn, (workspace_id, session_id, key))
    return key if row is None or row.host_turn_id is None else row.host_turn_id


def record_prompt_turn(
    session: Session,
    workspace_id: str,
    session_id: str,
    host_id: str,
    turn_id: str,
    prompt_id: str,
    now: datetime,
) -> str:
    """The turn `host_id` answered a prompt with is on record, running, unless a report put it
    there first (moves.prompt_sent), at no known epoch: the answer tells none, and the epoch
    believed may be one the host has left already. A record of another prompt's turn, or of
    a turn that ended, under its id is not this one. Returns its record key."""
    key = turn_key(session, workspace_id, session_id, host_id, 0, turn_id)
    found = session.get(Turn, (workspace_id, session_id, key))
    if found is not None and (
        found.phase == TurnPhase.SETTLED
        or (found.prompt_id is not None and found.prompt_id != prompt_id)
    ):
        # Another turn had the id (its host restarted and numbered its turns again; an ended
        # one of this prompt too, whose send went again): this prompt's is the running one of
        # that id a report put on record without naming its prompt, or else kept apart under
        # a key of its own with the prompt in it.
        reported = _running_unnamed(session, workspace_id, session_id, host_id, turn_id)
        if reported is not None:
            reported.prompt_id = prompt_id
            return reported.turn_id
        key = ids.reused_turn_key(workspace_id, session_id, host_id, 0, f"{turn_id} {prompt_id}")
    if session.get(Turn, (workspace_id, session_id, key)) is None:
        session.add(
            Turn(
                workspace_id=workspace_id,
                session_id=session_id,
                turn_id=key,
                host_id=host_id,
                host_turn_id=None if key == turn_id else turn_id,
                phase=TurnPhase.RUNNING,
                origin=TurnOrigin.USER_PROMPT,
                prompt_id=prompt_id,
                runtime_epoch=None,
                started_at=now,
                seen_at=now,
            )
        )
        session.flush()
    return key


def _running_unnamed(
    session: Session, workspace_id: str, session_id: str, host_id: str, turn_id: str
) -> Turn | None:
    """The running turn on record that `host_id` calls `turn_id`, of no prompt named."""
    return (
        session.execute(
            select(Turn).where(
                Turn.workspace_id == workspace_id,
                Turn.session_id == session_id,
                Turn.host_id == host_id,
                Turn.phase != TurnPhase.SETTLED,
                Turn.prompt_id.is_(None),
                or_(Turn.turn_id == turn_id, Turn.host_turn_id == turn_id),
            )
        )
        .scalars()
        .first()
    )


def unsettled_turns(session: Session, workspace_id: str, session_id: str, *conditions) -> list[str]:
    """The session's turns on record that have not settled (matching `conditions`)."""
    return list(
        session.execute(
            select(Turn.turn_id).where(
                Turn.workspace_id == workspace_id,
                Turn.session_id == session_id,
                Turn.phase != TurnPhase.SETTLED,
                *conditions,
            )
        ).scalars()
    )

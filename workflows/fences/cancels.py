"""Durable turn cancels (docs/lifecycles.md: cancels): the row is written before the runtime
is called; the runtime's answer, a turn-settled report, or (the host gone) local settlement
completes it with the turn. Its states are one table (`CANCEL`): `prepared`, `leased` by a
worker's attempt (taken over once its lease runs out), `completed` or, past its budget,
`failed`."""

from datetime import datetime, timedelta

from sqlalchemy import func, or_, select, update
from sqlalchemy.orm import Session

from ...models.db import rowcount
from ...models.enums import TurnOutcome, TurnPhase
from ...models.operations import CancelOperation, GoalFence
from ...models.tables import Turn
from .. import ids, leases
from ..errors import CancelConflict
from ..kinds.cancel import OPEN_CANCEL_STATUSES, CancelResult, CancelStatus
from ..kinds.fence import FenceStatus
from ..prompts import queue as prompts
from ..sessions import turns
from ..sessions.rows import lock_session
from ..transitions import Machine

_FROM_OPEN = frozenset({CancelStatus.LEASED, CancelStatus.COMPLETED, CancelStatus.FAILED})
CANCEL = Machine(
    CancelOperation,
    CancelOperation.operation_id,
    CancelOperation.status,
    dict.fromkeys(OPEN_CANCEL_STATUSES, _FROM_OPEN),
)
# How often a cancel of an offline session looks whether the session is back (a liveness
# call, never a resume), and what it says meanwhile.
OFFLINE_RECHECK_S, WAITING_OFFLINE = 10.0, "waiting for the session to come back"


def prepare(
    session: Session,
    workspace_id: str,
    session_id: str,
    turn_id: str,
    reason: str,
    now: datetime,
    *,
    join: bool = False,
) -> CancelOperation:
    """The cancel intent, durable before any runtime call; a replay returns the same row.
    The turn's cancel for another reason is a CancelConflict, or with `join` that cancel
    (a turn is cancelled once, whoever asked)."""
    operation_id = ids.cancel_operation_id(workspace_id, session_id, turn_id)
    existing = session.get(CancelOperation, operation_id, populate_existing=True)
    if existing is not None:
        if existing.reason != reason and not join:
            raise CancelConflict(
                f"turn {turn_id} already has a cancel for {existing.reason!r}",
                operation_id=operation_id,
            )
        return existing
    return add(session, operation_id, workspace_id, session_id, turn_id, reason, now)


def add(
    session: Session,
    operation_id: str,
    workspace_id: str,
    session_id: str,
    turn_id: str,
    reason: str,
    now: datetime,
    **owed,
) -> CancelOperation:
    """A new cancel, due now; `owed`: the host_id (and run_id) a move owes it to
    (workflows/fences/moves.py)."""
    cancel = CancelOperation(
        operation_id=operation_id,
        workspace_id=workspace_id,
        session_id=session_id,
        turn_id=turn_id,
        reason=reason,
        status=CancelStatus.PREPARED,
        attempt=0,
        next_attempt_at=now,
        created_at=now,
        **owed,
    )
    session.add(cancel)
    session.flush()
    return cancel


def prepare_or_existing(
    session: Session, workspace_id: str, session_id: str, turn_id: str, reason: str, now: datetime
) -> str:
    """The turn's durable cancel: prepared for `reason`, or the one it already has for
    another cause (a turn is cancelled once, whoever asked). Returns its operation id."""
    return prepare(session, workspace_id, session_id, turn_id, reason, now, join=True).operation_id


def unsettled_turns_of(
    session: Session, workspace_id: str, session_id: str, operation_id: str, revision: int
) -> list[str]:
    """The session's unsettled turns on record started by exactly one goal generation, in
    turn id order: all of them, since a generation may have more than one (a stale turn
    whose settled report was lost beside the live one)."""
    return list(
        session.scalars(
            select(Turn.turn_id)
            .where(
                Turn.workspace_id == workspace_id,
                Turn.session_id == session_id,
                Turn.source_goal_operation_id == operation_id,
                Turn.source_goal_revision == revision,
                Turn.phase != TurnPhase.SETTLED,
            )
            .order_by(Turn.turn_id)
        ).all()
    )


def cancel_if_fenced(
    session: Session, workspace_id: str, session_id: str, turn_id: str, now: datetime
) -> str | None:
    """A report told of a turn that has not settled: if its provenance is a fenced (operation,
    revision), the turn gets its durable cancel now, whether the fence is still on its way or
    completed before the report landed (docs/lifecycles.md: fences). Returns the cancel's id when
    this made it (the caller publishes it after commit); a turn that already has a cancel, whatever
    its cause, keeps that one."""
    turn = session.get(Turn, (workspace_id, session_id, turn_id))
    if turn is None or turn.phase == TurnPhase.SETTLED or turn.source_goal_operation_id is None:
        return None
    fence = session.execute(
        select(GoalFence).where(
            GoalFence.workspace_id == workspace_id,
            GoalFence.session_id == session_id,
            GoalFence.target_operation_id == turn.source_goal_operation_id,
            GoalFence.target_revision == turn.source_goal_revision,
        )
    ).scalar_one_or_none()
    operation_id = ids.cancel_operation_id(workspace_id, session_id, turn_id)
    if fence is None or session.get(CancelOperation, operation_id) is not None:
        return None
    prepare(session, workspace_id, session_id, turn_id, ids.fence_cause(fence.fence_id), now)
    if fence.cancel_operation_id is None:
        fence.cancel_operation_id = operation_id  # the cancel this fence caused
    return operation_id


def claim(
    session: Session, cancel: CancelOperation, owner: str, lease_s: float, now: datetime
) -> str | None:
    """A worker's attempt begins: `leased` under its lease, one attempt more."""
    return CANCEL.claim(
        session,
        cancel.operation_id,
        CancelStatus.LEASED,
        owner,
        lease_s,
        now,
        attempt=CancelOperation.attempt + 1,
    )


def _settle_turn(session: Session, cancel: CancelOperation, outcome: str, now: datetime) -> None:
    settle_turn_row(session, cancel.workspace_id, cancel.session_id, cancel.turn_id, outcome, now)


def settle_turn_row(
    session: Session, workspace_id: str, session_id: str, turn_id: str, outcome: str, now: datetime
) -> None:
    row = lock_session(session, workspace_id, session_id)
    turn = session.get(Turn, (workspace_id, session_id, turn_id), populate_existing=True)
    if turn is not None and turn.phase != TurnPhase.SETTLED:
        turn.phase, turn.outcome, turn.settled_at = TurnPhase.SETTLED, outcome, now
        # A prompt's turn that ends here ends its prompt too, so the queue can move on (the
        # caller publishes the session's prompt dispatch).
        prompts.on_turn_settled(session, workspace_id, session_id, turn.prompt_id, outcome)
    if row.active_turn_id == turn_id:
        row.active_turn_id = None


def complete(
    session: Session,
    cancel: CancelOperation,
    result: str,
    now: datetime,
    token: str | None = None,
    settle_turn: bool = True,
) -> bool:
    """Complete the cancel and settle its turn in one transaction (the turn is already
    settled when a report ended it: `settle_turn=False`)."""
    done = CANCEL.move(
        session,
        cancel.operation_id,
        CancelStatus.COMPLETED,
        token=token,
        result=result,
        completed_at=now,
        **leases.RELEASED,
    )
    if not done:
        return False
    if not settle_turn:
        return True
    outcome = (
        TurnOutcome.INTERRUPTED if result == CancelResult.INTERRUPTED else TurnOutcome.CANCELED
    )
    _settle_turn(session, cancel, outcome, now)
    return True


def interrupt_running_turns(
    session: Session,
    workspace_id: str,
    session_id: str,
    now: datetime,
    before_epoch: int | None = None,
    *,
    known_epochs_only: bool = False,
) -> list[str]:
    """The session is gone (its host answered session_not_found), or — with `before_epoch` —
    its host restarted: every turn of it (of an older epoch) that has not settled ends
    `interrupted`, with its open cancel; returns the fences that waited on them, now due
    (docs/lifecycles.md: cancels, authoritative ends). `known_epochs_only`: only turns
    recorded at a known (non-zero) older epoch: the first epoch confirmed says nothing of
    a turn recorded while the epoch was unknown."""
    older: tuple = ()
    if before_epoch is not None:
        older = (
            (Turn.runtime_epoch > 0, Turn.runtime_epoch < before_epoch)
            if known_epochs_only
            else (or_(Turn.runtime_epoch.is_(None), Turn.runtime_epoch < before_epoch),)
        )
    turn_ids = turns.unsettled_turns(session, workspace_id, session_id, *older)
    return interrupt_turns(session, workspace_id, session_id, turn_ids, now)


def interrupt_turns(
    session: Session, workspace_id: str, session_id: str, turn_ids: list[str], now: datetime
) -> list[str]:
    """These turns ended at their host unseen (a restart, the session gone, the host's own
    answer not listing them): each ends `interrupted` with its open cancel, and its prompt
    ends; returns the fences that waited on them, now due."""
    lock_session(session, workspace_id, session_id)
    woken: list[str] = []
    for turn_id in turn_ids:
        cancel = session.get(
            CancelOperation, ids.cancel_operation_id(workspace_id, session_id, turn_id)
        )
        if cancel is not None and cancel.status in OPEN_CANCEL_STATUSES:
            complete(session, cancel, CancelResult.INTERRUPTED, now)
        else:
            settle_turn_row(
                session, workspace_id, session_id, turn_id, TurnOutcome.INTERRUPTED, now
            )
        woken += waiting_fences(session, workspace_id, session_id, turn_id, now)
    return woken


def is_open(session: Session, operation_id: str) -> bool:
    cancel = session.get(CancelOperation, operation_id, populate_existing=True)
    return cancel is not None and cancel.status in OPEN_CANCEL_STATUSES


def wait(
    session: Session,
    cancel: CancelOperation,
    token: str,
    now: datetime,
    why: str = WAITING_OFFLINE,
) -> bool:
    """Offline (a disconnected session is no end for its turn: it may run behind a network
    fault), or `why`: a wait. Let go without using budget, and look again later."""
    return _holder_update(
        session,
        cancel,
        token,
        attempt=CancelOperation.attempt - 1,
        failing_since=None,
        last_error=why,
        next_attempt_at=now + timedelta(seconds=OFFLINE_RECHECK_S),
        **leases.RELEASED,
    )


def fail(session: Session, cancel: CancelOperation, token: str, error: str, now: datetime) -> bool:
    """Past the budget: the cancel ends `failed` with a stable code (status shows it)."""
    return CANCEL.move(
        session,
        cancel.operation_id,
        CancelStatus.FAILED,
        token=token,
        last_error=error,
        completed_at=now,
        **leases.RELEASED,
    )


def wait_for_settle(
    session: Session, cancel: CancelOperation, token: str, deadline_s: float, now: datetime
) -> bool:
    """The runtime accepted the cancel: stay leased until the turn-settled report, or until
    the deadline, when the stale-cancel sweep looks at it again."""
    deadline = now + timedelta(seconds=deadline_s)
    return _holder_update(
        session, cancel, token, lease_expires_at=deadline, next_attempt_at=deadline
    )


def retry_later(
    session: Session, cancel: CancelOperation, token: str, error: str, delay_s: float, now: datetime
) -> bool:
    return _holder_update(
        session,
        cancel,
        token,
        last_error=error,
        next_attempt_at=now + timedelta(seconds=delay_s),
        failing_since=func.coalesce(CancelOperation.failing_since, now),
        **leases.RELEASED,
    )


def _holder_update(session: Session, cancel: CancelOperation, token: str, **values) -> bool:
    """One write by the cancel's lease holder; False if its lease moved on (fencing token)."""
    result = session.execute(
        update(CancelOperation)
        .where(
            CancelOperation.operation_id == cancel.operation_id,
            CancelOperation.lease_token == token,
        )
        .values(**values)
    )
    return rowcount(result) == 1


def on_turn_settled(
    session: Session, workspace_id: str, session_id: str, turn_id: str, outcome: str, now: datetime
) -> list[str]:
    """A turn settled: complete its open cancel, and return the fences waiting on it."""
    cancel = session.get(
        CancelOperation, ids.cancel_operation_id(workspace_id, session_id, turn_id)
    )
    if cancel is not None and cancel.status in OPEN_CANCEL_STATUSES:
        by_outcome: dict[str, CancelResult] = {
            TurnOutcome.CANCELED: CancelResult.CANCELED,
            TurnOutcome.INTERRUPTED: CancelResult.INTERRUPTED,
        }
        result = by_outcome.get(outcome, CancelResult.ALREADY_SETTLED)
        complete(session, cancel, result, now, settle_turn=False)
    return waiting_fences(session, workspace_id, session_id, turn_id, now)


def waiting_fences(
    session: Session, workspace_id: str, session_id: str, turn_id: str, now: datetime
) -> list[str]:
    """Fences parked on this turn become due now; returns their ids to publish."""
    cancel_id = ids.cancel_operation_id(workspace_id, session_id, turn_id)
    return wake_pending_fences(
        session, workspace_id, session_id, now, GoalFence.cancel_operation_id == cancel_id
    )


def still_waited_for(session: Session, cancel_id: str) -> bool:
    """Whether this cancel's turn is unsettled (its settling wakes the fences waiting on it,
    `waiting_fences`; the caller holds the session's lock, which that transaction takes)."""
    cancel = session.get(CancelOperation, cancel_id, populate_existing=True)
    key = (cancel.workspace_id, cancel.session_id, cancel.turn_id) if cancel else None
    turn = session.get(Turn, key, populate_existing=True) if key else None
    return turn is not None and turn.phase != TurnPhase.SETTLED


def wake_pending_fences(
    session: Session, workspace_id: str, session_id: str, now: datetime, *conditions
) -> list[str]:
    """The session's pending fences (matching `conditions`) become due now; returns their
    ids so the caller publishes them after commit."""
    fence_ids = list(
        session.execute(
            select(GoalFence.fence_id).where(
                GoalFence.workspace_id == workspace_id,
                GoalFence.session_id == session_id,
                GoalFence.status == FenceStatus.PENDING,
                *conditions,
            )
        ).scalars()
    )
    if fence_ids:
        session.execute(
            update(GoalFence).where(GoalFence.fence_id.in_(fence_ids)).values(next_attempt_at=now)
        )
    return fence_ids

"""A fence's delivery as a state machine (docs/lifecycles.md: fences): the one table of its
allowed moves and each move, for the fence step (workflows/steps/fence_apply.py) and an
operator's retry to call.

A fence is `pending` until a worker claims it under a lease (`processing`); the worker ends its
attempt by putting it back `pending` (a wait, which uses no budget, or a retry, which does) or
completing it; past its budget, or refused for good, it is `failed`, and an operator's retry
makes it `pending` again. A claim whose lease ran out is taken over (`processing` again).
Every move a worker makes at the end of its attempt holds only under its lease token.
"""

from datetime import datetime, timedelta

from sqlalchemy import func
from sqlalchemy.orm import Session

from ...models.operations import GoalFence
from .. import leases
from ..kinds.fence import FenceStatus
from ..transitions import Machine

S = FenceStatus
FENCE = Machine(
    GoalFence,
    GoalFence.fence_id,
    GoalFence.status,
    {
        S.PENDING: frozenset({S.PROCESSING, S.FAILED}),
        S.PROCESSING: frozenset({S.PROCESSING, S.PENDING, S.COMPLETED, S.FAILED}),
        S.FAILED: frozenset({S.PENDING}),
    },
)


def claim(
    session: Session, fence_id: str, owner: str, token: str, lease_s: float, now: datetime
) -> bool:
    """A worker's attempt begins: `processing` under its lease, one attempt more."""
    return FENCE.move(
        session,
        fence_id,
        S.PROCESSING,
        attempt=GoalFence.attempt + 1,
        lease_owner=owner,
        lease_token=token,
        lease_expires_at=now + timedelta(seconds=lease_s),
    )


def _end_attempt(session: Session, fence_id: str, token: str, to: str, **values) -> bool:
    return FENCE.move(session, fence_id, to, token=token, **leases.RELEASED, **values)


def complete(
    session: Session, fence_id: str, token: str, now: datetime, cancel_id: str | None
) -> bool:
    """The attempt completed the fence, recording the cancel it caused (a recorded one is
    kept when it caused none)."""
    values = {"cancel_operation_id": cancel_id} if cancel_id else {}
    return _end_attempt(
        session, fence_id, token, S.COMPLETED, completed_at=now, last_error=None, **values
    )


def back_to_pending(
    session: Session,
    fence_id: str,
    token: str,
    error: str,
    due_at: datetime,
    now: datetime,
    *,
    wait: bool,
    cancel_id: str | None = None,
) -> bool:
    """The attempt ends with the fence due again at `due_at`: a wait (for a turn to settle,
    for a maintenance run) uses no budget, its attempt given back and its failing clock
    stopped; a retry's failing clock runs on."""
    values = {"last_error": error, "next_attempt_at": due_at}
    if wait:
        values.update(attempt=GoalFence.attempt - 1, failing_since=None)
    else:
        values["failing_since"] = func.coalesce(GoalFence.failing_since, now)
    if cancel_id is not None:
        values["cancel_operation_id"] = cancel_id
    return _end_attempt(session, fence_id, token, S.PENDING, **values)


def fail(session: Session, fence_id: str, error: str, now: datetime) -> bool:
    """Past its budget, or refused for good: `failed`, whoever holds it. The row still forbids
    its generation, and every resume still preloads it."""
    return FENCE.move(
        session, fence_id, S.FAILED, last_error=error, completed_at=now, **leases.RELEASED
    )


def retry(session: Session, fence_id: str, now: datetime) -> bool:
    """An operator's retry of a failed fence: `pending` with a fresh budget."""
    return FENCE.move(
        session,
        fence_id,
        S.PENDING,
        GoalFence.status == S.FAILED,
        attempt=0,
        failing_since=None,
        last_error=None,
        completed_at=None,
        next_attempt_at=now,
        **leases.RELEASED,
    )

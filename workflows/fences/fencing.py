"""Goal generation fences (docs/lifecycles.md: fences): submit, and the fence's clear settled
without the agent's word.

A fence row is permanent: it forbids one exact (operation, revision) forever; its status only
tracks delivery to the agent host (workflows/fences/lifecycle.py). When the session was offline
or gone, its clear completes with phase and sync `unknown` and waits to be delivered when the
session is live again (workflows/steps/restore.py), which `clear_delivered` records.
"""

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, func, or_, select, update
from sqlalchemy.orm import Session

from ...models.enums import SyncStatus
from ...models.operations import GoalFence, GoalOperation
from ...models.tables import GoalState
from .. import accept, ids, leases
from ..errors import FenceConflict, NotFound
from ..goals.lifecycle import GOAL
from ..goals.operations import fail_operation
from ..goals.submit import GoalRequest, submit
from ..kinds.fence import SETTLED as FENCE_SETTLED
from ..kinds.fence import FenceStatus
from ..kinds.goal import GoalAction, OperationStatus, Origin, ProviderPhase
from ..kinds.goal import GoalOperation as GoalOperationRecord
from ..sessions.rows import append_event, lock_session
from ..validation import check_id, check_reason, check_submit_id
from . import lifecycle


@dataclass(frozen=True)
class FenceRequest:
    workspace_id: str
    session_id: str
    target_operation_id: str
    client_submit_id: str
    reason: str = ""

    @classmethod
    def parse(
        cls,
        workspace_id: Any,
        session_id: Any,
        target_operation_id: Any,
        *,
        client_submit_id: Any,
        reason: Any = "",
    ) -> "FenceRequest":
        return cls(
            check_id("workspace_id", workspace_id),
            check_id("session_id", session_id),
            check_id("target_operation_id", target_operation_id),
            check_submit_id("client_submit_id", client_submit_id),
            check_reason(reason),
        )

    @property
    def fence_id(self) -> str:
        return ids.fence_id(self.workspace_id, self.session_id, self.client_submit_id)


def submit_fence(session: Session, request: FenceRequest, now: datetime) -> tuple[GoalFence, bool]:
    """Accept a fence in the caller's transaction. Returns (fence, created)."""
    lock_session(session, request.workspace_id, request.session_id)
    existing = accept.find_replay(
        session,
        GoalFence,
        request.fence_id,
        (request.target_operation_id,),
        lambda f: (f.target_operation_id,),
        lambda f: FenceConflict(
            f"client_submit_id {request.client_submit_id!r} already fences operation "
            f"{f.target_operation_id}",
            fence_id=f.fence_id,
        ),
    )
    if existing is not None:
        return existing, False
    target = session.get(GoalOperation, request.target_operation_id)
    if (
        target is None
        or target.workspace_id != request.workspace_id
        or target.session_id != request.session_id
        or target.goal_revision <= 0
    ):
        raise NotFound(
            f"no goal operation {request.target_operation_id} in session "
            f"{request.workspace_id}/{request.session_id}",
            operation_id=request.target_operation_id,
        )
    other = session.execute(
        select(GoalFence.fence_id).where(GoalFence.target_operation_id == target.operation_id)
    ).scalar_one_or_none()
    if other is not None:
        raise FenceConflict(
            f"operation {target.operation_id} is already fenced by {other}", fence_id=other
        )

    state = session.get(
        GoalState, (request.workspace_id, request.session_id), populate_existing=True
    )
    clear_id = None
    if state is not None and state.revision == target.goal_revision:
        # The fenced generation is still the current goal: clear it. If the owner has set a
        # newer goal since, nothing is cleared — a fence never touches a newer goal.
        clear, _created = submit(
            session,
            GoalRequest(
                workspace_id=request.workspace_id,
                session_id=request.session_id,
                action=GoalAction.CLEAR,
                objective=None,
                client_submit_id=ids.fence_cause(request.fence_id),
                origin=Origin.FENCE,
                fence_id=request.fence_id,
            ),
            now,
        )
        clear_id = clear.operation_id
    fence = GoalFence(
        fence_id=request.fence_id,
        workspace_id=request.workspace_id,
        session_id=request.session_id,
        target_operation_id=target.operation_id,
        target_revision=target.goal_revision,
        client_submit_id=request.client_submit_id,
        reason=request.reason,
        status=FenceStatus.PENDING,
        clear_operation_id=clear_id,
        attempt=0,
        next_attempt_at=now,
        created_at=now,
    )
    session.add(fence)
    session.flush()
    append_event(
        session,
        request.workspace_id,
        request.session_id,
        kind="goal-fence",
        record_id=f"goal-fence:{fence.fence_id}",
        revision=fence.target_revision,
        payload={
            "target_operation_id": fence.target_operation_id,
            "target_revision": fence.target_revision,
            "reason": fence.reason,
            "clear_operation_id": clear_id,
        },
        now=now,
    )
    return fence, True


# -- a fence's clear settled without the agent's word, and delivered later ---------------
def settle_clear_locally(
    session: Session,
    fence_id: str,
    clear_operation_id: str,
    workspace_id: str,
    session_id: str,
    now: datetime,
) -> bool:
    """The fence's clear completes `unknown` (observed kept) and is marked undelivered; the
    goal state is `unknown`. True if the clear was still open."""
    done = GOAL.move(
        session,
        clear_operation_id,
        OperationStatus.COMPLETED,
        provider_phase=ProviderPhase.UNKNOWN,
        completed_at=now,
        **leases.RELEASED,
    )
    if not done:
        return False
    session.execute(
        update(GoalFence).where(GoalFence.fence_id == fence_id).values(clear_undelivered=True)
    )
    session.execute(
        update(GoalState)
        .where(
            GoalState.workspace_id == workspace_id,
            GoalState.session_id == session_id,
            GoalState.pending_operation_id == clear_operation_id,
        )
        .values(sync_status=SyncStatus.UNKNOWN, pending_operation_id=None)
    )
    return True


def clear_delivered(
    session: Session, fence_id: str, clear: GoalOperationRecord, answer: dict | None
) -> None:
    """The clear reached the agent (or the agent already had something newer): the fence has
    nothing left to deliver. An applied answer is the evidence the local settlement lacked."""
    session.execute(
        update(GoalFence).where(GoalFence.fence_id == fence_id).values(clear_undelivered=False)
    )
    if answer is None or answer.get("phase") != ProviderPhase.APPLIED:
        return
    session.execute(
        update(GoalOperation)
        .where(
            GoalOperation.operation_id == clear.operation_id,
            GoalOperation.provider_phase == ProviderPhase.UNKNOWN,
        )
        .values(provider_phase=ProviderPhase.APPLIED, evidence=answer.get("evidence"))
    )
    goal = answer.get("goal")
    session.execute(
        update(GoalState)
        .where(
            GoalState.workspace_id == clear.workspace_id,
            GoalState.session_id == clear.session_id,
            GoalState.revision == clear.goal_revision,
            GoalState.pending_operation_id.is_(None),
        )
        .values(
            observed=goal,
            sync_status=SyncStatus.SYNCED if goal is None else SyncStatus.DIVERGED,
        )
    )


def fail_with_clear(
    session: Session, fence: GoalFence, error: str, clear_error: str, now: datetime
) -> bool:
    """The fence ends `failed` (fences/lifecycle.py), and its clear, if it is still open,
    fails with it (`clear_error`). True if the fence was not failed yet."""
    failed = lifecycle.fail(session, fence.fence_id, error, now)
    if fence.clear_operation_id:
        clear = session.get(GoalOperation, fence.clear_operation_id)
        if clear is not None:
            fail_operation(session, clear, clear_error, now)
    return failed


def no_fence_drives() -> ColumnElement[bool]:
    """SQL condition on a goal operation: no fence drives it. A client's, or a fence's clear
    whose fence has settled — an operator retried the clear after its fence completed or
    failed — is the sweeper's to publish again when it is due, as any operation is; an open
    fence drives its own clear. The clear names its fence in its client submit ID
    (ids.fence_cause)."""
    fence_id = func.substr(GoalOperation.client_submit_id, len(ids.FENCE_CAUSE) + 1)
    # A scalar subquery, looked up by the fence's key for a fence-made row only (the client's
    # test goes first); an EXISTS could be planned as a scan of every fence, once a sweep.
    fence_status = select(GoalFence.status).where(GoalFence.fence_id == fence_id).scalar_subquery()
    settled = func.coalesce(fence_status, FenceStatus.COMPLETED.value).in_(FENCE_SETTLED)
    return or_(GoalOperation.origin == Origin.CLIENT, settled)

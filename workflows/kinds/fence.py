"""The fence kind (docs/lifecycles.md: fences): its statuses, record, task names and
declaration. Its rules are in fences/, its steps `steps/fence_apply.py` and
`steps/fence_install.py`."""

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from ...models.operations import GoalFence
from ..records import from_row
from .base import Kind, Republish

FENCE_TASK = "agent_radar.fence_goal_generation"  # public
FENCE_APPLY_TASK = "agent_radar.fence.apply"


class FenceStatus(StrEnum):
    PENDING = "pending"
    PROCESSING = "processing"
    COMPLETED = "completed"
    # Delivery gave up past its budget (the fence row still forbids its generation, and every
    # resume still preloads it).
    FAILED = "failed"


SETTLED = (FenceStatus.COMPLETED, FenceStatus.FAILED)


@dataclass(frozen=True)
class Fence:
    fence_id: str
    workspace_id: str
    session_id: str
    target_operation_id: str
    target_revision: int
    client_submit_id: str
    reason: str
    status: str
    clear_operation_id: str | None
    cancel_operation_id: str | None
    attempt: int
    lease_owner: str | None
    lease_token: str | None
    lease_expires_at: datetime | None
    next_attempt_at: datetime | None
    last_error: str | None
    completed_at: datetime | None
    created_at: datetime
    # A stored fence is accepted: it forbids its generation from now on, whatever happens
    # to its delivery.
    intent_accepted: bool = True
    settled: bool = False

    @classmethod
    def from_row(cls, row) -> "Fence":
        settled = row.status in SETTLED
        return from_row(cls, row, intent_accepted=True, settled=settled)


KIND = Kind(
    "fence",
    "fence",
    GoalFence,
    GoalFence.fence_id,
    GoalFence.created_at,
    GoalFence.last_error,
    Fence,
    tuple(FenceStatus),
    settled=SETTLED,
    # Never pruned: a fence forbids its generation for ever.
    republish=Republish(
        (FenceStatus.PENDING, FenceStatus.PROCESSING),
        FENCE_APPLY_TASK,
        "fence_id",
        grace_first_attempt=True,
    ),
    public_tasks=(FENCE_TASK,),
)

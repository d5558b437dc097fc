"""The turn cancel kind (docs/lifecycles.md: cancels), made by a fence, a stop or the
stale-cancel sweep: its statuses, record, task name and declaration. Its rules are
`fences/cancels.py`, its step `steps/cancel.py`."""

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from ...models.operations import CancelOperation
from .base import Kind, Republish, settled_before

CANCEL_APPLY_TASK = "agent_radar.cancel.apply"


class CancelStatus(StrEnum):
    PREPARED = "prepared"
    LEASED = "leased"
    COMPLETED = "completed"
    FAILED = "failed"


class CancelResult(StrEnum):
    CANCELED = "canceled"
    ALREADY_SETTLED = "already_settled"
    INTERRUPTED = "interrupted"


OPEN_CANCEL_STATUSES = (CancelStatus.PREPARED, CancelStatus.LEASED)
SETTLED = (CancelStatus.COMPLETED, CancelStatus.FAILED)
# What a run's stop says while its host still runs the run (steps/cancel.py), and how long
# that may last before `status --check` names it.
RUN_STILL_STOPPING, RUN_STOP_SLOW_S = "run {run_id} is still stopping at host {host_id}", 600


@dataclass(frozen=True)
class TurnCancel:
    """A durable turn cancel (docs/lifecycles.md: cancels): made by a fence, a stop or the
    stale-cancel sweep."""

    operation_id: str
    workspace_id: str
    session_id: str
    turn_id: str
    reason: str
    status: str
    result: str | None
    attempt: int
    next_attempt_at: datetime | None
    last_error: str | None
    completed_at: datetime | None
    created_at: datetime

    @property
    def settled(self) -> bool:
        return self.status in SETTLED


KIND = Kind(
    "cancel",
    "turn cancel",
    CancelOperation,
    CancelOperation.operation_id,
    CancelOperation.created_at,
    CancelOperation.last_error,
    TurnCancel,
    tuple(CancelStatus),
    settled=SETTLED,
    prunable=settled_before(CancelOperation, SETTLED),
    republish=Republish(
        OPEN_CANCEL_STATUSES,
        CANCEL_APPLY_TASK,
        "operation_id",
        grace_first_attempt=False,
    ),
)

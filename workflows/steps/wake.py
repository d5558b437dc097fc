"""A session's held work goes on (docs/lifecycles.md: prompts): when a maintenance run settles — on
its own, by recovery, or because its host restarted or the session moved — the goal operations,
fence clears and prompts it held are woken, in submission order."""

from datetime import datetime

from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from ...models.db import run_transaction
from ..activity.epochs import EpochEffects
from ..fences import cancels, restores
from ..goals.operations import due_now, open_client_operations
from ..kinds.cancel import CANCEL_APPLY_TASK
from ..kinds.fence import FENCE_APPLY_TASK
from ..kinds.goal import DISPATCH_TASK
from ..task_names import PROMPT_TASK, RESTORE_TASK, Publish


def release_session(
    engine: Engine, publish: Publish, workspace_id: str, session_id: str, now: datetime
) -> None:
    """The run settled: held goal operations become due now and drain in revision order;
    the next queued prompt may go (docs/lifecycles.md: prompts)."""

    def wake(s: Session) -> list[str]:
        return due_now(s, open_client_operations(s, workspace_id, session_id), now)

    operations = run_transaction(engine, wake)
    if operations:
        # One dispatch drains the session's lane in revision order.
        publish(DISPATCH_TASK, {"operation_id": operations[0]})
    # Their clears were held too.
    for fence_id in run_transaction(
        engine, lambda s: cancels.wake_pending_fences(s, workspace_id, session_id, now)
    ):
        publish(FENCE_APPLY_TASK, {"fence_id": fence_id})
    publish(PROMPT_TASK, {"workspace_id": workspace_id, "session_id": session_id})
    # What a restore held back while the run held the session (steps/restore.py) goes now.
    owed = lambda s: restores.request_after_hold(s, workspace_id, session_id, now)  # noqa: E731
    if run_transaction(engine, owed):
        publish(RESTORE_TASK, {"workspace_id": workspace_id, "session_id": session_id})


def wake_lane(engine: Engine, publish: Publish, workspace_id: str, session_id: str) -> None:
    """The session's lane is free again (a fence let it go): the dispatch of its open goal
    operations is published, which claims what is due in revision order, as any wake-up
    does, its calls inside the worker's drain and its hosts' bulkheads."""
    ops = run_transaction(engine, lambda s: open_client_operations(s, workspace_id, session_id))
    if ops:
        publish(DISPATCH_TASK, {"operation_id": ops[0]})


def publish_epoch_effects(
    engine: Engine,
    publish: Publish,
    workspace_id: str,
    session_id: str,
    effects: EpochEffects,
    now: datetime,
) -> None:
    """After a newer runtime epoch (or a move): the fences that waited on ended turns go on,
    and a maintenance run that ended releases the session's held work."""
    for fence_id in effects.woken_fences:
        publish(FENCE_APPLY_TASK, {"fence_id": fence_id})
    for cancel_id in effects.cancels:
        publish(CANCEL_APPLY_TASK, {"operation_id": cancel_id})
    if effects.released:
        release_session(engine, publish, workspace_id, session_id, now)

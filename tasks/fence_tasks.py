"""Fence and cancel tasks: thin wrappers over the fence rules and steps."""

from ..workflows.kinds.cancel import CANCEL_APPLY_TASK
from ..workflows.kinds.fence import FENCE_APPLY_TASK, FENCE_TASK
from ..workflows.steps.cancel import CancelRunner
from ..workflows.steps.fence_apply import FenceApplier
from ..workflows.steps.restore import Restorer
from ..workflows.task_names import RESTORE_TASK
from ..workflows.validation import check_id
from .strict import strict_task
from .worker_id import worker_name
from .worker_process import WorkerProcess


def _collaborators(ctx: WorkerProcess) -> dict:
    return {
        "worker_id": worker_name(),
        "lease_s": ctx.settings.lease_s,
        "publish": ctx.publisher.publish_after_commit,
    }


@strict_task(FENCE_TASK, public=True)
def fence_goal_generation(
    ctx, workspace_id, session_id, target_operation_id, *, client_submit_id, reason=""
):
    fence = ctx.client.fence_goal_generation(
        workspace_id,
        session_id,
        target_operation_id,
        client_submit_id=client_submit_id,
        reason=reason,
    )
    return {"fence_id": fence.fence_id, "status": fence.status}


@strict_task(FENCE_APPLY_TASK)
def apply_fence(ctx, fence_id):
    applier = FenceApplier(ctx.engine, ctx.runtime, **_collaborators(ctx))
    return applier.apply(check_id("fence_id", fence_id))


@strict_task(CANCEL_APPLY_TASK)
def apply_cancel(ctx, operation_id):
    runner = CancelRunner(ctx.engine, ctx.runtime, **_collaborators(ctx))
    return runner.apply(check_id("operation_id", operation_id))


@strict_task(RESTORE_TASK)
def restore_session(ctx, workspace_id, session_id):
    runner = CancelRunner(ctx.engine, ctx.runtime, **_collaborators(ctx))
    restorer = Restorer(ctx.engine, ctx.runtime, cancels=runner)
    return restorer.restore(
        check_id("workspace_id", workspace_id), check_id("session_id", session_id)
    )

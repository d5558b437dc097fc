"""Maintenance tasks: thin wrappers over workflows.maintenance.runs and maintenance_exec.
`agent_radar.maintenance.*` is routed to the `maintenance` queue (long work)."""

from ..workflows.kinds.maintenance import (
    CANCEL_MAINTENANCE_TASK,
    EXECUTE_TASK,
    START_MAINTENANCE_TASK,
)
from ..workflows.kinds.prompt import SUBMIT_PROMPT_TASK
from ..workflows.steps import prompt_dispatch
from ..workflows.steps.maintenance import MaintenanceExecutor
from ..workflows.task_names import PROMPT_TASK
from ..workflows.validation import check_id
from . import shutdown
from .fence_tasks import _collaborators
from .strict import Routine, strict_task


@strict_task(START_MAINTENANCE_TASK, public=True)
def start_maintenance(
    ctx,
    workspace_id,
    session_id,
    kind="compact",
    *,
    client_submit_id,
    args=None,
    expected_runtime_epoch=None,
):
    run = ctx.client.start_maintenance(
        workspace_id,
        session_id,
        kind,
        client_submit_id=client_submit_id,
        args=args,
        expected_runtime_epoch=expected_runtime_epoch,
    )
    return {"run_id": run.run_id, "status": run.status}


@strict_task(CANCEL_MAINTENANCE_TASK, public=True)
def cancel_maintenance(ctx, workspace_id, run_id):
    """Scoped to the caller's workspace (docs/operations.md): a run of another one is NotFound."""
    run = ctx.client.cancel_maintenance(run_id, workspace_id=check_id("workspace_id", workspace_id))
    return {"run_id": run.run_id, "status": run.status}


@strict_task(EXECUTE_TASK)
def execute(ctx, run_id):
    executor = MaintenanceExecutor(
        ctx.engine, ctx.runtime, stopping=shutdown.stopping, **_collaborators(ctx)
    )
    return executor.execute(check_id("run_id", run_id))


@strict_task(SUBMIT_PROMPT_TASK, public=True)
def submit_prompt(ctx, workspace_id, session_id, text, *, client_submit_id):
    prompt = ctx.client.submit_prompt(
        workspace_id, session_id, text, client_submit_id=client_submit_id
    )
    return {"prompt_id": prompt.prompt_id, "status": prompt.status}


# Most of these messages (one after every report that a session went idle) find nothing to
# send: Flower shows only those that sent a prompt or failed to.
@strict_task(PROMPT_TASK)
def dispatch_prompt(ctx, workspace_id, session_id):
    outcome = prompt_dispatch.dispatch_next(
        ctx.engine,
        ctx.runtime,
        check_id("workspace_id", workspace_id),
        check_id("session_id", session_id),
        publish=ctx.publisher.publish_after_commit,
    )
    return Routine(outcome) if outcome in prompt_dispatch.NOTHING_SENT else outcome

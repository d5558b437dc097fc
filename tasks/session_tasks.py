"""A session resumed or stopped, a failed operation retried: what the Python client's
`ensure_session`, `stop_session` and `retry_operation` do, for a producer in any language
(docs/producers.md), with the client's own checks; the outcome is the task's result."""

from ..workflows.kinds.stop import STOP_SESSION_TASK
from ..workflows.operators.catalog import kind_of
from ..workflows.records import as_dict
from ..workflows.task_names import ENSURE_SESSION_TASK, RETRY_OPERATION_TASK
from ..workflows.validation import check_id
from .strict import strict_task


@strict_task(ENSURE_SESSION_TASK, public=True)
def ensure_session(ctx, workspace_id, session_id, host_id=None):
    """The user's own resume (docs/lifecycles.md: sessions): an offline session comes back
    with its fences preloaded, and its prepared goal operations go on. The session as the
    record has it after."""
    return as_dict(ctx.client.ensure_session(workspace_id, session_id, host_id=host_id))


@strict_task(STOP_SESSION_TASK, public=True)
def stop_session(ctx, workspace_id, session_id, *, client_submit_id, reason=""):
    """The session's running turn and maintenance run cancelled, idempotent by the submit
    ID; follow it with agent_radar.get_operation until its status is `completed`."""
    stop = ctx.client.stop_session(
        workspace_id, session_id, client_submit_id=client_submit_id, reason=reason
    )
    return {"stop_id": stop.stop_id, "status": stop.status}


@strict_task(RETRY_OPERATION_TASK, public=True)
def retry_operation(ctx, workspace_id, operation_id, *, reason):
    """An operator's retry of a `failed` goal operation or fence of this workspace (another
    workspace's is not_found): same id, a fresh budget, audited with the reason. Its record,
    as agent_radar.get_operation gives it."""
    record = ctx.client.retry_operation(
        operation_id, reason=reason, workspace_id=check_id("workspace_id", workspace_id)
    )
    return {"kind": kind_of(record), **as_dict(record)}

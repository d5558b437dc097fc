"""Goal control tasks: thin wrappers over the goal and activity rules."""

from ..workflows.errors import InvalidArgument
from ..workflows.kinds.goal import DISPATCH_TASK, GOAL_CONTROL_TASK
from ..workflows.operators.catalog import kind_of
from ..workflows.records import as_dict
from ..workflows.task_names import COALESCE_MAX_ITEMS, GET_OPERATION_TASK, REPORT_ACTIVITY_TASK
from ..workflows.validation import check_id, check_ids
from .strict import Routine, strict_task

# A dispatch's outcome for an operation of its own it did not take: another dispatch had
# taken it, it had settled, or there is no such operation.
NOT_TAKEN = "not_taken"


@strict_task(GOAL_CONTROL_TASK, public=True)
def goal_control(
    ctx,
    workspace_id,
    session_id,
    action,
    objective=None,
    *,
    client_submit_id,
    expected_revision=None,
):
    op = ctx.client.goal_control(
        workspace_id,
        session_id,
        action,
        objective,
        client_submit_id=client_submit_id,
        expected_revision=expected_revision,
    )
    # A pool process runs one task at a time, so its submits share no message; the message
    # goes out before the task is acknowledged, as it would without the sender thread (a
    # recycled pool process may not run its exit handlers).
    ctx.client.flush()
    return {"operation_id": op.operation_id, "status": op.status}


@strict_task(DISPATCH_TASK)
def dispatch(ctx, operation_id=None, operation_ids=None, workspace_id=None, session_id=None):
    """One operation (`operation_id`, as the sweeper publishes) or several submitted together
    (`operation_ids`, as a client coalesces them). A message of one operation may name its
    session (`workspace_id`, `session_id`, as the message of one submit does): its lane is
    then taken without a read first. That is a claim the dispatcher checks, not trusted:
    named wrongly, no lane is taken for it and the operation is dispatched as if
    unnamed."""
    if (operation_id is None) == (operation_ids is None):
        raise InvalidArgument(
            "give exactly one of operation_id and operation_ids", field="operation_id"
        )
    wanted = (
        [check_id("operation_id", operation_id)]
        if operation_id is not None
        else check_ids("operation_ids", operation_ids, COALESCE_MAX_ITEMS)
    )
    session_of = None
    if workspace_id is not None or session_id is not None:
        if len(wanted) != 1:
            raise InvalidArgument(
                "workspace_id and session_id name the session of one operation",
                field="workspace_id",
            )
        session_of = (check_id("workspace_id", workspace_id), check_id("session_id", session_id))
    # The calls go on in this process's drain (tasks/worker_process.py); this task only
    # claims, and waits first while the process has as many calls in flight as it takes.
    ctx.wait_for_room(ctx.settings.lease_s / 2)
    # What happened to each operation (in_flight, held, superseded …), as Flower shows it.
    results = ctx.dispatch(wanted, session_of)
    outcomes = {r.operation_id: r.outcome for r in results}
    # Its own operations it did not take (most often another dispatch took them along) say
    # so, rather than nothing.
    outcomes |= {op: NOT_TAKEN for op in wanted if op not in outcomes}
    # By outcome, so that Flower's result column starts with what happened.
    by_outcome: dict[str, list[str]] = {}
    for operation_id, outcome in outcomes.items():
        by_outcome.setdefault(outcome, []).append(operation_id)
    return by_outcome


@strict_task(GET_OPERATION_TASK, public=True)
def get_operation(ctx, operation_id, workspace_id=None):
    """The record of the operation with this id, of any kind, as `op show --json` prints it
    (`kind` and the kind's fields, times as ISO 8601): with a result backend, a producer in
    any language polls this until `status` is terminal. Unknown: FAILURE not_found."""
    record = ctx.client.get_operation(operation_id, workspace_id=workspace_id)
    return {"kind": kind_of(record), **as_dict(record)}


# An agent host reports every turn's start and end: Flower shows the reports that had the
# host asked what it runs (or were refused), not the ones that only said a session is busy or
# idle. A report is received as sent: signed by the session's host, or refused.
@strict_task(REPORT_ACTIVITY_TASK, public=True)
def report_activity(ctx, report):
    asked = ctx.client.receive_report(report)
    return {"reconcile": True} if asked else Routine({"reconcile": False})

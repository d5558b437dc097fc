"""Goal control tasks: thin wrappers over workflows.goals and workflows.activity."""

from tasks import runtime_context as ctx
from tasks.app import worker_name
from tasks.strict import strict_task
from workflows.client import AgentRadar
from workflows.goals import Dispatcher
from workflows.validation import check_id


def _client() -> AgentRadar:
    return AgentRadar(settings=ctx.settings(), runtime=ctx.runtime(), publisher=ctx.publisher())


def _dispatcher() -> Dispatcher:
    client = _client()

    def resume(workspace_id: str, session_id: str) -> None:
        client.ensure_session(workspace_id, session_id)
    return Dispatcher(ctx.engine(), ctx.runtime(), worker_id=worker_name(),
                      lease_s=ctx.settings().lease_s, resume_session=resume)


@strict_task("agent_radar.goal_control", public=True)
def goal_control(workspace_id, session_id, action, objective=None, *, client_submit_id,
                 expected_revision=None):
    op = _client().goal_control(workspace_id, session_id, action, objective,
                                client_submit_id=client_submit_id,
                                expected_revision=expected_revision)
    return {"operation_id": op.operation_id, "status": op.status}


@strict_task("agent_radar.goal.dispatch")
def dispatch(operation_id):
    results = _dispatcher().dispatch(check_id("operation_id", operation_id))
    return [r.outcome for r in results]


@strict_task("agent_radar.report_activity", public=True)
def report_activity(report):
    completed = _client().report_activity(report)
    return {"completed": completed}

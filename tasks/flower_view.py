"""How `agent-radar flower` shows a task in its list (docs/operations.md: Flower): the
workspace, session and client submit ID first in the arguments, as the product's own messages
already carry them, for a producer's message too; and the outcome of a failed task in the
Result column (the refusal's code and message, or why the message was rejected), which
Flower otherwise shows only on the task's own page."""

from typing import Any

from celery import states

from agent_radar.workflows.adapters.logs import ids_in_arguments


def label(kwargsrepr: str) -> str | None:
    """`ws/sid submit=…` for the arguments of a message, as the product labels its own."""
    found = ids_in_arguments(kwargsrepr)
    if "workspace_id" not in found or "session_id" not in found:
        return None
    submit = found.get("client_submit_id")
    return f"{found['workspace_id']}/{found['session_id']}" + (
        f" submit={submit}" if submit else ""
    )


def format_task(task: Any) -> Any:
    """Flower's `format_task` hook: given a copy of Celery's task state, return what to show."""
    kwargs = task.kwargs
    if isinstance(kwargs, str) and not kwargs.startswith("["):
        found = label(kwargs)
        if found:
            task.kwargs = f"[{found}] {kwargs}"
    if task.state == states.FAILURE and task.result is None and task.exception:
        task.result = task.exception
    return task


def install() -> None:
    """Make Flower, started in this process, format its tasks with `format_task`."""
    import flower.options  # noqa: F401 - defines the option set below
    from tornado.options import options

    options.format_task = format_task

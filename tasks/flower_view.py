"""How `agent-radar flower` shows a task in its list (docs/operations.md: Flower): the outcome
of a failed task in the Result column (the refusal's code and message, or why the message was
rejected), which Flower otherwise shows only on the task's own page. The arguments' text is
the worker's gate's, led by the label of the ids they name (tasks/gate.py)."""

from typing import Any

from celery import states


def format_task(task: Any) -> Any:
    """Flower's `format_task` hook: given a copy of Celery's task state, return what to show."""
    if task.state == states.FAILURE and task.result is None and task.exception:
        task.result = task.exception
    return task


def install() -> None:
    """Make Flower, started in this process, format its tasks with `format_task`."""
    import flower.options  # noqa: F401 - defines the option set below
    from tornado.options import options

    options.format_task = format_task

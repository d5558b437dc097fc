"""How `agent-radar flower` shows a task in its list (docs/operations.md: Flower): the outcome
of a failed task in the Result column (the refusal's code and message, or why the message was
rejected), which Flower otherwise shows only on the task's own page. The arguments' text is
the worker's gate's, led by the label of the ids they name (tasks/gate.py).

And what Flower takes and serves (docs/security.md): its `/metrics` answer only with the same
basic auth as its pages (`/healthcheck`, which says "OK" and nothing else, stays open for a
probe); the events it counts there and lists are those of this product's tasks, from workers
with a printable name, up to MAX_WORKERS of them: any broker client may publish events, and
each new task name or worker name would otherwise be a new series for good. Events are read
through the worker's guarded transports: one over the message bound is dropped undecoded."""

from typing import Any

from celery import states

from agent_radar.tasks.envelope import guard_transport
from agent_radar.tasks.headers import printable_id
from agent_radar.tasks.strict import TASK_NAMES

# More workers than a fleet runs; events from further node names are dropped.
MAX_WORKERS = 1024
# Celery's event types (celery/events): Flower handles no others.
EVENT_TYPES = frozenset(
    {
        "task-sent",
        "task-received",
        "task-started",
        "task-succeeded",
        "task-failed",
        "task-rejected",
        "task-revoked",
        "task-retried",
        "worker-online",
        "worker-heartbeat",
        "worker-offline",
    }
)


def format_task(task: Any) -> Any:
    """Flower's `format_task` hook: given a copy of Celery's task state, return what to show."""
    if task.state == states.FAILURE and task.result is None and task.exception:
        task.result = task.exception
    return task


def event_kept(event: Any, workers: set[str]) -> bool:
    """Whether Flower takes this event (`workers`: the node names taken so far)."""
    if not isinstance(event, dict) or event.get("type") not in EVENT_TYPES:
        return False
    hostname = event.get("hostname")
    if not printable_id(hostname):
        return False
    name = event.get("name")
    if name is not None and name not in TASK_NAMES:
        return False
    if hostname not in workers:
        if len(workers) >= MAX_WORKERS:
            return False
        workers.add(hostname)
    return True


def install() -> None:
    """Make Flower, started in this process, format its tasks with `format_task`, take only
    the events `event_kept` keeps, and serve `/metrics` behind its auth."""
    import flower.options  # noqa: F401 - defines the option set below
    import tornado.web
    from flower.events import EventsState
    from flower.views.monitor import Metrics
    from tornado.options import options

    from agent_radar.tasks.app import app

    app.loader.import_default_modules()  # the task names `event_kept` knows
    options.format_task = format_task
    if getattr(EventsState.event, "guarded", False):
        return
    take = EventsState.event
    workers: set[str] = set()

    def event(self, event):
        if event_kept(event, workers):
            return take(self, event)
        return None

    event.guarded = True  # type: ignore[attr-defined]
    EventsState.event = event
    Metrics.get = tornado.web.authenticated(Metrics.get)
    # Flower reads events through the app's connection: through the worker's guarded
    # transports, so an oversized event is dropped before it is decoded (tasks/envelope.py).
    connect = app.connection

    def connection(*args, **kwargs):
        conn = connect(*args, **kwargs)
        guard_transport(conn)
        return conn

    app.connection = connection  # type: ignore[method-assign]

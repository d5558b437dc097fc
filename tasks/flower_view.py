"""How `agent-radar flower` shows a task in its list (docs/operations.md: Flower): the outcome
of a failed task in the Result column (the refusal's code and message, or why the message was
rejected), which Flower otherwise shows only on the task's own page. The arguments' text is
the worker's gate's, led by the label of the ids they name (tasks/gate.py).

And what Flower takes and serves (docs/security.md): its `/metrics` answer only with the same
basic auth as its pages (`/healthcheck`, which says "OK" and nothing else, stays open for a
probe); the events it counts there and lists are those of this product's tasks, from workers
with a printable name, up to MAX_WORKERS of them: any broker client may publish events, and
each new task name or worker name would otherwise be a new series for good. Events are read
through the worker's guarded transports (one over the message bound is dropped undecoded), and
nothing is unpacked (tasks/gate.py: refuse_unpacking)."""

import json
from typing import Any

from celery import states

from .envelope import guard_transport
from .gate import refuse_unpacking
from .headers import printable_id
from .strict import TASK_NAMES

# More workers than a fleet runs; events from further node names are dropped.
MAX_WORKERS = 1024
# Celery's events carry ids, names, short texts (the arguments' text is at most 1 KiB,
# tasks/gate.py) and a few numbers; a failure's traceback is the longest text.
MAX_EVENT_TEXT = 4096
MAX_EVENT_FIELDS = 64
# A field that is not a text: a worker's load averages, its software's names.
MAX_EVENT_FIELD_BYTES = 1024
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


def _bounded(event: dict) -> bool:
    """Cut each text of an event at MAX_EVENT_TEXT characters (Flower keeps up to 10,000
    tasks: 1,500 events of 380 KiB took it to 1 GB); False for an event with more fields,
    or a larger field of another kind, than Celery's events have."""
    if len(event) > MAX_EVENT_FIELDS:
        return False
    for key, value in list(event.items()):
        if isinstance(value, str):
            if len(value) > MAX_EVENT_TEXT:
                event[key] = value[:MAX_EVENT_TEXT] + "..."
        elif isinstance(value, (list, tuple, dict)):
            if len(json.dumps(value, default=repr)) > MAX_EVENT_FIELD_BYTES:
                return False
    return True


def event_kept(event: Any, workers: set[str]) -> bool:
    """Whether Flower takes this event (`workers`: the node names taken so far), its texts
    cut short."""
    if not isinstance(event, dict) or event.get("type") not in EVENT_TYPES:
        return False
    if not _bounded(event):
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

    from .app import app

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
    refuse_unpacking()

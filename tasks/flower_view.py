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
import time
from collections.abc import Callable
from typing import Any

from celery import states

from .envelope import guard_transport
from .gate import refuse_unpacking
from .headers import printable_id
from .strict import TASK_NAMES

# More workers than a fleet runs; events from further node names are dropped, unless a
# worker taken before has sent nothing for WORKER_GONE_S (a worker's heartbeat comes every
# 2 s): it is then forgotten, its series with it, and the new name takes its place.
MAX_WORKERS = 1024
WORKER_GONE_S = 60.0
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


def event_kept(
    event: Any,
    workers: dict[str, float],
    forget: Callable[[list[str]], None] = lambda _names: None,
    now: float | None = None,
) -> bool:
    """Whether Flower takes this event (`workers`: the node names taken, with when each
    was last heard from), its texts cut short. Full, it first `forget`s the workers gone
    quiet (a name's worker restarts under another name: the names taken filled with dead
    workers, and hid every new one for the life of Flower)."""
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
    now = time.monotonic() if now is None else now
    if hostname not in workers and len(workers) >= MAX_WORKERS:
        gone = [name for name, heard in workers.items() if now - heard > WORKER_GONE_S]
        if not gone:
            return False
        for name in gone:
            del workers[name]
        forget(gone)
    workers[hostname] = now
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
    workers: dict[str, float] = {}

    def event(self, event):
        def forget(names: list[str]) -> None:
            self.metrics.remove_workers(names)
            for name in names:
                self.workers.pop(name, None)
                self.counter.pop(name, None)

        if event_kept(event, workers, forget):
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

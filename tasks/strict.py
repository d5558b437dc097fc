"""Task registration with strict message checks (README.md).

Two layers keep an untrusted message from hurting a worker:
- The gate (tasks/gate.py) runs in the worker's main process, before Celery turns a message
  into a request: ill-typed headers, a task that is not ours, a body that is not
  `[args, kwargs, embed]` or is oversized are rejected there (`requeue=False`) with one log
  line, instead of raising out of the consumer and stopping the worker.
- `strict_task` runs in the pool: unknown, missing or ill-typed arguments are rejected (not
  retried) with one clear log line, before anything is written. Only connection-level
  database faults are retried; any other error is permanent and rejected with its reason.
"""

import functools
import inspect
import logging
import time
from dataclasses import dataclass
from typing import Any

from celery import shared_task
from celery.app import trace as celery_trace
from celery.exceptions import Reject, Retry
from celery.utils.saferepr import saferepr
from sqlalchemy.exc import DBAPIError, OperationalError

from ..workflows.adapters import logs
from ..workflows.adapters.broker import DEFAULT_QUEUE
from ..workflows.errors import AgentRadarError, InvalidArgument
from ..workflows.task_names import SHOWN_WHEN_EFFECTIVE
from . import worker_process

log = logging.getLogger("agent_radar.tasks")

# Every rejection is logged here once, with its reason. Celery's own record of a Reject
# repeats it with the traceback of the `raise Reject` below, which tells an operator nothing
# and reads like a crash; keep its line, without the traceback.
celery_trace.log_policy_reject = celery_trace.log_policy_reject._replace(traceback=0)

# Hard and soft limits per task (the worker's, never a message's: tasks/headers.py); below
# the Redis visibility timeout so a task never runs twice at once because the broker
# re-delivered it.
TASK_SOFT_TIME_LIMIT_S = 300
TASK_TIME_LIMIT_S = 360
# A public task whose database is unreachable retries with backoff until this many tries;
# the intent is not durable yet, so it must not be dropped.
PUBLIC_MAX_RETRIES = 50
# Its backoff doubles from 1 s up to this; a worker's gate refuses ETAs much further ahead.
PUBLIC_RETRY_MAX_S = 30
# 2**5 s is past PUBLIC_RETRY_MAX_S: no more doublings are ever needed.
RETRY_DOUBLINGS = 5
# The names `strict_task` registered: the only tasks a worker's gate lets through
# (tasks/gate.py); Celery's built-ins and anything else are refused there.
TASK_NAMES: set[str] = set()


class OperationRefused(Exception):  # noqa: N818 - what a producer reads in the result
    """A public task's permanent domain answer (not found, a conflict, superseded …): the task
    ends FAILURE (Flower shows it, and a result backend keeps `code` and `message` for the
    producer), not SUCCESS with an error inside. Not retried; logged without a traceback."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(code, message)
        self.code, self.message = code, message

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


def retry_countdown_s(retries: object) -> float:
    """A public task's wait before its next try: doubling from 1 s, at most
    PUBLIC_RETRY_MAX_S. The count comes from a message header (the gate bounds it; this
    never raises 2 to a producer's number)."""
    tried = retries if isinstance(retries, int) and not isinstance(retries, bool) else 0
    return float(min(2 ** min(max(tried, 0), RETRY_DOUBLINGS), PUBLIC_RETRY_MAX_S))


def _connection_level(exc: DBAPIError) -> bool:
    """A fault of the connection (the database is down, restarting, locked, or dropped
    us), which a retry can cure; a DataError or an IntegrityError never is."""
    return isinstance(exc, OperationalError) or bool(exc.connection_invalidated)


@dataclass(frozen=True)
class Routine:
    """What a task returns when it did nothing worth a row in Flower (a report that only
    said the session is busy, a prompt dispatch that found nothing to send): with
    `strict_task(events=WHEN_EFFECTIVE)` the task then sends no events at all."""

    value: Any


# What Flower sees of a task: Celery's own task events; none (housekeeping that runs every
# few seconds); or, for the tasks that mostly do nothing (SHOWN_WHEN_EFFECTIVE), the same
# events sent by the task itself once it knows it did something (or failed).
ALL, NONE, WHEN_EFFECTIVE = "all", "none", "when_effective"


def _send_events(task, started_at: float, last: str, **fields: Any) -> None:
    """The events Celery sends for a task (received, started, then `last`), sent after the
    fact by the task itself; Flower shows them as it shows Celery's. Never fails the task."""
    req = task.request
    if not task.app.conf.worker_send_task_events or not req.hostname:
        return
    # The gate wrote the arguments' text from the body (tasks/gate.py).
    kwargsrepr = getattr(req, "kwargsrepr", None) or saferepr(req.kwargs or {}, 1024)
    argsrepr = getattr(req, "argsrepr", None) or saferepr(req.args or (), 1024)
    try:
        with task.app.events.default_dispatcher(hostname=req.hostname) as dispatcher:
            dispatcher.send(
                "task-received",
                uuid=req.id,
                name=task.name,
                args=argsrepr,
                kwargs=kwargsrepr,
                root_id=req.root_id,
                parent_id=req.parent_id,
                retries=req.retries,
                eta=req.eta,
                expires=req.expires,
                timestamp=started_at,
            )
            dispatcher.send("task-started", uuid=req.id, timestamp=started_at)
            dispatcher.send(last, uuid=req.id, **fields)
    except Exception as exc:  # noqa: BLE001 - monitoring must never fail the task
        log.debug("%s events for %s not sent: %s", task.name, req.id, exc)


def _shown_when_effective(task, call):
    """Run `call()` for a WHEN_EFFECTIVE task: its events go out unless it did nothing."""
    started_at = time.time()
    try:
        value = call()
    except Reject as exc:
        # As a failure: Celery's state (and so Flower) would keep a task that was started
        # and then rejected as STARTED for ever.
        _send_events(task, started_at, "task-failed", exception=f"Rejected({exc.reason!r})")
        raise
    except Retry as exc:
        _send_events(task, started_at, "task-retried", exception=saferepr(exc.exc))
        raise
    except Exception as exc:
        _send_events(task, started_at, "task-failed", exception=saferepr(exc))
        raise
    routine = isinstance(value, Routine)
    value = value.value if routine else value
    # A retried message already has a row (its retry's events): it must not stay RETRY.
    if routine and not task.request.retries:
        return value
    _send_events(
        task,
        started_at,
        "task-succeeded",
        result=saferepr(value, task.resultrepr_maxsize),
        runtime=time.time() - started_at,
    )
    return value


def strict_task(name: str, *, public: bool = False, events: str = ALL):
    """Register `fn(ctx, **kwargs)` as task `name`; `ctx` is the worker's WorkerProcess
    (tasks/worker_process.py).
    `events` (ALL or NONE) says what Flower sees of it: housekeeping that runs every few
    seconds would otherwise push real work out of Flower's task list. The tasks named in
    SHOWN_WHEN_EFFECTIVE send theirs only when they did something: they return
    `Routine(value)` when they did nothing (the task's result is `value`)."""
    if events not in (ALL, NONE):
        raise ValueError(f"events must be {ALL} or {NONE}")
    if name in SHOWN_WHEN_EFFECTIVE:
        events = WHEN_EFFECTIVE

    def decorate(fn):
        signature = inspect.signature(fn)
        TASK_NAMES.add(name)

        @shared_task(
            name=name,
            bind=True,
            typing=False,
            max_retries=PUBLIC_MAX_RETRIES,
            send_events=events == ALL,
            # an expected failure: Celery logs it in one line, without a traceback
            throws=(OperationRefused,),
        )
        @functools.wraps(fn)
        def run(self, *args, **kwargs):
            ctx = worker_process.of(self.app.agent_radar_settings)
            ids = logs.ids_of_arguments(kwargs)
            with logs.task_context(task=name, task_id=self.request.id, **ids):
                if events == WHEN_EFFECTIVE:
                    return _shown_when_effective(self, lambda: _run(self, ctx, args, kwargs))
                value = _run(self, ctx, args, kwargs)
                return value.value if isinstance(value, Routine) else value

        def _run(self, ctx, args, kwargs):
            try:
                signature.bind(ctx, *args, **kwargs)
            except TypeError as exc:
                log.error("rejected %s message %s: bad arguments: %s", name, self.request.id, exc)
                raise Reject(f"bad arguments: {exc}", requeue=False) from None
            try:
                return fn(ctx, *args, **kwargs)
            except InvalidArgument as exc:
                log.error("rejected %s message %s: %s", name, self.request.id, exc)
                raise Reject(str(exc), requeue=False) from None
            except AgentRadarError as exc:
                # A permanent domain answer (conflict, superseded …): logged, not retried; a
                # producer's task ends FAILURE with it, the product's own returns it.
                log.warning("%s %s: %s", name, self.request.id, exc.to_dict())
                if public:
                    raise OperationRefused(exc.code, exc.message) from None
                return exc.to_dict()
            except DBAPIError as exc:
                if not _connection_level(exc):
                    log.error(
                        "rejected %s message %s: permanent database error %s: %s",
                        name,
                        self.request.id,
                        exc.__class__.__name__,
                        str(exc.orig)[:200],
                    )
                    raise Reject(f"permanent database error: {exc.orig}", requeue=False) from None
                if not public:
                    # The database row is the outbox; the sweeper re-publishes this work.
                    log.warning(
                        "%s: database unavailable (%s); left to the sweeper",
                        name,
                        exc.__class__.__name__,
                    )
                    return None
                # Into `default` whichever queue the message came by: on RabbitMQ the retry
                # waits in the broker's delay queues, which Celery's default queue (a direct
                # exchange, as default producers declare it) cannot route through.
                raise self.retry(
                    exc=exc, countdown=retry_countdown_s(self.request.retries), queue=DEFAULT_QUEUE
                ) from exc
            except Reject:
                raise
            except Exception as exc:  # noqa: BLE001 - a bug must not become a retry loop
                log.error(
                    "rejected %s message %s: %s: %s",
                    name,
                    self.request.id,
                    exc.__class__.__name__,
                    str(exc)[:200],
                    exc_info=True,
                )
                raise Reject(f"{exc.__class__.__name__}: {exc}", requeue=False) from None

        return run

    return decorate

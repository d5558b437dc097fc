"""Task registration with strict message checks (DESIGN 7.3).

Two layers keep an untrusted message from hurting a worker:
- `GuardedTask.Strategy` runs in the worker's main process, where Celery turns a message into
  a request. A message that cannot be decoded into a call (a body that is not
  `[args, kwargs, embed]`, ill-typed headers, an oversized body) is rejected there
  (`requeue=False`) with one log line, instead of raising out of the consumer and stopping
  the worker — and, requeued, the next worker that takes it.
- `strict_task` runs in the pool: unknown, missing or ill-typed arguments are rejected (not
  retried) with one clear log line, before anything is written. Only connection-level
  database faults are retried; any other error is permanent and rejected with its reason.
"""

import functools
import inspect
import logging

from celery import Task, shared_task
from celery.app import trace as celery_trace
from celery.exceptions import InvalidTaskError, Reject
from celery.worker import strategy as celery_strategy
from sqlalchemy.exc import DBAPIError, OperationalError

from tasks.runtime_context import TaskContext
from workflows.adapters import logs
from workflows.errors import AgentRadarError, InvalidArgument

log = logging.getLogger("agent_radar.tasks")

# Every rejection is logged here once, with its reason. Celery's own record of a Reject
# repeats it with the traceback of the `raise Reject` below, which tells an operator nothing
# and reads like a crash; keep its line, without the traceback.
celery_trace.log_policy_reject = celery_trace.log_policy_reject._replace(traceback=0)

# A public task whose database is unreachable retries with backoff until this many tries;
# the intent is not durable yet, so it must not be dropped.
PUBLIC_MAX_RETRIES = 50
# Our messages carry ids and small JSON (an objective is at most 16 KiB, a prompt 64 KiB);
# anything larger than this is not ours and is refused before it is decoded.
MAX_MESSAGE_BYTES = 256 * 1024
EMBED_KEYS = frozenset({"callbacks", "errbacks", "chain", "chord"})


def check_message(message) -> None:
    """Raise InvalidTaskError unless the message is a well-formed protocol 2 task call."""
    body = message.body
    if isinstance(body, (bytes, str)) and len(body) > MAX_MESSAGE_BYTES:
        raise InvalidTaskError(f"body of {len(body)} bytes is over {MAX_MESSAGE_BYTES}")
    headers = message.headers
    if not isinstance(headers, dict):
        raise InvalidTaskError("headers are not a mapping")
    for name in ("id", "task"):
        if not isinstance(headers.get(name), str) or not headers[name]:
            raise InvalidTaskError(f"header {name!r} is missing or not a string")
    for name in ("root_id", "parent_id", "group", "shadow", "eta", "expires"):
        if headers.get(name) is not None and not isinstance(headers[name], str):
            raise InvalidTaskError(f"header {name!r} is not a string")
    retries = headers.get("retries", 0)
    if retries is not None and (
        isinstance(retries, bool) or not isinstance(retries, int) or retries < 0
    ):
        raise InvalidTaskError("header 'retries' is not a count")
    timelimit = headers.get("timelimit")
    if timelimit is not None and not (
        isinstance(timelimit, (list, tuple))
        and len(timelimit) == 2
        and all(
            t is None or (isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0)
            for t in timelimit
        )
    ):
        raise InvalidTaskError("header 'timelimit' is not [soft, hard]")
    payload = message.decode()
    if not (isinstance(payload, (list, tuple)) and len(payload) == 3):
        raise InvalidTaskError("body is not [args, kwargs, embed]")
    args, kwargs, embed = payload
    if not isinstance(args, (list, tuple)) or not isinstance(kwargs, dict):
        raise InvalidTaskError("body args is not a list or kwargs is not an object")
    if any(not name.isidentifier() or name == "self" for name in kwargs):
        # `self` would collide with the bound task before any check of ours runs.
        raise InvalidTaskError("body kwargs has a name that is no argument")
    if embed is not None and not (
        isinstance(embed, dict)
        and set(embed) <= EMBED_KEYS
        and all(v in (None, [], ()) for v in embed.values())
    ):
        raise InvalidTaskError("body embed carries unknown keys or workflow callbacks")


def guarded_strategy(task, app, consumer, **kwargs):
    """Celery's default strategy, behind `check_message`; anything that still fails while
    the message becomes a request is rejected the same way."""
    handle = celery_strategy.default(task, app, consumer, **kwargs)
    connection_errors = consumer.connection_errors

    def task_message_handler(message, body, ack, reject, callbacks, **options):
        try:
            if body is None:  # protocol 2; a protocol 1 message arrives decoded
                check_message(message)
            return handle(message, body, ack, reject, callbacks, **options)
        except connection_errors:
            raise  # the consumer reconnects; the message is redelivered
        except Exception as exc:  # noqa: BLE001 - nothing in a message may stop the worker
            headers = message.headers if isinstance(message.headers, dict) else {}
            log.error(
                "rejected malformed %s message %s: %s: %s",
                task.name,
                str(headers.get("id"))[:64],
                exc.__class__.__name__,
                str(exc)[:200],
            )
            message.reject_log_error(log, connection_errors, requeue=False)
            return None

    return task_message_handler


class GuardedTask(Task):
    """The app's task base: every task, Celery's own included, gets the guarded strategy."""

    Strategy = "tasks.strict:guarded_strategy"


def _connection_level(exc: DBAPIError) -> bool:
    """A fault of the connection (the database is down, restarting, locked, or dropped
    us), which a retry can cure; a DataError or an IntegrityError never is."""
    return isinstance(exc, OperationalError) or bool(exc.connection_invalidated)


def _ids(kwargs: dict) -> dict:
    """The ids a message names, for its log lines (logs.task_context drops bad values)."""
    ids = {k: kwargs.get(k) for k in logs.CONTEXT_FIELDS if k in kwargs}
    report = kwargs.get("report")
    if isinstance(report, dict):
        ids.setdefault("workspace_id", report.get("workspace_id"))
        ids.setdefault("session_id", report.get("session_id"))
    return ids


def strict_task(name: str, *, public: bool = False, events: bool = True):
    """Register `fn(ctx, **kwargs)` as task `name`; `ctx` is the worker's TaskContext.
    `events=False` keeps the task out of Flower (no task events): housekeeping that runs
    every few seconds would otherwise push real work out of Flower's task list."""

    def decorate(fn):
        signature = inspect.signature(fn)

        @shared_task(
            name=name,
            bind=True,
            typing=False,
            max_retries=PUBLIC_MAX_RETRIES,
            send_events=events,
        )
        @functools.wraps(fn)
        def run(self, *args, **kwargs):
            ctx = TaskContext(self.app.agent_radar_settings)
            with logs.task_context(task=name, task_id=self.request.id, **_ids(kwargs)):
                return _run(self, ctx, args, kwargs)

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
                # A permanent domain answer (conflict, superseded …): logged, not retried.
                log.warning("%s %s: %s", name, self.request.id, exc.to_dict())
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
                raise self.retry(exc=exc, countdown=min(2**self.request.retries, 30)) from exc
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

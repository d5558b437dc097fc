"""Task registration with strict message checks (DESIGN 7.3).

A message with unknown, missing or ill-typed arguments is rejected (not retried) with one
clear log line, before anything is written.
"""

import functools
import inspect
import logging

from celery.exceptions import Reject
from sqlalchemy.exc import DBAPIError, OperationalError

from celery import shared_task

from tasks.runtime_context import TaskContext
from workflows.errors import AgentRadarError, InvalidArgument

log = logging.getLogger("agent_radar.tasks")

# A public task whose database is unreachable retries with backoff until this many tries;
# the intent is not durable yet, so it must not be dropped.
PUBLIC_MAX_RETRIES = 50


def strict_task(name: str, *, public: bool = False):
    """Register `fn(ctx, **kwargs)` as task `name`; `ctx` is the worker's TaskContext."""
    def decorate(fn):
        signature = inspect.signature(fn)

        @shared_task(name=name, bind=True, typing=False, max_retries=PUBLIC_MAX_RETRIES)
        @functools.wraps(fn)
        def run(self, *args, **kwargs):
            ctx = TaskContext(self.app.conf.agent_radar_settings)
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
            except (OperationalError, DBAPIError) as exc:
                if not public:
                    # The database row is the outbox; the sweeper re-publishes this work.
                    log.warning("%s: database unavailable (%s); left to the sweeper", name,
                                exc.__class__.__name__)
                    return None
                raise self.retry(exc=exc, countdown=min(2 ** self.request.retries, 30))
        return run
    return decorate

"""The Celery app (docs/architecture.md): JSON only, late acks, one message at a time, two
queues."""

import logging
import os
from pathlib import Path

from celery import Celery
from celery.signals import (
    after_setup_logger,
    after_setup_task_logger,
    beat_init,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_ready,
)

from ..models.db import forget_engines
from ..workflows.adapters import logs
from ..workflows.adapters.broker import (
    DEFAULT_QUEUE,
    MAINTENANCE_QUEUE,
    VISIBILITY_TIMEOUT_S,
    kombu_queues,
    transport_options,
)
from ..workflows.adapters.config import Settings
from ..workflows.kinds import RESULT_TASKS
from .strict import TASK_SOFT_TIME_LIMIT_S, TASK_TIME_LIMIT_S

log = logging.getLogger(__name__)

assert TASK_TIME_LIMIT_S < VISIBILITY_TIMEOUT_S


TASK_MODULES = [
    "agent_radar.tasks.goal_tasks",
    "agent_radar.tasks.fence_tasks",
    "agent_radar.tasks.maintenance_tasks",
    "agent_radar.tasks.session_tasks",
    "agent_radar.tasks.sweep_tasks",
]
# The benchmark's baseline task is registered only in the benchmark's own workers, which
# set this variable; a production worker does not know it.
BENCH_TASKS_ENV = "AGENT_RADAR_BENCH_TASKS"
BENCH_TASK_MODULE = "agent_radar.tasks.bench_tasks"


# A result is kept this long: a producer reads it soon after its task ran, and the
# operation's own record (agent_radar.get_operation) is there for good.
RESULT_EXPIRES_S = 86400


def celery_config(settings: Settings) -> dict:
    return {
        "broker_url": settings.broker_url,
        "broker_transport_options": transport_options(settings),
        "broker_connection_retry_on_startup": True,
        # A broker's refusal on a channel (Redis at maxmemory, a RabbitMQ channel closed)
        # restarts the consumer as a lost connection does, instead of exiting the worker
        # (tasks/envelope.py keeps the usual ones from reaching it at all).
        "broker_channel_error_retry": True,
        "task_serializer": "json",
        "accept_content": ["json"],
        # Results are kept only where a producer reads them: the public tasks, and only with a
        # result backend configured (AGENT_RADAR_RESULT_BACKEND; README.md, producers).
        "result_backend": settings.result_backend,
        "task_ignore_result": True,
        "result_expires": RESULT_EXPIRES_S,
        # Results in a shared Redis carry the deployment's key prefix too.
        "result_backend_transport_options": (
            {"global_keyprefix": settings.broker_key_prefix} if settings.broker_key_prefix else {}
        ),
        "task_annotations": (
            {name: {"ignore_result": False} for name in RESULT_TASKS}
            if settings.result_backend
            else {}
        ),
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        # Every message passes the gate before Celery reads it (tasks/gate.py).
        "worker_consumer": "agent_radar.tasks.gate:GuardedConsumer",
        # A task running when the broker connection drops finishes; its ack is lost and the
        # message comes back, to find its work done (every task is idempotent, and the
        # database's leases and fencing tokens keep two copies apart: docs/architecture.md).
        # Celery's cancellation would end the pool process with SIGTERM, a broker fault
        # killing a process (docs/security.md, broker faults).
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        "task_soft_time_limit": TASK_SOFT_TIME_LIMIT_S,
        "task_time_limit": TASK_TIME_LIMIT_S,
        "task_queues": kombu_queues(settings),
        "task_default_queue": DEFAULT_QUEUE,
        "task_routes": {"agent_radar.maintenance.*": {"queue": MAINTENANCE_QUEUE}},
        "worker_hijack_root_logger": False,
        "beat_schedule": _beat_schedule(settings),
        "timezone": "UTC",
        "enable_utc": True,
    }


def _beat_schedule(settings: Settings) -> dict:
    from ..beat.schedule import beat_schedule

    return beat_schedule(settings)


def create_app(settings: Settings | None = None) -> Celery:
    settings = settings or Settings.from_env()
    modules = list(TASK_MODULES)
    if os.environ.get(BENCH_TASKS_ENV) == "1":
        modules.append(BENCH_TASK_MODULE)
    celery = Celery("agent_radar", include=modules)
    celery.conf.update(celery_config(settings))
    # Kept on the app, not in its configuration: `celery inspect conf` and Flower show the
    # configuration to anyone who can reach them, and the settings hold secrets.
    celery.agent_radar_settings = settings
    return celery


@worker_process_init.connect
def _after_fork(**_kwargs) -> None:
    # A forked pool process must not reuse its parent's database connections.
    forget_engines()
    from . import worker_process

    try:
        # The app's own settings, as its tasks' (strict.py): one WorkerProcess, one drain.
        worker_process.of(app.agent_radar_settings).start()
    except Exception:  # noqa: BLE001 - then the first dispatch message starts its drain
        log.exception("goal drain: not started with the process")


@worker_process_shutdown.connect
def _finish_calls(**_kwargs) -> None:
    # Calls in flight in this process's goal drain end (each within the runtime timeout) and
    # are recorded; what it had not called goes back, due at once.
    from . import worker_process

    # An attempt may make a few calls (fences first, a resume): twice the timeout, and more.
    worker_process.stop_all(2 * Settings.from_env().runtime_timeout_s + 2)


@worker_init.connect
def _watch_for_shutdown(sender=None, **_kwargs) -> None:
    from . import shutdown

    shutdown.watch(sender.app.agent_radar_settings if sender is not None else Settings.from_env())


@worker_init.connect
def _warn_of_unprefixed_producers(sender=None, **_kwargs) -> None:
    # Messages no worker reads, from producers that cannot set the key prefix: one line each
    # at the start, saying what to do.
    from ..workflows.adapters.broker import warn_of_unprefixed

    warn_of_unprefixed(
        sender.app.agent_radar_settings if sender is not None else Settings.from_env()
    )


@beat_init.connect
def _beat_sends_no_sent_events(sender=None, **_kwargs) -> None:
    # Beat publishes only housekeeping (the sweep every few seconds, retention), whose
    # tasks send no events (strict_task(events=NONE)); their `task-sent` events would
    # leave an ever-pending task in Flower for every sweep.
    if sender is not None:
        sender.app.conf.task_send_sent_event = False


@worker_ready.connect
def _announce_ready(**_kwargs) -> None:
    # The embedded stack and the tests wait for this file instead of sleeping.
    ready_file = os.environ.get("AGENT_RADAR_READY_FILE")
    if ready_file:
        Path(ready_file).touch()


app = create_app()


@after_setup_logger.connect
@after_setup_task_logger.connect
def _structured_logs(logger=None, **_kwargs) -> None:
    """Every line carries the ids of the task in hand; AGENT_RADAR_LOG_FORMAT=json makes it
    one JSON object per line (workflows/adapters/logs.py)."""
    if logger is not None:
        logs.install(logger)

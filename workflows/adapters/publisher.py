"""The task publisher (the publish port's adapter): Celery protocol v2 task messages sent with
kombu — the same wire format any producer in any language uses (README.md) — so the client,
the sweeper and the simulator share one small publisher. `workflows/` never imports Celery.
The client's goal submits share messages through a coalescer in front of it
(workflows/client/coalescing.py).
"""

import logging
import os
import threading
import time
import uuid
import weakref
from typing import Any

from ..task_names import SHOWN_WHEN_EFFECTIVE
from .broker import broker_connection, kombu_queues, queue_for
from .config import Settings
from .sent_events import SentEvents

log = logging.getLogger(__name__)


class TaskPublisher:
    """Publishes Celery protocol v2 task messages; one connection per process, thread-safe."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._pid = None
        self._connection = None
        self._producer = None
        self._exchanges = {q.name: q for q in kombu_queues(settings)}
        self._events: SentEvents | None = None
        self._lock = threading.Lock()
        _LIVE.add(self)
        # On kombu's emulated transports (Redis, the filesystem) a publish through a named
        # exchange first reads the exchange's bindings from the broker (one more round trip,
        # docs/benchmarks.md); the default exchange names the queue directly. On
        # RabbitMQ the exchange routes (and Celery's delayed delivery needs it).
        self._by_queue_name = not settings.is_amqp_broker

    def _ensure(self):
        if self._pid != os.getpid() or self._producer is None:
            self._connection = broker_connection(self.settings)
            self._producer = self._connection.Producer()
            self._events = SentEvents(self._connection)
            self._pid = os.getpid()
        return self._producer

    def publish(
        self,
        task_name: str,
        kwargs: dict[str, Any] | None = None,
        queue: str | None = None,
        label: str | None = None,
    ) -> str:
        """Publish one task message. `label` (e.g. the workspace, session and client submit
        ID an internal message is about) is shown before the arguments in Flower and the
        worker log, so an operator finds the message by what the client knows."""
        kwargs = kwargs or {}
        queue_name = queue or queue_for(task_name)
        target = self._exchanges[queue_name]
        task_id = str(uuid.uuid4())
        # The label first: Flower's task list shows the start of a long argument list.
        kwargsrepr = ((f"[{label}] " if label else "") + repr(kwargs))[:1024]
        headers = {
            "lang": "py",
            "task": task_name,
            "id": task_id,
            "shadow": None,
            "eta": None,
            "expires": None,
            "group": None,
            "group_index": None,
            "retries": 0,
            "timelimit": [None, None],
            "root_id": task_id,
            "parent_id": None,
            "argsrepr": "()",
            "kwargsrepr": kwargsrepr,
            "origin": "agent-radar",
            "ignore_result": True,
        }
        body: tuple[list[Any], dict[str, Any], dict[str, None]] = (
            [],
            kwargs,
            {"callbacks": None, "errbacks": None, "chain": None, "chord": None},
        )
        with self._lock:
            producer = self._ensure()
            # The event's time is when the publish began: on RabbitMQ the publish returns
            # once the broker confirms it, and a worker may have received the message by
            # then (Flower would show it received before it was sent).
            sent_at = time.time()
            producer.publish(
                body,
                exchange="" if self._by_queue_name else target.exchange,
                routing_key=target.name if self._by_queue_name else target.routing_key,
                serializer="json",
                headers=headers,
                correlation_id=task_id,
                delivery_mode=2,
                declare=[target],
                retry=True,
                retry_policy={
                    "max_retries": 3,
                    "interval_start": 0.1,
                    "interval_step": 0.5,
                    "interval_max": 2,
                },
            )
            assert self._events is not None
            if task_name not in SHOWN_WHEN_EFFECTIVE:
                self._events.task_sent(producer, task_id, task_name, kwargsrepr, target, sent_at)
        return task_id

    def publish_after_commit(
        self, task_name: str, kwargs: dict[str, Any], label: str | None = None
    ) -> bool:
        """Publish an already-committed intent. The row is the outbox: if this fails the
        sweeper publishes it later, so a failure is logged, never raised."""
        try:
            self.publish(task_name, kwargs, label=label)
            return True
        except Exception as exc:  # noqa: BLE001 - any broker fault leaves it to the sweeper
            log.warning(
                "publish of %s %s failed (%s: %s); the sweeper will publish it",
                task_name,
                kwargs,
                exc.__class__.__name__,  # a connection lost mid-publish may say nothing more
                exc,
            )
            self.close()
            return False

    def close(self) -> None:
        """Drop the connection (the next publish opens another)."""
        with self._lock:
            if self._connection is not None and self._pid == os.getpid():
                try:
                    self._connection.release()
                except Exception:  # noqa: BLE001 - closing a broken connection
                    pass
            self._connection = self._producer = None


# Every publisher of this process: a forked child starts with a fresh publish lock (one a
# parent's thread held at the fork would stay held); its connection is its own (`_ensure`).
_LIVE: "weakref.WeakSet[TaskPublisher]" = weakref.WeakSet()


def _reset_after_fork() -> None:
    for publisher in list(_LIVE):
        publisher._lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)

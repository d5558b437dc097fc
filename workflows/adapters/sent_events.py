"""Celery's `task-sent` events for the messages the product publishes, so Flower shows a task
from the moment it is sent, as it does for a Celery producer's."""

import logging
import os
import socket
import time
from typing import Any

from kombu import Connection, Exchange, Queue

log = logging.getLogger(__name__)


# Celery's event exchange; Celery makes it a fanout exchange on Redis (celery.events.event).
EVENT_EXCHANGE = "celeryev"


class SentEvents:
    """The `task-sent` event Celery's own producer sends when `task_send_sent_event` is on
    (docs/architecture.md): Flower shows a task from the moment it is published, under the client
    that published it, instead of first hearing of it from the worker. The wire format is Celery's
    event message (celery.events.event.Event), built here because `workflows/` never imports
    Celery."""

    def __init__(self, connection: Connection) -> None:
        kind = "fanout" if connection.transport.driver_type == "redis" else "topic"
        self.exchange = Exchange(EVENT_EXCHANGE, type=kind, delivery_mode="transient")
        self.hostname = f"agent-radar.{os.getpid()}@{socket.gethostname()}"
        self.clock = 0

    def task_sent(
        self,
        producer: Any,
        task_id: str,
        task_name: str,
        kwargsrepr: str,
        queue: Queue,
        sent_at: float,
    ) -> None:
        self.clock += 1
        event = {
            "type": "task-sent",
            "uuid": task_id,
            "root_id": task_id,
            "parent_id": None,
            "name": task_name,
            "args": "()",
            "kwargs": kwargsrepr,
            "retries": 0,
            "eta": None,
            "expires": None,
            "queue": queue.name,
            "exchange": queue.exchange.name,
            "routing_key": queue.routing_key,
            "hostname": self.hostname,
            "pid": os.getpid(),
            "clock": self.clock,
            "utcoffset": (time.altzone if time.daylight else time.timezone) // 3600,
            "timestamp": sent_at,
        }
        try:
            producer.publish(
                event,
                exchange=self.exchange,
                routing_key="task.sent",
                serializer="json",
                headers={"hostname": self.hostname},
                declare=[self.exchange],
                delivery_mode=1,
            )
        except Exception as exc:  # noqa: BLE001 - monitoring must never fail a published task
            log.debug("task-sent event for %s not sent: %s", task_id, exc)

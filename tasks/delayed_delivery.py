"""Celery's native delayed delivery (the RabbitMQ delay queues a countdown waits in, on
quorum queues), set up through the node the worker is connected to.

Celery's own consumer step treats a `;`-separated broker URL as separate brokers: it declares
the delay exchanges and queues at each listed node in turn, and retries one that refuses for
about 9 s (sleeps of 1, 3 and 5 s) while the consumer waits. With one node of a cluster down,
every worker that connected or reconnected took no message for that long
(docs/broker-cluster.md). A cluster's exchanges, queues and bindings belong to the whole
cluster, so this step declares them once, through a copy of the consumer's own connection:
its node first, the other listed nodes after it.
"""

import logging

from celery.worker.consumer.delayed_delivery import DelayedDelivery as CeleryDelayedDelivery
from kombu.transport.native_delayed_delivery import (
    declare_native_delayed_delivery_exchanges_and_queues,
)

log = logging.getLogger("agent_radar.tasks")

CELERY_STEP = "celery.worker.consumer.delayed_delivery:DelayedDelivery"
STEP = f"{__name__}:DelayedDelivery"


class DelayedDelivery(CeleryDelayedDelivery):
    def start(self, c) -> None:
        self._validate_configuration(c.app)
        try:
            with c.connection.clone() as connection:
                declare_native_delayed_delivery_exchanges_and_queues(
                    connection, c.app.conf.broker_native_delayed_delivery_queue_type
                )
                self._bind_queues(c.app, connection)
        except c.connection_errors:
            raise  # the consumer reconnects, to the next node if this one is gone, and retries
        except Exception as exc:  # noqa: BLE001 - as Celery's step: logged, the worker runs on
            log.warning("native delayed delivery was not set up: %s", exc)

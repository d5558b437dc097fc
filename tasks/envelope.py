"""Redis messages that are not kombu envelopes.

On Redis a message is a JSON envelope (`body`, `properties`, `headers`, …) that the producer
writes whole: anyone who may push to a queue decides its shape. kombu parses it inside the
transport's read, before any consumer callback, and anything it does not expect — an item
that is not JSON, a `properties` that is not an object, a `headers` that is a list — raises
out of the worker's event loop and stops the worker. The item was already popped and is not
yet among the unacknowledged ones, so it is dropped here with one log line, and the worker
reads on. A well-formed envelope goes on to the gate (tasks/gate.py).
"""

import logging
from queue import Empty

from kombu.transport import redis as kombu_redis

from agent_radar.workflows.escape import escape

log = logging.getLogger("agent_radar.gate")


def reason(exc: BaseException | None) -> str:
    """Why a message was refused, for its one log line: the error's class and text, on one
    line and cut short."""
    if exc is None:
        return "unknown message format"
    text = escape(f"{exc.__class__.__name__}: {exc}")
    return text if len(text) <= 200 else text[:197] + "..."


class _OneLine(logging.Filter):
    """kombu logs a broadcast that is not JSON with its traceback: one line is enough."""

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("Cannot process event"):
            record.exc_info = record.exc_text = None
        return True


logging.getLogger(kombu_redis.__name__).addFilter(_OneLine())


class GuardedRedisQoS(kombu_redis.QoS):
    def restore_unacked(self, client=None):
        """When the broker is lost, Celery closes the channel, and kombu then restores the
        unacknowledged messages through a connection the loss has already released: an
        AttributeError that stops the worker ("Unrecoverable error"; celery/kombu#970).
        The messages are still in Redis's unacknowledged set, and come back from there
        after the visibility timeout (and the sweeper republishes the work from the
        database long before), so the worker goes on to reconnect instead."""
        try:
            return super().restore_unacked(client)
        except AttributeError as exc:
            log.warning(
                "the broker was gone before %d unacknowledged message(s) could be put back "
                "(%s); Redis gives them back after the visibility timeout",
                len(self._delivered),
                reason(exc),
            )
            self._delivered.clear()
            return None


class GuardedRedisChannel(kombu_redis.Channel):
    QoS = GuardedRedisQoS

    def _brpop_read(self, **options):
        try:
            return super()._brpop_read(**options)
        except (Empty, *self.connection_errors):
            raise
        except Exception as exc:  # noqa: BLE001 - no item in a queue may stop the worker
            log.error("dropped a Redis item that is not a message envelope: %s", reason(exc))
            return True

    def _receive_one(self, c):
        # Broadcasts (remote control, events) arrive through publish/subscribe, with the
        # same envelope.
        try:
            return super()._receive_one(c)
        except (Empty, *self.connection_errors):
            raise
        except Exception as exc:  # noqa: BLE001
            log.error("dropped a Redis broadcast that is not a message envelope: %s", reason(exc))
            return None


class GuardedRedisTransport(kombu_redis.Transport):
    Channel = GuardedRedisChannel


def guard_transport(connection) -> None:
    """Read Redis through the guarded channel: set on a kombu Connection before it connects
    (its clones, for broadcasts and events, keep it)."""
    if connection.transport_cls in ("redis", "rediss"):
        # By name, not the class: the connection's info (`celery inspect stats`, Flower)
        # goes out as JSON.
        connection.transport_cls = f"{__name__}:{GuardedRedisTransport.__name__}"

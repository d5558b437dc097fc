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

from workflows.escape import escape

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


class GuardedRedisChannel(kombu_redis.Channel):
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

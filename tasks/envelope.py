"""The worker's transports, below the gate (tasks/gate.py): what a broker hands over is read
only when it is a message envelope of a bounded size, and a broker's refusal never stops the
worker's loop.

- Size: an item larger than MAX_ENVELOPE_BYTES (workflows/adapters/broker.py) is dropped
  before it is decoded: on Redis as it is popped, on RabbitMQ as its frames arrive (the
  message is delivered without its body, for the gate to refuse), on the filesystem before
  the file is read (workflows/adapters/broker.py).
- Shape: on Redis a message is a JSON envelope (`body`, `properties`, `headers`, …) that the
  producer writes whole: anyone who may push to a queue decides its shape. kombu parses it
  inside the transport's read, before any consumer callback, and anything it does not expect
  — an item that is not JSON, a `properties` that is not an object, a `headers` that is a
  list — raised out of the worker's event loop and stopped the worker. The item was already
  popped and is not yet among the unacknowledged ones, so it is dropped here with one log
  line, and the worker reads on. On RabbitMQ, properties that do not decode are dropped.
- Faults: Redis at `maxmemory` refuses the writes of kombu's bookkeeping (GuardedRedisQoS).
- Reconnects: kombu's Redis transport adds a callback to the worker's event loop each time a
  connection registers with it, and never takes the last one away; a worker whose broker
  came back N times ran N of them on every turn of its loop (after the broker-fault
  campaign's 24,000 reconnects, 5 messages a second). Only the newest stays
  (GuardedRedisTransport.register_with_event_loop).
"""

import logging
import struct
import time
import weakref
from queue import Empty
from typing import Any

from amqp import method_framing
from amqp import serialization as amqp_serialization
from kombu.transport import pyamqp as kombu_pyamqp
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from redis import exceptions as redis_errors

from ..workflows.adapters.broker import MAX_ENVELOPE_BYTES, check_envelope
from ..workflows.escape import escape

log = logging.getLogger("agent_radar.gate")

# A fault the worker meets on every round of its loop (a full broker) is logged at most this
# often.
FAULT_LOG_INTERVAL_S = 10.0
# Delivery tags whose restore Redis refused, in this process, and how often they are tried
# again (GuardedRedisQoS._retry_refused_restores).
REFUSED_RESTORES: set = set()
RESTORE_RETRY_S = 1.0
_restores_tried_at = 0.0


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
    """kombu's record of unacknowledged messages on Redis, kept going through a broker
    fault: Redis at `maxmemory` refuses every write in a transaction, and each of these
    raised out of the worker's event loop ("Unrecoverable error": every worker of that
    broker exits at once, and none comes back when memory is freed).
    - Delivery: the message is already popped; when Redis refuses to record it as
      unacknowledged it is delivered all the same (a worker killed before it finishes it
      loses that delivery, as a Redis restart loses what it held: the sweeper republishes
      internal work from the database).
    - Ack and reject: their two removals are sent without a transaction, which Redis allows
      at `maxmemory` (they free memory).
    - A requeue, a restore when the consumer restarts, and the restore of messages past the
      visibility timeout: when Redis refuses, the message stays among the unacknowledged,
      and its restore is tried again each second until Redis takes it."""

    def append(self, message, delivery_tag):
        try:
            super().append(message, delivery_tag)
        except self.channel.connection_errors:
            raise
        except Exception as exc:  # noqa: BLE001 - the message is in hand: deliver it
            log.warning(
                "Redis refused to record a delivery as unacknowledged (%s); delivered all the same",
                reason(exc),
            )
            virtual.QoS.append(self, message, delivery_tag)

    def _remove_from_indices(self, delivery_tag, pipe=None):
        if pipe is not None:  # a restore's transaction
            return super()._remove_from_indices(delivery_tag, pipe)
        with self.channel.conn_or_acquire() as client:
            return (
                client.pipeline(transaction=False)
                .zrem(self.unacked_index_key, delivery_tag)
                .hdel(self.unacked_key, delivery_tag)
            )

    def restore_by_tag(self, tag, client=None, leftmost=False):
        try:
            restored = super().restore_by_tag(tag, client=client, leftmost=leftmost)
        except self.channel.connection_errors:
            REFUSED_RESTORES.add(tag)
            raise
        except Exception as exc:  # noqa: BLE001 - it stays unacknowledged: tried again
            if tag not in REFUSED_RESTORES:
                log.warning(
                    "Redis refused to restore message %s (%s); tried again once Redis takes writes",
                    _short_tag(tag),
                    reason(exc),
                )
            REFUSED_RESTORES.add(tag)
            return None
        REFUSED_RESTORES.discard(tag)
        return restored

    def _retry_refused_restores(self) -> None:
        """The messages a refused restore left among the unacknowledged (the consumer
        restarted while Redis was read-only or full: its reserved messages would otherwise
        wait out the visibility timeout, an hour), put back as soon as Redis takes writes.
        A tag acked or restored since then puts nothing back."""
        global _restores_tried_at
        if not REFUSED_RESTORES or time.monotonic() - _restores_tried_at < RESTORE_RETRY_S:
            return
        _restores_tried_at = time.monotonic()
        for tag in list(REFUSED_RESTORES):
            self.restore_by_tag(tag)

    def restore_visible(self, *args, **kwargs):
        try:
            self._retry_refused_restores()
            return super().restore_visible(*args, **kwargs)
        except self.channel.connection_errors:
            raise
        except Exception as exc:  # noqa: BLE001 - the next round tries again
            if time.monotonic() >= self._quiet_until:
                self._quiet_until = time.monotonic() + FAULT_LOG_INTERVAL_S
                log.warning("Redis refused the restore of unacknowledged messages: %s", reason(exc))
            return None

    _quiet_until = 0.0

    def restore_unacked(self, client=None):
        """When the broker is lost, Celery closes the channel, and kombu then restores the
        unacknowledged messages through a connection the loss has already released: an
        AttributeError that stops the worker ("Unrecoverable error"; celery/kombu#970).
        The messages are still in Redis's unacknowledged set: they are put back from there
        through the worker's next connection, as a refused restore is
        (_retry_refused_restores), not after the visibility timeout (an hour: a producer's
        goal among them would wait that long)."""
        try:
            return super().restore_unacked(client)
        except AttributeError as exc:
            log.warning(
                "the broker was gone before %d unacknowledged message(s) could be put back "
                "(%s); they are put back once the worker has reconnected",
                len(self._delivered),
                reason(exc),
            )
            REFUSED_RESTORES.update(self._delivered)
            self._delivered.clear()
            return None


def _short_tag(tag: object) -> str:
    return escape(str(tag))[:80]


def _bounded(parse, what: str, item_of):
    """A client's `parse_response` that drops a reply whose item is over MAX_ENVELOPE_BYTES
    before kombu decodes it (it then reads as no message at all)."""

    def parse_response(*args, **options):
        response = parse(*args, **options)
        item = item_of(args, response)
        if isinstance(item, (bytes, str)) and len(item) > MAX_ENVELOPE_BYTES:
            log.error(
                "dropped a Redis %s of %d bytes, over %d, before decoding it",
                what,
                len(item),
                MAX_ENVELOPE_BYTES,
            )
            return None
        return response

    parse_response.bounded = True  # type: ignore[attr-defined]
    return parse_response


def _popped_item(args: tuple, response):
    # BRPOP answers [queue, item]; the client's other commands pass through.
    if len(args) > 1 and args[1] == "BRPOP" and isinstance(response, (list, tuple)):
        return response[-1] if len(response) == 2 else None
    return None


def _broadcast_item(_args: tuple, response):
    # A published message: [b"message", channel, data] (or pmessage with its pattern first).
    if (
        isinstance(response, (list, tuple))
        and response
        and response[0] in (b"message", b"pmessage")
    ):
        return response[-1]
    return None


def _bound(client, what: str, item_of) -> None:
    if not getattr(client.parse_response, "bounded", False):
        client.parse_response = _bounded(client.parse_response, what, item_of)


class GuardedRedisChannel(kombu_redis.Channel):
    """kombu's Redis channel, reading only what is a message envelope of a bounded size:
    an item over MAX_ENVELOPE_BYTES is dropped before it is decoded (a 48 MB header of
    `[{}, {}, …]` decoded to 1.7 GB in the worker's main process), anything that is not an
    envelope after it (below)."""

    QoS = GuardedRedisQoS
    _refused_quiet_until = 0.0

    def _brpop_read(self, **options):
        _bound(self.client, "item", _popped_item)
        try:
            return super()._brpop_read(**options)
        except (Empty, *self.connection_errors):
            raise
        except redis_errors.ResponseError as exc:
            # Redis refused the pop itself (read-only, full, busy): nothing was taken.
            if time.monotonic() >= self._refused_quiet_until:
                self._refused_quiet_until = time.monotonic() + FAULT_LOG_INTERVAL_S
                log.warning("Redis refused a read; nothing was taken: %s", reason(exc))
            raise Empty() from exc
        except Exception as exc:  # noqa: BLE001 - no item in a queue may stop the worker
            log.error("dropped a Redis item that is not a message envelope: %s", reason(exc))
            return True

    def _receive_one(self, c):
        # Broadcasts (remote control, events) arrive through publish/subscribe, with the
        # same envelope.
        _bound(c, "broadcast", _broadcast_item)
        try:
            return super()._receive_one(c)
        except (Empty, *self.connection_errors):
            raise
        except Exception as exc:  # noqa: BLE001
            log.error("dropped a Redis broadcast that is not a message envelope: %s", reason(exc))
            return None


# Per event loop, the tick callback of the Redis connection registered with it last.
_POLL_TICKS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


class GuardedRedisTransport(kombu_redis.Transport):
    Channel = GuardedRedisChannel

    def register_with_event_loop(self, connection, loop):
        """kombu's registration, with the callback a connection registered before this one
        (the worker's consumer has one broker connection at a time; the last was lost) taken
        off the loop."""
        before = set(loop.on_tick)
        super().register_with_event_loop(connection, loop)
        added = set(loop.on_tick) - before
        stale = _POLL_TICKS.pop(loop, None)
        if stale is not None and stale not in added:
            loop.on_tick.discard(stale)
        if len(added) == 1:
            _POLL_TICKS[loop] = next(iter(added))

    def _deliver(self, message, queue):
        # Items (BRPOP) and broadcasts (publish/subscribe) alike come through here, decoded:
        # NotAnEnvelope reaches the channel's read above, which drops the item in one line.
        super()._deliver(check_envelope(message), queue)


# -- RabbitMQ -----------------------------------------------------------------------------
# A content header: class id, weight, body size (AMQP 0-9-1, 4.2.6.1), then the properties.
HEADER_FIXED = struct.Struct(">HHQ")


def _properties_decode(class_id: int, buf) -> bool:
    """Whether a content header's properties decode: py-amqp's own decoding, tried before
    the message is built. It raises whatever a field table makes it raise — RecursionError
    (a table nested past the recursion limit fits in one frame), OverflowError or OSError
    (a timestamp past the platform's time_t: an OSError counts as a lost connection, and an
    OverflowError ended the worker) — and none of that may reach the connection."""
    try:
        amqp_serialization.PROPERTY_CLASSES[class_id](buf, HEADER_FIXED.size)
    except Exception:  # noqa: BLE001 - any failure: the properties are not AMQP
        return False
    return True


def guarded_frame_handler(connection, callback, **kwargs):
    """py-amqp's frame handler, bounding a message before it is decoded: a body larger than
    MAX_ENVELOPE_BYTES is not kept (its frames are counted and dropped as they arrive), and
    properties that do not decode are dropped; the message is then delivered bodiless, or
    bare, and the gate refuses it in its one line. A header frame itself is bounded by the
    connection's frame size (128 KiB)."""
    handle = method_framing.frame_handler(connection, callback, **kwargs)
    dropping: dict[int, int] = {}  # channel -> body bytes still to drop

    def on_frame(frame):
        frame_type, channel, buf = frame
        if frame_type == 3 and channel in dropping:
            connection.bytes_recv += 1
            dropping[channel] -= len(buf)
            if dropping[channel] <= 0:
                del dropping[channel]
            return False
        if frame_type != 2 or len(buf) < HEADER_FIXED.size:
            return handle(frame)
        class_id, weight, body_size = HEADER_FIXED.unpack_from(buf, 0)
        decodes = _properties_decode(class_id, buf)
        if body_size > MAX_ENVELOPE_BYTES or not decodes:
            if body_size:
                dropping[channel] = body_size
            # No body; and no properties (flags 0) when they do not decode.
            properties = bytes(buf[HEADER_FIXED.size :]) if decodes else b"\0\0"
            buf = HEADER_FIXED.pack(class_id, weight, 0) + properties
        return handle((frame_type, channel, buf))

    return on_frame


class GuardedAMQPConnection(kombu_pyamqp.Connection):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("frame_handler", guarded_frame_handler)
        super().__init__(*args, **kwargs)


class GuardedAMQPTransport(kombu_pyamqp.Transport):
    Connection = GuardedAMQPConnection


class GuardedAMQPSSLTransport(kombu_pyamqp.SSLTransport):
    Connection = GuardedAMQPConnection


GUARDED = {
    "redis": GuardedRedisTransport,
    "rediss": GuardedRedisTransport,
    "amqp": GuardedAMQPTransport,
    "pyamqp": GuardedAMQPTransport,
    "amqps": GuardedAMQPSSLTransport,
}


def guard_transport(connection) -> None:
    """Read Redis and RabbitMQ through the guarded transports: set on a kombu Connection
    before it connects (its clones, for broadcasts and events, keep it)."""
    guarded = GUARDED.get(connection.transport_cls)
    if guarded is not None:
        # By name, not the class: the connection's info (`celery inspect stats`, Flower)
        # goes out as JSON.
        connection.transport_cls = f"{__name__}:{guarded.__name__}"

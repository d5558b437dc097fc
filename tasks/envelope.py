"""The worker's transports, below the gate (tasks/gate.py): what a broker hands over is read
only when it is a message envelope of a bounded size, and a broker's refusal never stops the
worker's loop.

- Size: an item larger than MAX_ENVELOPE_BYTES (workflows/adapters/broker.py) is dropped
  before it is decoded: on Redis as it is popped, on RabbitMQ as its frames arrive
  (tasks/amqp_guard.py), on the filesystem before the file is read
  (workflows/adapters/broker.py).
- Shape: on Redis a message is a JSON envelope (`body`, `properties`, `headers`, …) that the
  producer writes whole: anyone who may push to a queue decides its shape. kombu parses it
  inside the transport's read, before any consumer callback, and anything it does not expect
  — an item that is not JSON, a `properties` that is not an object, a `headers` that is a
  list — raised out of the worker's event loop and stopped the worker. The item was already
  popped and is not yet among the unacknowledged ones, so it is dropped here with one log
  line, and the worker reads on. On RabbitMQ, properties that do not decode are dropped.
- Delivery tags: on Redis and the filesystem the producer writes a message's tag, and the
  tag names the consumer's record of it (its restore); each delivery gets a tag of the
  consumer's own (check_envelope), so a forged message cannot take over another's record.
- Faults: Redis at `maxmemory` refuses the writes of kombu's bookkeeping (GuardedRedisQoS);
  an unacknowledged entry that is not a message is removed (GuardedRedisQoS._restorable).
- Reconnects: kombu's Redis transport adds a callback to the worker's event loop each time a
  connection registers with it, and never takes the last one away; a worker whose broker
  came back N times ran N of them on every turn of its loop (after the broker-fault
  campaign's 24,000 reconnects, 5 messages a second). Only the newest stays
  (GuardedRedisTransport.register_with_event_loop).
"""

import json
import logging
import time
import weakref
from queue import Empty
from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from redis import exceptions as redis_errors

from ..workflows.adapters.broker import MAX_ENVELOPE_BYTES, check_envelope
from ..workflows.escape import escape
from .amqp_guard import GuardedAMQPSSLTransport, GuardedAMQPTransport

log = logging.getLogger("agent_radar.gate")

# A fault the worker meets on every round of its loop (a full broker) is logged at most this
# often.
FAULT_LOG_INTERVAL_S = 10.0
# Delivery tags whose restore Redis refused, in this process, and how often they are tried
# again, at most RESTORE_RETRY_BATCH at a time (GuardedRedisQoS._retry_refused_restores); at
# most MAX_REFUSED_RESTORES are kept (one past the visibility timeout is found again anyway).
REFUSED_RESTORES: set = set()
RESTORE_RETRY_S = 1.0
RESTORE_RETRY_BATCH = 64
MAX_REFUSED_RESTORES = 10_000
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
        if not self._restorable(tag, client):
            return None
        try:
            restored = super().restore_by_tag(tag, client=client, leftmost=leftmost)
        except self.channel.connection_errors:
            _refused(tag)
            raise
        except Exception as exc:  # noqa: BLE001 - it stays unacknowledged: tried again
            if tag not in REFUSED_RESTORES:
                log.warning(
                    "Redis refused to restore message %s (%s); tried again once Redis takes writes",
                    _short_tag(tag),
                    reason(exc),
                )
            _refused(tag)
            return None
        REFUSED_RESTORES.discard(tag)
        return restored

    def _restorable(self, tag, client=None) -> bool:
        """Whether the unacknowledged entry of `tag` is a message to put back (or nothing:
        kombu then only clears its indices). Anyone who may write to Redis may write this
        hash: an entry that is not `[message envelope, exchange, routing key]` of a bounded
        size aborted kombu's restore transaction, stayed, and was tried again on every
        round of the worker's loop (200,000 of them stalled it for a minute a round). It is
        removed, counted in one log line now and then."""
        try:
            with self.channel.conn_or_acquire(client) as conn:
                size = conn.hstrlen(self.unacked_key, tag)
                if not size:
                    return True
                if size <= MAX_ENVELOPE_BYTES:
                    entry = json.loads(conn.hget(self.unacked_key, tag))
                    if isinstance(entry, list) and len(entry) == 3:
                        message, exchange, routing_key = entry
                        check_envelope(message)
                        # kombu's restore marks it redelivered in its headers.
                        if isinstance(message.get("headers"), dict) and all(
                            isinstance(name, str) for name in (exchange, routing_key)
                        ):
                            return True
        except self.channel.connection_errors:
            raise
        except redis_errors.RedisError:
            return True  # Redis refuses the read too: kombu's restore says so
        except (ValueError, TypeError, RecursionError):  # not JSON, or not an envelope
            pass
        self._remove_from_indices(tag).execute()
        REFUSED_RESTORES.discard(tag)
        self._dropped += 1
        self._dropped_last = tag
        return False

    _dropped = 0
    _dropped_last: Any = None
    _dropped_quiet_until = 0.0

    def _log_dropped(self) -> None:
        if self._dropped and time.monotonic() >= self._dropped_quiet_until:
            self._dropped_quiet_until = time.monotonic() + FAULT_LOG_INTERVAL_S
            log.error(
                "dropped %d unacknowledged Redis entries that are not messages (the last: %s)",
                self._dropped,
                _short_tag(self._dropped_last),
            )
            self._dropped = 0

    def _retry_refused_restores(self) -> None:
        """The messages a refused restore left among the unacknowledged (the consumer
        restarted while Redis was read-only or full: its reserved messages would otherwise
        wait out the visibility timeout, an hour), put back as soon as Redis takes writes.
        A tag acked or restored since then puts nothing back."""
        global _restores_tried_at
        if not REFUSED_RESTORES or time.monotonic() - _restores_tried_at < RESTORE_RETRY_S:
            return
        _restores_tried_at = time.monotonic()
        for tag in list(REFUSED_RESTORES)[:RESTORE_RETRY_BATCH]:
            self.restore_by_tag(tag)

    def restore_visible(self, *args, **kwargs):
        try:
            self._retry_refused_restores()
            self._free_stale_mutex()
            return super().restore_visible(*args, **kwargs)
        except self.channel.connection_errors:
            raise
        except Exception as exc:  # noqa: BLE001 - the next round tries again
            if time.monotonic() >= self._quiet_until:
                self._quiet_until = time.monotonic() + FAULT_LOG_INTERVAL_S
                log.warning("Redis refused the restore of unacknowledged messages: %s", reason(exc))
            return None
        finally:
            self._log_dropped()

    _quiet_until = 0.0
    _mutex_look_at = 0.0

    def _free_stale_mutex(self) -> None:
        """kombu's restore scan takes a lock in Redis (`unacked_mutex`, for at most
        `unacked_mutex_expire` seconds) and skips its round, silently, while another holds
        it. A key set without an expiry, or one longer than that, is no scan's lock: it
        stopped every restore for good (a dead worker's messages were never put back). It is
        deleted, in one log line. Looked at every FAULT_LOG_INTERVAL_S (not at each round of
        the loop, which calls this)."""
        if time.monotonic() < self._mutex_look_at:
            return
        self._mutex_look_at = time.monotonic() + FAULT_LOG_INTERVAL_S
        with self.channel.conn_or_acquire() as client:
            left_ms = client.pttl(self.unacked_mutex_key)
            if left_ms == -1 or left_ms > self.unacked_mutex_expire * 1000:
                client.delete(self.unacked_mutex_key)
                log.error(
                    "deleted a Redis restore lock that no worker's scan holds (%s)",
                    "it had no expiry" if left_ms == -1 else f"{left_ms // 1000} s left",
                )

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
            for tag in self._delivered:
                _refused(tag)
            self._delivered.clear()
            return None


def _refused(tag) -> None:
    if len(REFUSED_RESTORES) < MAX_REFUSED_RESTORES:
        REFUSED_RESTORES.add(tag)


def _short_tag(tag: object) -> str:
    if isinstance(tag, bytes):
        tag = tag.decode(errors="replace")
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

    def _get(self, queue):
        # A synchronous get (basic_get) reads the same items as the worker's pop.
        return check_envelope(super()._get(queue))

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

"""Broker access: the queues, the connection, the embedded (filesystem) transport and the
Redis channel's guards, and the transport options workers and publishers share. Publishing is
in publisher.py."""

import base64
import json
import logging
import os
import shutil
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path
from queue import Empty
from typing import Any

import kombu.transport
from kombu import Connection, Exchange, Queue
from kombu.exceptions import ChannelError
from kombu.transport import filesystem, redis, virtual

from ..escape import escape
from .config import Settings

log = logging.getLogger(__name__)

DEFAULT_QUEUE = "default"
MAINTENANCE_QUEUE = "maintenance"
# Where a producer that follows Celery's defaults sends a task it names without a queue
# (`send_task("agent_radar.goal_control", kwargs=…)`): workers consume it too, so such a
# message is applied instead of waiting in a queue nobody reads (README.md).
CELERY_DEFAULT_QUEUE = "celery"
QUEUES = (DEFAULT_QUEUE, MAINTENANCE_QUEUE, CELERY_DEFAULT_QUEUE)
# On RabbitMQ, the exchange of the product's queue `q` is `agent_radar.q` (see kombu_queues).
AMQP_EXCHANGE_PREFIX = "agent_radar."
WORKER_QUEUES = ",".join(QUEUES)
# The filesystem transport polls its folder, and also sleeps this long whenever the worker
# is at its prefetch limit, so the interval caps throughput (docs/benchmarks.md: figures the
# code rests on).
FILESYSTEM_POLL_S = 0.01
# The longest one wait for a message lasts on the filesystem transport (see Transport).
FILESYSTEM_DRAIN_SLICE_S = 0.2
# Redis re-delivers an unacknowledged message after this long; it must exceed the longest
# task (task_time_limit) or a slow task would run twice at once.
VISIBILITY_TIMEOUT_S = 3600


# The largest message a worker reads, as the transport holds it (the envelope with its
# headers and its body, base64-encoded on Redis and the filesystem): what is larger is not
# a message of this product (tasks/gate.py bounds the body to 256 KiB and the headers to
# 32 KiB) and is dropped before it is decoded.
MAX_ENVELOPE_BYTES = 512 * 1024


class NotAnEnvelope(ValueError):
    """A transport's item that is not a kombu message envelope kombu can take."""


# The longest delivery tag kombu's own producers make is a uuid (36 characters).
MAX_DELIVERY_TAG_CHARS = 255
# A message's properties are a few ids and numbers (where a reply goes, its priority, where
# it was delivered); kombu's own are a few hundred bytes as JSON.
MAX_PROPERTIES_BYTES = 4 * 1024


def check_envelope(payload: Any) -> dict:
    """`payload` (a Redis item or a message file, decoded) if it is a message envelope of the
    shape kombu reads before any consumer callback runs, else NotAnEnvelope. kombu counts a
    KeyError as a lost connection and a redis-py DataError as a channel error: an item
    without `properties`, a `delivery_info` without an exchange or a null delivery tag
    restarted the worker's consumer (cancelling every running task) or stopped it.

    The envelope comes back with a delivery tag of this consumer's own. The producer writes
    the tag, and the tag names the consumer's record of an unacknowledged message (the one
    its restore puts back): a forged message that reused an in-flight message's tag had the
    gate's refusal of it delete that record, and the message was lost when the worker
    stopped."""
    if not isinstance(payload, dict):
        raise NotAnEnvelope("the item is not an object")
    properties = payload.get("properties")
    if not isinstance(properties, dict):
        raise NotAnEnvelope("properties is not an object")
    tag = properties.get("delivery_tag")
    if not (isinstance(tag, str) and 0 < len(tag) <= MAX_DELIVERY_TAG_CHARS and tag.isprintable()):
        raise NotAnEnvelope("delivery_tag is not a printable id")
    if properties.get("body_encoding") not in (None, "base64"):
        raise NotAnEnvelope("body_encoding is not base64")
    info = properties.get("delivery_info")
    if not (
        isinstance(info, dict)
        and isinstance(info.get("exchange"), str)
        and isinstance(info.get("routing_key"), str)
    ):
        raise NotAnEnvelope("delivery_info is not {exchange, routing_key}")
    priority = properties.get("priority")
    if priority is not None and not (
        isinstance(priority, int) and not isinstance(priority, bool) and 0 <= priority <= 255
    ):
        raise NotAnEnvelope("priority is not 0 to 255")
    if len(json.dumps(properties, default=repr)) > MAX_PROPERTIES_BYTES:
        # The worker keeps them with every message it holds, and hands them to the pool.
        raise NotAnEnvelope(f"properties of over {MAX_PROPERTIES_BYTES} bytes")
    body = payload.get("body")
    if not isinstance(body, (str, type(None))):
        raise NotAnEnvelope("body is not a text")
    if body and properties.get("body_encoding") == "base64":
        try:  # kombu decodes it as it builds the message, outside any consumer's guard
            base64.b64decode(body, validate=True)
        except ValueError:
            raise NotAnEnvelope("body is not base64") from None
    if not isinstance(payload.get("headers"), (dict, type(None))):
        raise NotAnEnvelope("headers is not an object")
    for name in ("content-type", "content-encoding"):
        if not isinstance(payload.get(name), (str, type(None))):
            raise NotAnEnvelope(f"{name} is not a text")
    properties["delivery_tag"] = str(uuid.uuid4())
    return payload


def queue_for(task_name: str) -> str:
    """Long maintenance work must not starve short work (docs/architecture.md)."""
    return MAINTENANCE_QUEUE if task_name.startswith("agent_radar.maintenance.") else DEFAULT_QUEUE


def kombu_queues(settings: Settings) -> list[Queue]:
    """The queues, as every producer and worker declares them.

    On RabbitMQ the product's own queues are quorum queues (replicated, durable, fsynced
    before the publisher's confirm) behind topic exchanges named `agent_radar.<queue>`:
    Celery's native delayed delivery, which a countdown retry needs on quorum queues, cannot
    route through direct exchanges, and a topic binding without wildcards routes exactly like
    a direct one. The exchanges are not named like the queues because celery-node declares
    an exchange `default` of its own (direct). Celery's default queue `celery` is declared
    as a producer with Celery's or celery-node's defaults declares it — a classic durable
    queue behind the direct exchange `celery` — so that RabbitMQ accepts their messages
    (docs/producers.md); retries never wait in it (tasks/strict.py). Elsewhere: direct
    exchanges named like their queues."""
    if settings.is_amqp_broker:
        return [
            Queue(
                name,
                Exchange(AMQP_EXCHANGE_PREFIX + name, type="topic"),
                routing_key=name,
                queue_arguments={"x-queue-type": "quorum"},
            )
            for name in (DEFAULT_QUEUE, MAINTENANCE_QUEUE)
        ] + [_celery_default_queue()]
    return [Queue(name, Exchange(name, type="direct"), routing_key=name) for name in QUEUES]


def _celery_default_queue() -> Queue:
    """Celery's default queue as Celery declares it by default (task_default_queue and
    task_default_exchange_type: a durable queue, a direct exchange of the same name)."""
    return Queue(
        CELERY_DEFAULT_QUEUE,
        Exchange(CELERY_DEFAULT_QUEUE, type="direct"),
        routing_key=CELERY_DEFAULT_QUEUE,
    )


def queue_named(settings: Settings, name: str) -> Queue:
    return next(q for q in kombu_queues(settings) if q.name == name)


def broker_connection(settings: Settings, **kwargs: Any) -> Connection:
    """A kombu connection to the configured broker, with its transport options."""
    if settings.broker_url.startswith("redis://"):
        kwargs.setdefault("transport", RedisTransport)
    return Connection(settings.broker_url, transport_options=transport_options(settings), **kwargs)


class RedisChannel(redis.Channel):
    """kombu's Redis channel, keeping one redis-py client for its commands.

    Upstream builds a new client for every command sent outside its event loop (each
    publish), most of its CPU spent copying redis-py's table of response callbacks, two
    per submit (the message and its task-sent event; docs/benchmarks.md, eleventh series).
    A redis-py client is thread-safe and takes a connection from the channel's pool per
    command, so one serves them all.
    """

    _kept_client: Any = None

    @contextmanager
    def conn_or_acquire(self, client=None):
        if client:
            yield client
            return
        if self._kept_client is None:
            self._kept_client = self._create_client()
        yield self._kept_client


class RedisTransport(redis.Transport):
    Channel = RedisChannel


class Channel(filesystem.Channel):
    """kombu's filesystem channel, with atomic message files of a bounded size.

    Upstream creates `<…>.msg` and then writes into it, while consumers move any `.msg` file
    they list without taking its lock, so a consumer can take a half-written message. Here the
    message is written under a temporary name and renamed into place, which is atomic.

    A consumer takes a file over MAX_ENVELOPE_BYTES off the queue without reading it (it
    stays in the processed folder, which the embedded stack empties at its start), and one
    that is not a message envelope (check_envelope) off the queue after reading it: each is
    one log line, and the consumer reads on.
    """

    def _get(self, queue):
        wanted = f"{queue}.msg"
        processed = self.processed_folder if self.store_processed else tempfile.gettempdir()
        for filename in sorted(os.listdir(self.data_folder_in)):
            if filename.partition(".")[2] != wanted:
                continue
            try:  # the move decides which consumer has the message
                shutil.move(os.path.join(self.data_folder_in, filename), processed)
            except OSError:
                continue  # another consumer's now
            path = os.path.join(processed, filename)
            try:
                size = os.path.getsize(path)
                if size > MAX_ENVELOPE_BYTES:
                    log.error(
                        "dropped a message file of %d bytes, over %d, before reading it",
                        size,
                        MAX_ENVELOPE_BYTES,
                    )
                    continue
                with open(path, "rb") as fh:
                    payload = fh.read()
                if not self.store_processed:
                    os.remove(path)
            except OSError as exc:
                raise ChannelError(f"Cannot read file {filename!r} from queue.") from exc
            try:
                return check_envelope(filesystem.loads(filesystem.bytes_to_str(payload)))
            except (ValueError, RecursionError, UnicodeError) as exc:  # JSON's errors too
                log.error(
                    "dropped a message file that is not a message envelope: %s",
                    escape(f"{exc.__class__.__name__}: {exc}")[:300],
                )
        raise Empty()

    def _put(self, queue, payload, **kwargs):
        name = f"{int(filesystem.monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        tmp = os.path.join(self.data_folder_out, f"tmp-{uuid.uuid4().hex}")
        with open(tmp, "wb") as fh:
            fh.write(filesystem.str_to_bytes(filesystem.dumps(payload)))
        os.rename(tmp, os.path.join(self.data_folder_out, name))


class Transport(filesystem.Transport):
    """Upstream keeps one binding registry per process (`global_state`). A process that
    talks to a second broker folder then believes its bindings exist, writes none to that
    folder, and messages published there before a worker binds are routed nowhere. Here each
    control folder has its own registry."""

    Channel = Channel
    _states: dict[str, virtual.BrokerState] = {}

    def __init__(self, client, **kwargs):
        super().__init__(client, **kwargs)
        folder = str(client.transport_options.get("control_folder", "control"))
        self.state = self._states.setdefault(folder, virtual.BrokerState())

    def drain_events(self, connection, timeout=None):
        # Celery's loop for transports without an event loop drains for up to 2 s before
        # it looks at a pending shutdown; shorter slices let a stopping worker exit that
        # much sooner. An idle worker just loops a little more often.
        if timeout is not None:
            timeout = min(timeout, FILESYSTEM_DRAIN_SLICE_S)
        return super().drain_events(connection, timeout=timeout)


# `filesystem://` URLs resolve to the transport above in every process that imports this
# module (client, workers, beat, Flower through the Celery app).
kombu.transport.TRANSPORT_ALIASES["filesystem"] = f"{__name__}:Transport"


def broker_folders(settings: Settings) -> dict[str, Path]:
    root = settings.broker_folder
    return {"queue": root / "queue", "processed": root / "processed", "control": root / "control"}


def transport_options(settings: Settings) -> dict[str, Any]:
    if settings.is_embedded_broker:
        folders = broker_folders(settings)
        for folder in folders.values():
            folder.mkdir(parents=True, exist_ok=True)
        # Processed messages are moved (renamed) within one filesystem: the rename is what
        # makes exactly one consumer win a message.
        return {
            "data_folder_in": str(folders["queue"]),
            "data_folder_out": str(folders["queue"]),
            "processed_folder": str(folders["processed"]),
            "store_processed": True,
            "control_folder": str(folders["control"]),
            "polling_interval": FILESYSTEM_POLL_S,
        }
    if settings.is_amqp_broker:
        # Publisher confirms: a publish returns once RabbitMQ has the message (on a quorum
        # queue: on disk); one it refused raises, so the row stays for the sweeper.
        return {"confirm_publish": True}
    options: dict[str, Any] = {"visibility_timeout": VISIBILITY_TIMEOUT_S}
    if settings.broker_key_prefix:
        options["global_keyprefix"] = settings.broker_key_prefix
    return options


# Where a producer that cannot set kombu's key prefix (celery-node, most non-Python Celery
# clients) leaves its messages: the queues' own names, without the prefix.
UNPREFIXED_QUEUES = ("celery", "default", "maintenance")


def unprefixed_backlog(settings: Settings) -> dict[str, int]:
    """On Redis with AGENT_RADAR_BROKER_KEY_PREFIX: the messages waiting under a queue's
    name without the prefix, which no worker of this deployment reads (docs/producers.md:
    the key prefix). Empty elsewhere, or when there are none."""
    if not (settings.is_redis_broker and settings.broker_key_prefix):
        return {}
    import redis as redis_py

    client = redis_py.Redis.from_url(settings.broker_url, socket_timeout=5)
    lengths = {}
    try:
        for name in UNPREFIXED_QUEUES:
            try:
                lengths[name] = int(client.llen(name))
            except redis_py.ResponseError:  # not a list (WRONGTYPE): no producer's queue
                continue
    finally:
        client.close()
    return {name: n for name, n in lengths.items() if n}


def warn_of_unprefixed(settings: Settings) -> dict[str, int]:
    """One line at a worker's start for every unread unprefixed queue (unprefixed_backlog),
    saying what to do; what it found."""
    try:
        found = unprefixed_backlog(settings)
    except Exception as exc:  # noqa: BLE001 - the broker is away: the worker finds out itself
        log.info("queues without the key prefix not looked at: %s", escape(exc))
        return {}
    for name, count in found.items():
        log.warning(
            "%d message(s) wait in the Redis list %r, without this deployment's key prefix "
            "%r: no worker reads them. Producers that cannot set the prefix (celery-node) "
            "publish there; unset AGENT_RADAR_BROKER_KEY_PREFIX, or give every producer "
            "the prefix (docs/producers.md: the key prefix)",
            count,
            name,
            escape(settings.broker_key_prefix),
        )
    return found


def clean_embedded_broker(settings: Settings) -> None:
    """Remove what a stopped monitor or an earlier run left: stale event bindings, and
    already-processed message files (kept only so that a move decides the consumer)."""
    if not settings.is_embedded_broker:
        return
    folders = broker_folders(settings)
    for path in folders["control"].glob("*celeryev*"):
        path.unlink(missing_ok=True)
    for path in folders["queue"].glob("*celeryev*"):
        path.unlink(missing_ok=True)
    for path in folders["processed"].glob("*.msg"):
        path.unlink(missing_ok=True)

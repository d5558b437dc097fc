"""The worker's gate: every message a worker takes passes here before Celery turns it into a
request (docs/security.md: messages).

The gate admits only what this product's own producers send (its client, beat and sweeper, a
public task's retry, a plain Celery or celery-node producer): a protocol 2 call of one of its
tasks, every header one of an allow-list with its type and bound (tasks/headers.py), a small
JSON `[args, kwargs, embed]` body with no workflow in it. Anything else — an unknown header,
a time limit, a shadow name, a retry count of 10**11, a stamp — is refused by construction
with one log line and a reject without requeue, and so is whatever still fails inside
Celery. Below it, the transports bound a message's size before it is decoded
(tasks/envelope.py); beside it, remote control keeps only what reads (tasks/control.py).

More guards live here because they act before Celery's code does:
- kombu decompresses a body while it builds the message, before any size check: a 1.4 KB
  bz2 message unpacked to 2 GB; and it decodes a body of content type `application/data` by
  its `content_encoding` with any codec Python has (`bz2_codec`: 785 bytes to 1 GiB). The
  worker refuses every compression and every encoding but a text codec (`refuse_unpacking`);
  producers of this service have no reason to compress, and send JSON in UTF-8.
- A message with an ETA is held in the worker's memory, past the prefetch limit, until it is
  due. An ETA further ahead than `MAX_ETA_S` is refused; past `ETA_HELD_MAX` held messages,
  a new one runs at once instead of being held. On RabbitMQ with quorum queues the prefetch
  is static (Celery cannot raise it for a held message), so a held message would take a
  slot from every message behind it: there an ETA is not held at all (the product's own
  countdowns wait in the broker's delay queues and arrive due).
- The text of a message's arguments (`argsrepr`, `kwargsrepr`), which Flower and the logs
  show, is rewritten from its body (`describe_arguments`).
- Celery's built-in tasks (`celery.chord_unlock`, `celery.starmap`, …) are not ours to run.
"""

import codecs
import json
import logging
from datetime import UTC, datetime

from celery.exceptions import InvalidTaskError
from celery.utils.saferepr import saferepr
from celery.worker import state as worker_state
from celery.worker.consumer.consumer import Consumer
from kombu import compression, serialization
from kombu.exceptions import ContentDisallowed

from ..workflows.adapters import logs
from ..workflows.adapters.broker import MAX_ENVELOPE_BYTES
from . import delayed_delivery
from .control import limit_remote_control
from .envelope import guard_transport, reason
from .headers import (
    HEADERS,
    PROPERTIES,
    check_allowed,
    check_dates,
    printable_id,
)
from .strict import PUBLIC_RETRY_MAX_S, TASK_NAMES

log = logging.getLogger("agent_radar.gate")

# Our messages carry ids and small JSON (an objective is at most 16 KiB, a prompt 64 KiB);
# anything larger than this is not ours and is refused before it is decoded.
MAX_MESSAGE_BYTES = 256 * 1024
# The longest wait this product asks for is a public task's retry countdown; twice that
# leaves room for clock skew between the worker that sent the retry and the one that takes
# it. Anything further ahead is not ours.
MAX_ETA_S = 2.0 * PUBLIC_RETRY_MAX_S
# At most this many messages wait for their ETA in one worker; beyond it a message runs at
# once. An ETA only spaces out a retry, so running one early costs a try, never a write.
ETA_HELD_MAX = 100
# Headers carry ids and short texts: all of a message's headers together, as JSON, at most
# this (RabbitMQ's record of a retry's way through its delay queues included).
MAX_HEADER_BYTES = 32 * 1024
# The longest text of a message's args or kwargs kept for Flower and the logs.
REPR_MAX = 1024
EMBED_KEYS = frozenset({"callbacks", "errbacks", "chain", "chord"})


# What a body's `content_encoding` may name: text codecs, which decode byte for byte.
# kombu runs `codecs.decode(body, content_encoding)` on any body of content type
# `application/data` or `application/text`, which it takes whatever `accept` says: with
# `bz2_codec` a 785-byte body unpacked to 1 GiB in the worker's main process.
TEXT_ENCODINGS = frozenset({"utf-8", "ascii"})
# The content of every message this product's producers send (JSON, in UTF-8).
JSON_CONTENT_TYPE = "application/json"


def _text_only(data, encoding: str):
    try:
        known = codecs.lookup(encoding).name
    except LookupError:
        known = None
    if known not in TEXT_ENCODINGS:
        raise ContentDisallowed(f"content encoding {str(encoding)[:64]!r} is refused")
    return codecs.decode(data, encoding)


def refuse_unpacking() -> None:
    """In this process (a worker's, Flower's), make kombu unpack nothing before it decodes a
    message (tasks, remote control and events alike): every compression it knows fails to
    decompress, and a content encoding other than a text codec fails to decode. The message
    then reaches `on_decode_error` as an error, never unpacked; an unknown compression
    already fails there."""

    def refuse(_body):
        raise InvalidTaskError("compressed messages are refused")

    for content_type in list(compression._decoders):
        compression._decoders[content_type] = refuse
    serialization._decode = _text_only


def _encoded_bytes(value: object) -> int:
    """The size of a decoded value as JSON: what it weighs, whatever its type."""
    return len(json.dumps(value, default=repr, ensure_ascii=False).encode("utf-8", "replace"))


def check_headers(headers: object, allowed: frozenset[str], now: datetime) -> None:
    """Raise InvalidTaskError unless `headers` are a protocol 2 call of an allowed task,
    every header one this service sends and within its bound (tasks/headers.py)."""
    if not isinstance(headers, dict):
        raise InvalidTaskError("headers are not a mapping")
    if "compression" in headers:
        raise InvalidTaskError("compressed messages are refused")
    task = headers.get("task")
    if task is None:
        raise InvalidTaskError("no task header (only protocol 2 messages are accepted)")
    if not isinstance(task, str) or task not in allowed:
        raise InvalidTaskError("not a task of this service")
    if not printable_id(headers.get("id")):
        raise InvalidTaskError("header 'id' is missing or not a printable string")
    check_allowed(headers, HEADERS, "header")
    if _encoded_bytes(headers) > MAX_HEADER_BYTES:
        # Celery keeps its headers (Flower shows them to every browser that opens a page).
        raise InvalidTaskError(f"headers of over {MAX_HEADER_BYTES} bytes")
    check_dates(headers, now, MAX_ETA_S)


def check_properties(properties: object) -> None:
    """Raise InvalidTaskError unless the message properties Celery reads into a request are
    within their bounds (tasks/headers.py)."""
    if not isinstance(properties, dict):
        raise InvalidTaskError("properties are not a mapping")
    check_allowed({k: v for k, v in properties.items() if k in PROPERTIES}, PROPERTIES, "property")


def check_body(message) -> tuple[list, dict]:
    """Raise InvalidTaskError unless the body is a small `[args, kwargs, embed]` in JSON;
    its args and kwargs."""
    body = message.body
    if not isinstance(body, (bytes, str)):
        raise InvalidTaskError("body is not bytes")
    if len(body) > MAX_MESSAGE_BYTES:
        raise InvalidTaskError(f"body of {len(body)} bytes is over {MAX_MESSAGE_BYTES}")
    if not body:
        # On RabbitMQ a body over MAX_ENVELOPE_BYTES is dropped as it arrives (envelope.py).
        raise InvalidTaskError(f"no body (or one of over {MAX_ENVELOPE_BYTES} bytes)")
    if message.content_type != JSON_CONTENT_TYPE:
        raise InvalidTaskError(f"content type {str(message.content_type)[:64]!r} is not JSON")
    encoding = message.content_encoding
    if not (
        encoding is None or isinstance(encoding, str) and encoding.lower() in ("utf-8", "utf8")
    ):
        raise InvalidTaskError(f"content encoding {str(encoding)[:64]!r} is not UTF-8")
    payload = message.decode()
    # Celery hands the pool the body as it came; the decoded copy would stay in the main
    # process with a message held for its ETA (a body of `[{}, …]` is 25 times its size).
    message._decoded_cache = None
    if not (isinstance(payload, (list, tuple)) and len(payload) == 3):
        raise InvalidTaskError("body is not [args, kwargs, embed]")
    args, kwargs, embed = payload
    if not isinstance(args, (list, tuple)) or not isinstance(kwargs, dict):
        raise InvalidTaskError("body args is not a list or kwargs is not an object")
    if any(not name.isidentifier() or name == "self" for name in kwargs):
        # `self` would collide with the bound task before any check of ours runs.
        raise InvalidTaskError("body kwargs has a name that is no argument")
    if embed is not None and not (
        isinstance(embed, dict)
        and set(embed) <= EMBED_KEYS
        and all(v in (None, [], ()) for v in embed.values())
    ):
        raise InvalidTaskError("body embed carries unknown keys or workflow callbacks")
    return list(args), kwargs


def describe_arguments(headers: dict, args: list, kwargs: dict) -> None:
    """Make the text of a message's arguments (`argsrepr`, `kwargsrepr`: what Flower, the
    worker's log lines and Celery's events show) say what its body holds, led by the label of
    the ids it names (workflows/adapters/logs.py). The publisher's own label is kept where the
    body does not contradict it (the client submit ID a dispatch message was sent for, which
    its body does not carry) and has no positional arguments: a message cannot be shown as
    about another session than the one its arguments name."""
    named = logs.ids_of_arguments(kwargs)
    claimed = logs.parse_label(headers.get("kwargsrepr") or "")
    if args or any(named.get(key, value) != value for key, value in claimed.items()):
        claimed = {}  # contradicted, or beside arguments it cannot be checked against
    text = logs.label({**claimed, **named})
    headers["argsrepr"] = saferepr(args, REPR_MAX)
    headers["kwargsrepr"] = (f"[{text}] " if text else "") + saferepr(kwargs, REPR_MAX)


def _short(value: object) -> str:
    """A header's value for a log line: its repr (newlines and control characters escaped),
    cut short."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class GuardedConsumer(Consumer):
    """Celery's consumer behind the gate (`worker_consumer` in tasks/app.py)."""

    class Blueprint(Consumer.Blueprint):
        # The delay queues are set up through the connected node (tasks/delayed_delivery.py).
        default_steps = [
            delayed_delivery.STEP if step == delayed_delivery.CELERY_STEP else step
            for step in Consumer.Blueprint.default_steps
        ]

    def __init__(self, *args, **kwargs) -> None:
        refuse_unpacking()
        limit_remote_control()
        super().__init__(*args, **kwargs)
        # RabbitMQ with quorum queues: Celery's prefetch cannot grow for a held message.
        self.static_prefetch = self.app.agent_radar_settings.is_amqp_broker
        if self.controller is not None:
            self.guard_process_task(self.controller)

    def guard_process_task(self, controller) -> None:
        """Celery hands a request to the pool under a semaphore of `concurrency` slots (on
        Redis and RabbitMQ) and gives the slot back only when the task ends or is revoked:
        any other error on the way (a stamp that is a list, in its revoked-check) kept the
        slot for ever, and one such message stopped a worker of one process from taking
        anything again, its consumer still up. This runs for a message just received and
        for one whose ETA came due (the timer calls it, outside the consumer's handler,
        where the error left the message unacknowledged): the slot is given back, and the
        message is refused like any other."""
        process = controller._process_task

        def guarded(request) -> None:
            try:
                process(request)
            except self.connection_errors:
                raise
            except Exception as exc:  # noqa: BLE001 - nothing in a message may stop the worker
                release = getattr(controller, "_quick_release", None)
                if release is not None:
                    release()
                worker_state.task_ready(request)
                self.refuse(request, exc)

        controller._process_task = guarded
        if self.on_task_request == process:  # no semaphore: the consumer calls it directly
            self.on_task_request = guarded

    def connection_for_read(self, heartbeat=None):
        connection = self.app.connection_for_read(heartbeat=heartbeat)
        guard_transport(connection)
        return self.ensure_connected(connection)

    def allowed_tasks(self) -> frozenset[str]:
        return frozenset(TASK_NAMES) & frozenset(self.app.tasks)

    def create_task_handler(self, *args, **kwargs):
        handle = super().create_task_handler(*args, **kwargs)
        allowed = self.allowed_tasks()

        def on_task_received(message):
            try:
                check_headers(message.headers, allowed, datetime.now(UTC))
                check_properties(message.properties)
                args, kwargs = check_body(message)
                describe_arguments(message.headers, args, kwargs)
                if message.headers.get("eta") and (
                    self.static_prefetch or len(worker_state.scheduled_requests) >= ETA_HELD_MAX
                ):
                    message.headers["eta"] = None  # run it now rather than hold one more
                return handle(message)
            except self.connection_errors:
                raise  # the consumer reconnects; the message is redelivered
            except Exception as exc:  # noqa: BLE001 - nothing in a message may stop the worker
                self.refuse(message, exc)
                return None

        return on_task_received

    def refuse(self, message, exc: BaseException | None) -> None:
        """One log line, and the message dropped without requeue (RabbitMQ dead-letters it
        where a dead-letter exchange is set)."""
        headers = getattr(message, "headers", None)
        if headers is None:  # a request: Celery has turned the message into one
            headers = getattr(message, "_request_dict", None)
        headers = headers if isinstance(headers, dict) else {}
        log.error(
            "rejected message %s of task %s: %s",
            _short(headers.get("id")),
            _short(headers.get("task")),
            reason(exc),
        )
        if getattr(message, "acknowledged", True):
            return  # Celery already settled it, or it is not a message at all
        try:
            message.reject(requeue=False)
        except self.connection_errors:
            raise
        except Exception as err:  # noqa: BLE001 - e.g. the channel closed under it
            log.warning("could not reject message %s: %s", _short(headers.get("id")), _short(err))

    # Celery's own handlers log a traceback and, for an unknown task, read headers that a
    # hostile message need not have; the gate answers each with its one line instead.
    def on_decode_error(self, message, exc) -> None:
        self.refuse(message, exc)

    def on_unknown_message(self, body, message) -> None:
        self.refuse(message, None)

    def on_unknown_task(self, body, message, exc) -> None:
        self.refuse(message, exc)

    def on_invalid_task(self, body, message, exc) -> None:
        self.refuse(message, exc)

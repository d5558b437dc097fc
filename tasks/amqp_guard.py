"""The worker's RabbitMQ transport, below the gate (tasks/gate.py; tasks/envelope.py for the
others): a message is bounded before it is decoded — a body larger than MAX_ENVELOPE_BYTES is
dropped as its frames arrive, properties that do not decode are dropped — and delivered
bodiless or bare for the gate to refuse in its one line."""

import struct

from amqp import method_framing
from amqp import serialization as amqp_serialization
from kombu.transport import pyamqp as kombu_pyamqp

from ..workflows.adapters.broker import MAX_ENVELOPE_BYTES

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

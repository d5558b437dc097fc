"""Input checks shared by the client, the CLI, the task wrappers, reports and runtime answers.

Everything that arrives from outside (a message body, a report, an agent host's answer) is
untrusted: every check raises InvalidArgument before anything touches the database, and the
limits are those of the database (PostgreSQL rejects NUL in text and JSON, integers outside
32 bits in INTEGER columns, and NaN in JSON), so a value that passes here can be stored on
either backend.
"""

import math
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

from .errors import InvalidArgument

MAX_ID_CHARS = 255
# An objective is prompt text for the agent; 16 KiB is far above a useful goal and keeps a
# row (and every broker message that carries one) small.
MAX_OBJECTIVE_BYTES = 16 * 1024
# The largest value of a 32-bit INTEGER column (revisions, epochs, tokens, attempts).
MAX_INT = 2**31 - 1
# JSON from outside (a goal, evidence): nesting deeper than this is no goal, and deep
# structures cost recursion in every later reader.
MAX_JSON_DEPTH = 32
MAX_JSON_BYTES = 64 * 1024
# A report may be dated at most this far ahead of the control plane's clock (docs/lifecycles.md:
# turns): a host with a bad clock must not make every later honest report look older.
MAX_REPORT_SKEW_S = 60
# Client submit IDs with this prefix belong to operations the product makes itself.
RESERVED_SUBMIT_PREFIXES = ("goal-generation-fence:",)
# A reason is an operator's sentence (a fence, a stop), kept in its row and audit event.
MAX_REASON_BYTES = 4096
# history() and listings return at most this many rows per call.
MAX_LIMIT = 1000


def check_id(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(f"{name} must be a string, got {type(value).__name__}", field=name)
    if not 1 <= len(value) <= MAX_ID_CHARS:
        raise InvalidArgument(
            f"{name} must be 1-{MAX_ID_CHARS} characters, got {len(value)}", field=name
        )
    # isprintable() also refuses NUL, control characters and lone surrogates.
    if not value.isprintable():
        raise InvalidArgument(f"{name} must contain printable characters only", field=name)
    return value


def check_submit_id(name: str, value: Any) -> str:
    """A client submit ID: an id that no product-made operation can use."""
    value = check_id(name, value)
    if value.startswith(RESERVED_SUBMIT_PREFIXES):
        raise InvalidArgument(
            f"{name} may not start with {value.split(':', 1)[0]!r}: that "
            "prefix is reserved for operations the product makes",
            field=name,
        )
    return value


def check_ids(name: str, value: Any, max_items: int) -> list[str]:
    """A non-empty list of ids, each checked as by check_id."""
    if not isinstance(value, list) or not 1 <= len(value) <= max_items:
        raise InvalidArgument(f"{name} must be a list of 1-{max_items} ids", field=name)
    return [check_id(name, item) for item in value]


def check_int(name: str, value: Any, *, minimum: int = 0, maximum: int = MAX_INT) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{name} must be an integer, got {type(value).__name__}", field=name)
    if not minimum <= value <= maximum:
        raise InvalidArgument(f"{name} must be between {minimum} and {maximum}", field=name)
    return value


def check_optional_int(
    name: str, value: Any, *, minimum: int = 0, maximum: int = MAX_INT
) -> int | None:
    return None if value is None else check_int(name, value, minimum=minimum, maximum=maximum)


# The longest a caller may wait for a record to settle (a day; `AgentRadar.wait`, the CLI's
# `--wait`): a NaN or an infinite timeout would never end.
MAX_WAIT_S = 86400.0


def check_seconds(name: str, value: Any, *, maximum: float) -> float:
    """A duration the caller gives in seconds: a number from 0 to `maximum` (not NaN)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= maximum:
        raise InvalidArgument(
            f"{name} must be a number of seconds from 0 to {maximum:g}", field=name
        )
    return float(value)


def check_limit(value: Any) -> int:
    return check_int("limit", value, minimum=1, maximum=MAX_LIMIT)


def check_text(name: str, value: Any, max_bytes: int, *, allow_empty: bool = False) -> str:
    """Free text (an objective, a prompt, a reason): valid UTF-8, no NUL, bounded."""
    if not isinstance(value, str):
        raise InvalidArgument(f"{name} must be a string, got {type(value).__name__}", field=name)
    if not allow_empty and not value.strip():
        raise InvalidArgument(f"{name} must not be empty", field=name)
    if "\x00" in value:
        raise InvalidArgument(f"{name} must not contain NUL characters", field=name)
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidArgument(f"{name} is not valid Unicode (lone surrogate)", field=name) from None
    if size > max_bytes:
        raise InvalidArgument(f"{name} is {size} bytes; the limit is {max_bytes}", field=name)
    return value


def check_reason(value: Any) -> str:
    return check_text("reason", value, MAX_REASON_BYTES, allow_empty=True)


def check_json(name: str, value: Any, *, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """A JSON value from outside that both databases can store: string keys, no NUL, no
    lone surrogates, finite numbers, bounded depth and size."""
    size = _check_json_value(name, value, 0)
    if size > max_bytes:
        raise InvalidArgument(f"{name} is about {size} bytes; the limit is {max_bytes}", field=name)
    return value


def _check_json_value(name: str, value: Any, depth: int) -> int:
    """Checks one value; returns roughly its encoded size."""
    if depth > MAX_JSON_DEPTH:
        raise InvalidArgument(f"{name} is nested deeper than {MAX_JSON_DEPTH}", field=name)
    if value is None or isinstance(value, bool):
        return 5
    if isinstance(value, int):
        if abs(value) > 2**63 - 1:
            raise InvalidArgument(f"{name} holds an integer out of range", field=name)
        return 20
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidArgument(f"{name} holds a number that is not finite", field=name)
        return 24
    if isinstance(value, str):
        return len(check_text(name, value, MAX_JSON_BYTES, allow_empty=True).encode()) + 2
    if isinstance(value, list):
        return 2 + sum(_check_json_value(name, item, depth + 1) + 1 for item in value)
    if isinstance(value, dict):
        size = 2
        for key, item in value.items():
            if not isinstance(key, str):
                raise InvalidArgument(f"{name} has a key that is not a string", field=name)
            size += _check_json_value(name, key, depth + 1)
            size += _check_json_value(name, item, depth + 1) + 2
        return size
    raise InvalidArgument(f"{name} holds a {type(value).__name__}, not JSON", field=name)


def check_json_object(name: str, value: Any, *, optional: bool = True) -> dict | None:
    if value is None and optional:
        return None
    if not isinstance(value, dict):
        raise InvalidArgument(f"{name} must be an object", field=name)
    return check_json(name, value)


# A report's time is in milliseconds: one before this (2001-09-09) is a host's time in
# seconds, or none at all, and would be taken as 1970 and ignored behind any later report.
EARLIEST_REPORT_MS = 1_000_000_000_000


def check_report_time(name: str, value_ms: Any, now: datetime) -> datetime:
    """A report's timestamp (ms since the epoch): in range, and not dated ahead of `now`
    by more than MAX_REPORT_SKEW_S."""
    latest_ms = int((now + timedelta(seconds=MAX_REPORT_SKEW_S)).timestamp() * 1000)
    ms = check_int(name, value_ms, maximum=2**63 - 1)
    if ms < EARLIEST_REPORT_MS:
        raise InvalidArgument(
            f"{name} must be milliseconds since the Unix epoch; {ms} is before 2001"
            " (a time in seconds?)",
            field=name,
        )
    if ms > latest_ms:
        raise InvalidArgument(
            f"{name} is more than {MAX_REPORT_SKEW_S} s ahead of the control plane's clock",
            field=name,
        )
    return datetime.fromtimestamp(ms / 1000, UTC)


def check_choice(name: str, value: Any, choices) -> str:
    """One of `choices` (strings); a value of any other type is refused, not hashed."""
    if not isinstance(value, str) or value not in choices:
        raise InvalidArgument(
            f"{name} must be one of {sorted(choices)}, got {value!r:.80}", field=name
        )
    return value


# An agent host's base URL: the operator's registration of a host, and every adapter to one.
MAX_URL_CHARS = 2048


def check_url(value: Any) -> str:
    """An agent host's base URL: http or https, a host name, no credentials, query or
    fragment (the token is AGENT_RADAR_RUNTIME_TOKEN, sent as a header)."""
    if not isinstance(value, str) or not value or len(value) > MAX_URL_CHARS:
        raise InvalidArgument(f"url must be a string of 1-{MAX_URL_CHARS} characters", field="url")
    if not value.isprintable() or any(ch.isspace() for ch in value):
        raise InvalidArgument("url must be printable, without spaces", field="url")
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError as exc:
        raise InvalidArgument(f"url is not a valid URL: {exc}", field="url") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidArgument("url must be http:// or https:// with a host", field="url")
    if parts.username is not None or parts.password is not None:
        raise InvalidArgument("url must not carry credentials", field="url")
    if parts.query or parts.fragment:
        raise InvalidArgument("url must not have a query or a fragment", field="url")
    del port
    return value.rstrip("/")

"""An agent host's answer, untrusted (docs/protocol.md): the shapes it must have, checked before any
step reads it. One that is not a JSON object of the documented shape, or is larger than
MAX_ANSWER_BYTES, is a retryable `bad_response` fault for that one call."""

import re
from collections.abc import Callable
from typing import Any

from ..errors import InvalidArgument, RuntimeFault
from ..validation import MAX_INT, check_id, check_json_object

# docs/protocol.md: a larger answer is a bad_response.
MAX_ANSWER_BYTES = 1024 * 1024
# An error code is a short word; an error detail is kept (in last_error) only this long.
ERROR_CODE = re.compile(r"[a-z][a-z0-9_]{0,63}")
MAX_DETAIL_CHARS = 300


JSON_TYPE_NAMES = {
    type(None): "null",
    list: "array",
    str: "string",
    int: "number",
    float: "number",
    bool: "boolean",
}


def bad_response(why: str, http_status: int | None = 200) -> RuntimeFault:
    return RuntimeFault(
        f"runtime answered {http_status} bad_response: {why}",
        code="bad_response",
        retryable=True,
        http_status=http_status,
    )


def printable(text: Any) -> str:
    """Untrusted text made safe to log and store: printable, bounded."""
    return "".join(ch if ch.isprintable() else "?" for ch in str(text)[:MAX_DETAIL_CHARS])


def is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def is_epoch(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_INT


def one_of(*choices: str) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, str) and v in choices


def json_object_or_none(v: Any) -> bool:
    try:
        check_json_object("answer", v)
        return True
    except InvalidArgument:
        return False


def is_id(v: Any) -> bool:
    return v is not None and id_or_none(v)


def id_or_none(v: Any) -> bool:
    try:
        return v is None or bool(check_id("answer", v))
    except InvalidArgument:
        return False


def shaped(
    answer: dict[str, Any],
    required: dict[str, Callable[[Any], bool]],
    optional: dict[str, Callable[[Any], bool]] | None = None,
) -> dict[str, Any]:
    """The answer if its documented fields have the documented types, else bad_response.
    Unknown fields are allowed (a newer host may add some) and ignored."""
    for name, ok in required.items():
        if name not in answer or not ok(answer[name]):
            raise bad_response(f"field {name!r} is missing or ill-typed")
    for name, ok in (optional or {}).items():
        if answer.get(name) is not None and not ok(answer[name]):
            raise bad_response(f"field {name!r} is ill-typed")
    return answer

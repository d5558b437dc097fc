"""What a task message of ours may carry (docs/security.md: messages): an allow-list of its
headers and properties, each with its type and bound. The gate (tasks/gate.py) refuses a
message with any other header, or with a value outside its bound, so a header that Celery
reads and this product never sends is refused by construction, not by a list of shapes
known to be bad.

The headers are those of Celery's protocol 2 as this product's producers write them: the
client's and the sweeper's publisher (workflows/adapters/publisher.py), beat and a public
task's retry (Celery's own `send_task`), a plain Celery producer and celery-node (which sends
`lang`, `task` and `id` only); and, on RabbitMQ, those the broker itself adds to a message it
dead-lettered through its delay queues or redelivered from a quorum queue.
"""

from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from celery.exceptions import InvalidTaskError
from celery.utils.time import maybe_iso8601

from ..workflows.kinds import RESULT_TASKS
from .strict import (
    PUBLIC_MAX_RETRIES,
    TASK_SOFT_TIME_LIMIT_S,
    TASK_TIME_LIMIT_S,
)

# Task ids are printed in logs and Flower and kept by Celery: a printable string of at most
# this many characters (uuids are 36).
MAX_ID_CHARS = 255
# The longest text header kept (Celery's text of the arguments, which the gate rewrites from
# the body anyway; Flower shows the start of it).
MAX_TEXT_CHARS = 4 * 1024
# An ISO 8601 date with microseconds and an offset is 32 characters.
MAX_DATE_CHARS = 64
# The dates a message may carry: far from either end of Python's calendar, so that no
# conversion to another time zone (Celery's, to the worker's local one) can overflow.
EARLIEST_DATE = datetime(2000, 1, 1, tzinfo=UTC)
LATEST_DATE = datetime(3000, 1, 1, tzinfo=UTC)
# A group's index: Celery numbers a group's members from 0; ours are never in a group.
MAX_GROUP_INDEX = 10_000
# How often RabbitMQ may have dead-lettered a message (once per delay queue it passed, at
# most 28 of them in Celery's native delayed delivery) or redelivered it.
MAX_DEATHS = 64
MAX_DELIVERY_COUNT = 10_000
# Celery nests a replaced task this deep at most (task_replace); ours never replace.
MAX_NESTING = 0


def printable_id(value: object) -> bool:
    return (
        isinstance(value, str)
        and 0 < len(value) <= MAX_ID_CHARS
        and value.isprintable()
        and value.strip() == value
    )


def _optional_id(value: object, _headers: dict) -> bool:
    return value is None or printable_id(value)


def _text(value: object, _headers: dict) -> bool:
    return value is None or isinstance(value, str) and len(value) <= MAX_TEXT_CHARS


def _count(maximum: int) -> Callable[[object, dict], bool]:
    def check(value: object, _headers: dict) -> bool:
        return (
            value is None
            or isinstance(value, int)
            and not isinstance(value, bool)
            and 0 <= value <= maximum
        )

    return check


def _flag(value: object, _headers: dict) -> bool:
    return value is None or isinstance(value, bool)


def _date(value: object, _headers: dict) -> bool:
    return value is None or isinstance(value, str) and 0 < len(value) <= MAX_DATE_CHARS


# The time limits a message may name: none, or the worker's own ([hard, soft], as Celery's
# `send_task` copies them from the configuration into beat's messages).
TIME_LIMITS = ([None, None], [TASK_TIME_LIMIT_S, TASK_SOFT_TIME_LIMIT_S])


def _no_limit(value: object, _headers: dict) -> bool:
    # A time limit is the worker's (tasks/app.py), never a message's: a soft limit fires
    # inside a database call, a hard one kills the pool process with every host call its
    # drain has in flight, and the sweeper's lease with it.
    return value is None or isinstance(value, (list, tuple)) and list(value) in TIME_LIMITS


def _shadow(value: object, headers: dict) -> bool:
    # Another name to show the task under (Flower, the log, the metrics' labels): only its own.
    return value is None or value == headers.get("task")


def _ignore_result(value: object, headers: dict) -> bool:
    # A message's `ignore_result` overrides its task's (Celery's get_actual_ignore_result):
    # False on any other task stored a result under the id the message chose (a sweep's
    # SUCCESS over a producer's FAILURE), or, expiring, a REVOKED one. Only the tasks whose
    # results producers read may keep theirs (tasks/app.py).
    return value is None or value is True or value is False and headers.get("task") in RESULT_TASKS


def _empty(value: object, _headers: dict) -> bool:
    # Stamps (revoke by stamp) and workflow state: this product uses none.
    return value is None or value in ([], (), {})


def _deaths(value: object, _headers: dict) -> bool:
    return (
        isinstance(value, (list, tuple))
        and len(value) <= MAX_DEATHS
        and all(isinstance(death, dict) for death in value)
    )


def _broker_text(value: object, _headers: dict) -> bool:
    return isinstance(value, str) and len(value) <= MAX_ID_CHARS and value.isprintable()


# name -> (what it must be, check(value, all headers)).
HEADERS: dict[str, tuple[str, Callable[[object, dict], bool]]] = {
    "lang": ("py or js", lambda value, _h: value in (None, "py", "js")),
    "task": ("a task name", lambda value, _h: isinstance(value, str)),  # and one of ours
    "id": ("a printable id", lambda value, _h: printable_id(value)),
    "root_id": ("a printable id", _optional_id),
    "parent_id": ("a printable id", _optional_id),
    "group": ("a printable id", _optional_id),
    "group_index": (f"a count up to {MAX_GROUP_INDEX}", _count(MAX_GROUP_INDEX)),
    "shadow": ("null or the task's own name", _shadow),
    "eta": ("an ISO 8601 date", _date),
    "expires": ("an ISO 8601 date", _date),
    "retries": (f"a count up to {PUBLIC_MAX_RETRIES}", _count(PUBLIC_MAX_RETRIES)),
    "timelimit": ("null or the worker's own", _no_limit),
    "argsrepr": (f"a text of at most {MAX_TEXT_CHARS} characters", _text),
    "kwargsrepr": (f"a text of at most {MAX_TEXT_CHARS} characters", _text),
    "origin": ("a printable id", _optional_id),
    "ignore_result": ("null, true, or false on a task whose result is kept", _ignore_result),
    "replaced_task_nesting": (f"a count up to {MAX_NESTING}", _count(MAX_NESTING)),
    "stamped_headers": ("null or empty", _empty),
    "stamps": ("null or empty", _empty),
    # Beat marks what it sends (celery/beat.py).
    "celery_beat_task": ("true or false", _flag),
    # kombu marks a message it restored on Redis (a lost connection, the visibility
    # timeout, a worker's stop): refusing it lost a producer's task for good.
    "redelivered": ("true or false", _flag),
    # RabbitMQ's own, on a message it dead-lettered (delayed delivery) or redelivered.
    "x-death": (f"a list of at most {MAX_DEATHS} tables", _deaths),
    "x-delivery-count": (f"a count up to {MAX_DELIVERY_COUNT}", _count(MAX_DELIVERY_COUNT)),
    **{
        f"x-{which}-death-{field}": ("a printable text", _broker_text)
        for which in ("first", "last")
        for field in ("exchange", "queue", "reason")
    },
}
# Headers a message must have.
REQUIRED = ("task", "id")

# The message properties Celery reads into a request (where a result goes, its priority),
# with their bounds; the others (delivery tag and mode, body encoding) are the transport's.
PROPERTIES: dict[str, tuple[str, Callable[[object, dict], bool]]] = {
    "correlation_id": ("a printable id", _optional_id),
    "reply_to": ("a printable id", lambda value, _h: value in (None, "") or printable_id(value)),
    "priority": ("a priority from 0 to 255", _count(255)),
}


def when(headers: dict, name: str) -> datetime | None:
    """The date of header `name` (UTC), None when it has none; a text that is no date is
    refused (an empty one is "no date" to Celery, and then fails in its code)."""
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        parsed = maybe_iso8601(raw)
        # As Celery reads it (in UTC): `0001-01-01T00:00:00+14:00` parses, and overflows here.
        parsed = parsed.astimezone(UTC) if parsed.tzinfo else parsed.replace(tzinfo=UTC)
    except (TypeError, ValueError, OverflowError, AttributeError):
        raise InvalidTaskError(f"header {name!r} is not an ISO 8601 date") from None
    if not EARLIEST_DATE <= parsed <= LATEST_DATE:
        raise InvalidTaskError(f"header {name!r} is not a date of this millennium")
    return parsed


def check_allowed(headers: dict, table: dict, what: str) -> None:
    """Raise InvalidTaskError unless every entry of `headers` is in `table` and within its
    bound. The refusal names the entry (escaped and cut short by the gate's log line)."""
    for name, value in headers.items():
        rule = table.get(name) if isinstance(name, str) else None
        if rule is None:
            raise InvalidTaskError(f"{what} {str(name)[:64]!r} is not one this service sends")
        must_be, check = rule
        if not check(value, headers):
            raise InvalidTaskError(f"{what} {name!r} must be {must_be}")


def check_dates(headers: dict, now: datetime, max_eta_s: float) -> None:
    """An ETA at most `max_eta_s` ahead; an expiry still to come, and only on a task whose
    result is not kept. Celery discards an expired message, but first marks its id revoked
    in the result backend: a row written, under an id the message chose (a producer's
    pending task's, to make it read as revoked). Beat's messages expire (beat/schedule.py);
    no producer of ours sets an expiry on a task whose result it reads."""
    eta = when(headers, "eta")
    if eta is not None and eta > now + timedelta(seconds=max_eta_s):
        raise InvalidTaskError(f"header 'eta' is more than {max_eta_s:g} s ahead")
    expires = when(headers, "expires")
    if expires is None:
        return
    if headers.get("task") in RESULT_TASKS:
        raise InvalidTaskError("header 'expires' is not taken on a task whose result is kept")
    if expires <= now:
        raise InvalidTaskError("header 'expires' has passed")

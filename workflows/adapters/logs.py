"""Structured logs (`AGENT_RADAR_LOG_FORMAT=json`): one JSON object per line, and on every
line logged while a task runs, the ids it works on — workspace, session, operation (goal
operation, fence, cancel, run or prompt) and attempt — so one grep finds an operation's story.

The ids come from a context the task wrapper sets (`task_context`); a log call may also
pass them itself (`extra={"operation_id": ...}`).

Every record is one line in either format, whatever its message says: a message interpolates
untrusted text (a task id from a message header, an error from an agent host), and a newline
or an escape sequence in it must not forge a line or reach a terminal (workflows/escape.py).
A traceback after the line carries an exception's message, untrusted too: in text, each of
its lines is escaped and indented, so none reads as a record of its own. Lines and
tracebacks are bounded in both formats.
"""

import contextlib
import contextvars
import json
import logging
import os
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote, unquote

from ..escape import escape

LOG_FORMAT_ENV = "AGENT_RADAR_LOG_FORMAT"
# The ids a line carries when they are known.
CONTEXT_FIELDS = (
    "task",
    "task_id",
    "workspace_id",
    "session_id",
    "operation_id",
    "fence_id",
    "run_id",
    "prompt_id",
    "client_submit_id",
    "attempt",
)
_context: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "agent_radar_log_context", default=None
)


@contextlib.contextmanager
def task_context(**ids: Any) -> Iterator[None]:
    """The ids of the work in hand, on every line logged inside the block (values that are
    not short strings or integers are left out: a message's arguments are untrusted)."""
    clean = {
        k: v
        for k, v in ids.items()
        if k in CONTEXT_FIELDS
        and v is not None
        and (isinstance(v, int) and not isinstance(v, bool) or isinstance(v, str) and len(v) < 256)
    }
    token = _context.set({**(_context.get() or {}), **clean})
    try:
        yield
    finally:
        _context.reset(token)


def current_context() -> dict[str, Any]:
    """The ids of the work in hand (to carry them to another thread: task_context(**ids))."""
    return dict(_context.get() or {})


# The label a message's arguments are shown under, first in Celery's text of them (Flower,
# the worker's "received" line): `ws/sid` and `key=value` pairs, each id percent-encoded, so no
# id can be read as the label's own syntax; a batch's labels joined by "; ". A worker's gate
# (tasks/gate.py) rewrites that text from the message's actual arguments, keeping only what
# of the publisher's label they do not contradict.
LABEL_KEYS = {
    "submit": "client_submit_id",
    "op": "operation_id",
    "fence": "fence_id",
    "run": "run_id",
    "prompt": "prompt_id",
}
_ID_FIELDS = ("workspace_id", "session_id", *LABEL_KEYS.values())


def _plain_id(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= 255 and value.isprintable()


def label(ids: dict[str, Any]) -> str:
    """The label of these ids (`acme/s1 submit=req-1`; empty for none)."""
    parts = []
    if _plain_id(ids.get("workspace_id")) and _plain_id(ids.get("session_id")):
        parts.append(f"{quote(ids['workspace_id'], safe='')}/{quote(ids['session_id'], safe='')}")
    for short, field in LABEL_KEYS.items():
        if _plain_id(ids.get(field)):
            parts.append(f"{short}={quote(ids[field], safe='')}")
    return " ".join(parts)


def parse_label(text: str) -> dict[str, str]:
    """The ids of the label that leads `text` (`[…] …`): none for no label, a batch's, or
    anything that is not a label as `label` writes one."""
    if not text.startswith("[") or "]" not in text[:4096]:
        return {}
    found: dict[str, str] = {}
    for part in text[1 : text.index("]")].split(" "):
        short, equals, value = part.partition("=")
        if equals and short in LABEL_KEYS and LABEL_KEYS[short] not in found:
            found[LABEL_KEYS[short]] = unquote(value)
        elif not equals and part.count("/") == 1 and "workspace_id" not in found:
            workspace, session = part.split("/")
            found["workspace_id"], found["session_id"] = unquote(workspace), unquote(session)
        else:
            return {}
    return found if all(_plain_id(v) for v in found.values()) else {}


def ids_of_arguments(kwargs: dict[str, Any]) -> dict[str, str]:
    """The ids a message's keyword arguments name (a report's session included)."""
    ids = {k: kwargs[k] for k in _ID_FIELDS if _plain_id(kwargs.get(k))}
    report = kwargs.get("report")
    if isinstance(report, dict):
        for key in ("workspace_id", "session_id"):
            if key not in ids and _plain_id(report.get(key)):
                ids[key] = report[key]
    return ids


class ContextFilter(logging.Filter):
    """Copies the context's ids onto each record (a record's own extra= wins). Celery's own
    lines about a task (received, succeeded, failed) carry its name, id and the text of its
    arguments, led by the label the worker's gate wrote from them: its ids are copied too."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in (_context.get() or {}).items():
            if not hasattr(record, key):
                setattr(record, key, value)
        data = getattr(record, "data", None)
        if isinstance(data, dict) and record.name.startswith("celery."):
            found: dict[str, Any] = {"task": data.get("name"), "task_id": data.get("id")}
            if isinstance(data.get("kwargs"), str):
                found.update(parse_label(data["kwargs"]))
            for key, value in found.items():
                if isinstance(value, str) and not hasattr(record, key):
                    setattr(record, key, value)
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": bounded(record.getMessage(), LINE_MAX_CHARS),
            "process": record.process,
        }
        for key in CONTEXT_FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                line[key] = value
        if record.exc_info:
            line["exception"] = bounded(self.formatException(record.exc_info), TRACEBACK_MAX_CHARS)
        # ensure_ascii (the default, said here because it matters): besides the control
        # characters JSON always escapes, U+2028/U+2029 and the bidi overrides are written
        # as \uXXXX, so a line that is printed or grepped is still one line as written.
        return json.dumps(line, default=str, ensure_ascii=True)


# A line (the message with its time, level and ids) is cut at this many characters, and a
# traceback after it at TRACEBACK_MAX_CHARS: an untrusted value (a header, a host's answer)
# that reaches a log line cannot fill a disk.
LINE_MAX_CHARS = 8 * 1024
TRACEBACK_MAX_CHARS = 32 * 1024
# Each line of a traceback is indented by this: an exception's message is untrusted text
# too, and a newline in it must not start a line that reads as a record of its own.
TRACEBACK_INDENT = "  "


def bounded(text: str, limit: int) -> str:
    """`text`, cut at `limit` characters with a note of how many more there were."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


def _traceback_lines(text: str) -> str:
    return "\n".join(
        TRACEBACK_INDENT + escape(line) for line in bounded(text, TRACEBACK_MAX_CHARS).split("\n")
    )


class EscapedLine(logging.Formatter):
    """A text formatter whose line (its format applied: time, level, the message, Celery's
    task name and id) is escaped and bounded, and whose traceback after it is escaped and
    bounded too, each of its lines indented."""

    def format(self, record: logging.LogRecord) -> str:
        record.exc_text = None  # another handler's formatter may have cached it unescaped
        return super().format(record)

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        return bounded(escape(super().formatMessage(record)), LINE_MAX_CHARS)

    def formatException(self, ei) -> str:  # noqa: N802 - logging's name
        return _traceback_lines(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:  # noqa: N802 - logging's name
        return _traceback_lines(super().formatStack(stack_info))


def escaped(formatter: logging.Formatter | None) -> logging.Formatter:
    """The handler's formatter, its line escaped. Celery's formatters are kept (by giving
    the instance a subclass of its own class) rather than rebuilt: they hold the configured
    format, the colours of a terminal, and the task name and id that the task logger's
    formatter looks up at format time, after any filter has run."""
    if formatter is None:
        return EscapedLine()
    if not isinstance(formatter, EscapedLine):
        cls = type(formatter)
        formatter.__class__ = type(f"Escaped{cls.__name__}", (EscapedLine, cls), {})
    return formatter


class QuietRoutine(logging.Filter):
    """Drops Celery's INFO lines about the sweep (the worker's "received", "succeeded" and
    beat's "Sending due task"): it runs every 2 s and would drown the lines about real work.
    Its warnings and errors still show. And one expected warning (EXPECTED)."""

    ROUTINE = ("agent_radar.sweep[", "due task agent-radar-sweep ")
    LOGGERS = ("celery.app.trace", "celery.worker.strategy", "celery.beat")
    # kombu's warning at every worker start on RabbitMQ that Celery's default queue has a
    # direct exchange: it is declared so on purpose, as default producers declare it
    # (workflows/adapters/broker.py; docs/producers.md says what it means for a countdown).
    EXPECTED = ("kombu.transport.native_delayed_delivery", "Exchange celery is a direct exchange")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == self.EXPECTED[0] and str(record.msg).startswith(self.EXPECTED[1]):
            return False
        if record.levelno > logging.INFO or record.name not in self.LOGGERS:
            return True
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a record that cannot format is kept
            return True
        return not any(marker in text for marker in self.ROUTINE)


def json_logs_wanted(env: Mapping[str, str] | None = None) -> bool:
    """Whether AGENT_RADAR_LOG_FORMAT asks for JSON lines; text when unset or empty, and
    anything but text or json refused."""
    value = ((env if env is not None else os.environ).get(LOG_FORMAT_ENV) or "text").lower()
    if value not in ("text", "json"):
        raise ValueError(f"{LOG_FORMAT_ENV} must be text or json, got {value!r}")
    return value == "json"


def warnings_as_json() -> None:
    """Python's warnings (Celery's SecurityWarning at start, say) as JSON lines on stderr,
    like every other line, instead of raw text: for a process about to start with JSON logs."""
    logging.captureWarnings(True)
    warned = logging.getLogger("py.warnings")
    if not warned.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(JsonFormatter())
        warned.addHandler(handler)
        warned.propagate = False


def install(logger: logging.Logger) -> None:
    """Make `logger`'s handlers carry the context's ids, and write JSON if asked; either
    way every record is one line."""
    as_json = json_logs_wanted()
    for handler in logger.handlers:
        if not any(isinstance(f, ContextFilter) for f in handler.filters):
            handler.addFilter(ContextFilter())
            handler.addFilter(QuietRoutine())
        handler.setFormatter(JsonFormatter() if as_json else escaped(handler.formatter))

"""Structured logs (`AGENT_RADAR_LOG_FORMAT=json`): one JSON object per line, and on every
line logged while a task runs, the ids it works on — workspace, session, operation (goal
operation, fence, cancel, run or prompt) and attempt — so one grep finds an operation's story.

The ids come from a context the task wrapper sets (`task_context`); a log call may also
pass them itself (`extra={"operation_id": ...}`).
"""

import contextlib
import contextvars
import json
import logging
import os
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

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


class ContextFilter(logging.Filter):
    """Copies the context's ids onto each record (a record's own extra= wins)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in (_context.get() or {}).items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "process": record.process,
        }
        for key in CONTEXT_FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                line[key] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class QuietRoutine(logging.Filter):
    """Drops Celery's INFO lines about the sweep ("received", "succeeded"): it runs every
    2 s and would drown the lines about real work. Its warnings and errors still show."""

    ROUTINE = ("agent_radar.sweep[",)
    LOGGERS = ("celery.app.trace", "celery.worker.strategy")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO or record.name not in self.LOGGERS:
            return True
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a record that cannot format is kept
            return True
        return not any(marker in text for marker in self.ROUTINE)


def json_logs_wanted(env: dict[str, str] | None = None) -> bool:
    value = (env if env is not None else os.environ).get(LOG_FORMAT_ENV, "text").lower()
    if value not in ("text", "json"):
        raise ValueError(f"{LOG_FORMAT_ENV} must be text or json, got {value!r}")
    return value == "json"


def install(logger: logging.Logger) -> None:
    """Make `logger`'s handlers carry the context's ids, and write JSON if asked."""
    as_json = json_logs_wanted()
    for handler in logger.handlers:
        if not any(isinstance(f, ContextFilter) for f in handler.filters):
            handler.addFilter(ContextFilter())
            handler.addFilter(QuietRoutine())
        if as_json:
            handler.setFormatter(JsonFormatter())

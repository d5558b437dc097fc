"""The reports a host sends while `host-check` runs (docs/host-check.md: reports), read from a
broker no worker reads: each must be of the documented shape, dated in milliseconds and
signed by the host with its token (docs/protocol.md: reports), and the ones a host must send
must come (a turn's start and its end, a session gone offline, a new epoch).

The check takes every message it finds on that broker's queues `celery` and `default`
(where celery-node and Celery's own clients publish): point the host at a broker, or a Redis
database, of the check's own."""

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from kombu import Connection, Queue

from ...models.base import utcnow
from ..activity.activity import parse_report
from ..adapters.report_auth import MAX_SIGNED_AGE_S, signature_ok
from ..errors import AgentRadarError
from ..task_names import REPORT_ACTIVITY_TASK

REPORT_QUEUES = ("celery", "default")
# At most this many messages are read in one check: a broker full of other traffic is not
# ours to drain.
MAX_MESSAGES = 5_000


class ReportFault(Exception):
    """A report, or a missing one, that breaks the protocol: the evidence."""


def read_reports(url: str) -> list[dict[str, Any]]:
    """Every report waiting on the broker's report queues now (taken off them)."""
    found: list[dict[str, Any]] = []
    with Connection(url, connect_timeout=5) as conn:
        for name in REPORT_QUEUES:
            channel = conn.channel()
            try:
                queue = Queue(name, channel=channel, no_declare=True)
                while len(found) < MAX_MESSAGES:
                    try:
                        message = queue.get(no_ack=True)
                    except conn.channel_errors:  # no such queue on RabbitMQ
                        break
                    if message is None:
                        break
                    report = _report_of(message)
                    if report is not None:
                        found.append(report)
            finally:
                try:
                    channel.close()
                except conn.channel_errors + conn.connection_errors:
                    pass
    return found


def _report_of(message: Any) -> Any:
    """The `report` argument of an agent_radar.report_activity message (Celery's message
    protocol 2, or 1), or None for any other message."""
    try:
        body = message.decode()
    except Exception:  # noqa: BLE001 - not ours to read
        return None
    headers = message.headers or {}
    if headers.get("task") == REPORT_ACTIVITY_TASK and isinstance(body, list | tuple):
        kwargs = body[1] if len(body) > 1 else None
    elif isinstance(body, dict) and body.get("task") == REPORT_ACTIVITY_TASK:
        kwargs = body.get("kwargs")
    else:
        return None
    return kwargs.get("report") if isinstance(kwargs, dict) else None


def check_report(report: Any, host_id: str, token: str) -> None:
    """One report as a worker would take it: ReportFault with what is wrong."""
    now = utcnow()
    try:
        parsed = parse_report(report, now)
    except AgentRadarError as exc:
        raise ReportFault(f"a report agent-radar refuses ({exc}): {report!r}") from None
    if report.get("signed_by") != host_id or not signature_ok(report, token):
        raise ReportFault(
            f"a report not signed by {host_id} with its token (signed_by "
            f"{report.get('signed_by')!r}): {report!r}"
        )
    if parsed.occurred_at < now - timedelta(seconds=MAX_SIGNED_AGE_S):
        raise ReportFault(f"a report dated over {MAX_SIGNED_AGE_S} s ago: {report!r}")


def check_reports(
    url: str,
    workspace: str,
    host_id: str,
    token: str,
    due: dict[str, Callable[[list[dict]], bool]],
    wait_s: float,
) -> str:
    """Read the check's reports until each of `due` (what a host must have sent: a name, and
    whether the reports so far show it) is met, for up to `wait_s`; every report of the
    check's workspace must pass `check_report`. The evidence, or ReportFault."""
    ours: list[dict] = []
    deadline = time.monotonic() + wait_s
    while True:
        for report in read_reports(url):
            if isinstance(report, dict) and report.get("workspace_id") == workspace:
                check_report(report, host_id, token)
                ours.append(report)
            elif not isinstance(report, dict):
                raise ReportFault(f"a report that is not a JSON object: {report!r}")
        missing = [name for name, met in due.items() if not met(ours)]
        if not missing or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    if missing:
        raise ReportFault(f"{len(ours)} reports came in {wait_s:g} s, none of {', '.join(missing)}")
    return (
        f"{len(ours)} reports, each signed by {host_id} and of the documented shape; "
        + ", ".join(due)
    )

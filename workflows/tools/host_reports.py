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


def read_reports(url: str, key_prefix: str = "") -> list[tuple[Any, str | None]]:
    """Every report waiting on the broker's report queues now (taken off them), each with
    what is wrong with its message, if anything (`_report_of`). `key_prefix`: the Redis key
    prefix the host publishes under (AGENT_RADAR_BROKER_KEY_PREFIX)."""
    found: list[tuple[Any, str | None]] = []
    options = {"global_keyprefix": key_prefix} if key_prefix else {}
    with Connection(url, connect_timeout=5, transport_options=options) as conn:
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


def _report_of(message: Any) -> tuple[Any, str | None] | None:
    """The `report` argument of an agent_radar.report_activity message, and what the
    workers' gate would refuse in the message itself (None: nothing): Celery's message
    protocol 2 only, no positional arguments, `report` the one keyword. None for any other
    task's message."""
    try:
        body = message.decode()
    except Exception:  # noqa: BLE001 - not ours to read
        return None
    headers = message.headers or {}
    if isinstance(body, dict) and body.get("task") == REPORT_ACTIVITY_TASK:
        kwargs = body.get("kwargs")
        report = kwargs.get("report") if isinstance(kwargs, dict) else None
        return report, "Celery's message protocol 1, which the workers refuse (use protocol 2)"
    if headers.get("task") != REPORT_ACTIVITY_TASK:
        return None
    if not isinstance(body, list | tuple) or len(body) != 3:
        return None, "a body that is not [args, kwargs, embed]"
    args, kwargs = body[0], body[1]
    report = kwargs.get("report") if isinstance(kwargs, dict) else None
    if args or not isinstance(kwargs, dict) or set(kwargs) != {"report"}:
        return report, "arguments other than the one keyword `report`"
    return report, None


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
    key_prefix: str = "",
) -> str:
    """Read the check's reports until each of `due` (what a host must have sent: a name, and
    whether the reports so far show it) is met, for up to `wait_s`; every report of the
    check's workspace must pass `check_report`, in a message the workers take. The
    evidence, or ReportFault."""
    ours: list[dict] = []
    deadline = time.monotonic() + wait_s
    while True:
        for report, problem in read_reports(url, key_prefix):
            mine = isinstance(report, dict) and report.get("workspace_id") == workspace
            if problem is not None and (mine or report is None):
                raise ReportFault(f"a report message with {problem}: {report!r}")
            if mine:
                check_report(report, host_id, token)
                ours.append(report)
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

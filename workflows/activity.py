"""Activity reports from agent hosts (DESIGN 4.4): session fields and goal-applied evidence."""

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.orm import Session

from models.enums import OperationStatus
from models.tables import GoalOperation
from workflows.errors import InvalidArgument
from workflows.goals import complete_applied
from workflows.sessions import lock_session
from workflows.validation import check_id, check_int

SESSION_FIELDS = {"provider", "provider_session_id", "live", "runtime_epoch"}
REPORT_PARTS = {"workspace_id", "session_id", "occurred_at_ms", "session", "turn", "goal_applied"}


@dataclass(frozen=True)
class Report:
    workspace_id: str
    session_id: str
    occurred_at: datetime
    session: dict[str, Any] | None
    goal_applied: dict[str, Any] | None


def _check_dict(name: str, value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidArgument(f"{name} must be an object", field=name)
    return value


def parse_report(report: Any) -> Report:
    if not isinstance(report, dict):
        raise InvalidArgument("report must be a JSON object", field="report")
    unknown = set(report) - REPORT_PARTS
    if unknown:
        raise InvalidArgument(f"unknown report fields: {sorted(unknown)}", field="report")
    occurred_ms = check_int("occurred_at_ms", report.get("occurred_at_ms"))
    session = _check_dict("session", report.get("session"))
    if session is not None:
        extra = set(session) - SESSION_FIELDS
        if extra:
            raise InvalidArgument(f"unknown session fields: {sorted(extra)}", field="session")
        for key in ("provider", "provider_session_id"):
            if session.get(key) is not None:
                check_id(f"session.{key}", session[key])
        if "live" in session and not isinstance(session["live"], bool):
            raise InvalidArgument("session.live must be a boolean", field="session.live")
        if "runtime_epoch" in session:
            check_int("session.runtime_epoch", session["runtime_epoch"])
    applied = _check_dict("goal_applied", report.get("goal_applied"))
    if applied is not None:
        check_id("goal_applied.operation_id", applied.get("operation_id"))
        check_int("goal_applied.revision", applied.get("revision"), minimum=1)
        _check_dict("goal_applied.goal", applied.get("goal"))
    _check_dict("turn", report.get("turn"))
    return Report(
        workspace_id=check_id("workspace_id", report.get("workspace_id")),
        session_id=check_id("session_id", report.get("session_id")),
        occurred_at=datetime.fromtimestamp(occurred_ms / 1000, UTC),
        session=session, goal_applied=applied)


def apply_report(session: Session, report: Report, now: datetime) -> list[str]:
    """Apply one report in the caller's transaction; returns operation ids it completed."""
    row = lock_session(session, report.workspace_id, report.session_id)
    if report.session is not None and (
            row.last_report_at is None or report.occurred_at >= row.last_report_at):
        # Older session facts than the last applied ones are ignored: reports can arrive
        # out of order through the broker.
        for key, value in report.session.items():
            setattr(row, key, value)
        row.last_report_at = report.occurred_at
    completed: list[str] = []
    applied = report.goal_applied
    if applied is not None:
        op = session.get(GoalOperation, applied["operation_id"], populate_existing=True)
        # Only a report naming exactly this operation and revision counts as evidence.
        if (op is not None and op.workspace_id == report.workspace_id
                and op.session_id == report.session_id
                and op.goal_revision == applied["revision"]
                and op.status == OperationStatus.DISPATCHED
                and complete_applied(session, op, applied.get("goal"),
                                     {"report": "goal_applied"}, now)):
            completed.append(op.operation_id)
    return completed

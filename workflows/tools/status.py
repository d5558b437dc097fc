"""`agent-radar status`: the fleet at a glance, straight from the database."""

from datetime import datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.engine import Engine

from models.base import utcnow
from models.db import run_transaction
from models.enums import (
    LIVE_MAINTENANCE_STATUSES,
    OPEN_OPERATION_STATUSES,
    MaintenanceStatus,
    PromptStatus,
)
from models.tables import CancelOperation, GoalFence, GoalOperation, MaintenanceRun, Prompt
from workflows import budgets, leases

# Due work older than this is "overdue": the sweeper (every 2 s by default) should have
# picked it up long before.
OVERDUE_S = 30


def fleet_status(engine: Engine, now: datetime | None = None) -> dict:
    now = now or utcnow()

    def read(s) -> dict:
        per_status = dict(
            s.execute(
                select(GoalOperation.status, func.count()).group_by(GoalOperation.status)
            ).all()
        )
        due_filter = (
            GoalOperation.status.in_(OPEN_OPERATION_STATUSES),
            GoalOperation.next_attempt_at <= now,
            leases.unheld(GoalOperation, now),
        )
        due = s.execute(select(func.count()).where(*due_filter)).scalar_one()
        overdue = s.execute(
            select(func.count()).where(
                *due_filter, GoalOperation.next_attempt_at <= now - timedelta(seconds=OVERDUE_S)
            )
        ).scalar_one()
        oldest = s.execute(
            select(func.min(GoalOperation.next_attempt_at)).where(*due_filter)
        ).scalar_one()
        in_flight = s.execute(
            select(func.count()).where(
                GoalOperation.status.in_(OPEN_OPERATION_STATUSES),
                GoalOperation.lease_expires_at > now,
            )
        ).scalar_one()
        runs = dict(
            s.execute(
                select(MaintenanceRun.status, func.count()).group_by(MaintenanceRun.status)
            ).all()
        )
        held = s.execute(
            select(
                func.count(
                    func.distinct(MaintenanceRun.workspace_id + "/" + MaintenanceRun.session_id)
                )
            ).where(MaintenanceRun.status.in_(LIVE_MAINTENANCE_STATUSES))
        ).scalar_one()
        fences = dict(
            s.execute(select(GoalFence.status, func.count()).group_by(GoalFence.status)).all()
        )
        cancels = dict(
            s.execute(
                select(CancelOperation.status, func.count()).group_by(CancelOperation.status)
            ).all()
        )
        prompts = dict(s.execute(select(Prompt.status, func.count()).group_by(Prompt.status)).all())
        queued_prompts = prompts.get(PromptStatus.QUEUED, 0)
        # Background rows that ran out of budget (budgets.py), by kind.
        exhausted = {
            kind: s.execute(
                select(func.count()).where(
                    table.status == "failed",  # the status index narrows the scan
                    table.last_error.like(f"{budgets.BUDGET_EXHAUSTED}%"),
                )
            ).scalar_one()
            for kind, table in (
                ("fences", GoalFence),
                ("cancels", CancelOperation),
                ("prompts", Prompt),
            )
        }
        return {
            "goal_operations": per_status,
            "maintenance_runs": runs,
            "fences": fences,
            "cancels": cancels,
            "held_sessions": held,
            "sessions_in_recovery": runs.get(MaintenanceStatus.RECOVERY_REQUIRED, 0),
            "queued_prompts": queued_prompts,
            "prompts": prompts,
            "budget_exhausted": exhausted,
            "due": due,
            "overdue": overdue,
            "in_flight": in_flight,
            # How far behind the workers and the sweeper are: the age of the oldest
            # due operation nobody is working on (0 when nothing waits).
            "sweeper_lag_s": round((now - oldest).total_seconds(), 3) if oldest else 0.0,
        }

    return run_transaction(engine, read)


def render_status(status: dict) -> str:
    per_status = ", ".join(f"{k} {v}" for k, v in sorted(status["goal_operations"].items()))
    runs = ", ".join(f"{k} {v}" for k, v in sorted(status["maintenance_runs"].items()))
    fences = ", ".join(f"{k} {v}" for k, v in sorted(status["fences"].items()))
    cancels = ", ".join(f"{k} {v}" for k, v in sorted(status["cancels"].items()))
    prompts = ", ".join(f"{k} {v}" for k, v in sorted(status["prompts"].items()))
    exhausted = ", ".join(f"{k} {v}" for k, v in status["budget_exhausted"].items())
    return (
        f"goal operations: {per_status or 'none'}\n"
        f"fences: {fences or 'none'}; turn cancels: {cancels or 'none'}\n"
        f"maintenance runs: {runs or 'none'}; held sessions: {status['held_sessions']}, "
        f"in recovery: {status['sessions_in_recovery']}; "
        f"queued prompts: {status['queued_prompts']}\n"
        f"prompts: {prompts or 'none'}; out of budget: {exhausted}\n"
        f"due now: {status['due']} (overdue {status['overdue']}), "
        f"in flight: {status['in_flight']}\n"
        f"sweeper lag: {status['sweeper_lag_s']} s"
    )

"""The sweeper's part of maintenance runs (docs/lifecycles.md: maintenance): the timeouts, the
recovery barrier, and runs whose execute message was lost."""

from datetime import datetime, timedelta

from sqlalchemy import or_, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from ...models.db import run_transaction
from ...models.operations import MaintenanceRun
from .. import leases
from ..kinds.maintenance import EXECUTE_TASK, MaintenanceError, MaintenanceStatus
from ..maintenance import runs
from ..task_names import Publish

S = MaintenanceStatus


def sweep_maintenance(
    engine: Engine,
    publish: Publish,
    now: datetime,
    *,
    cancel_grace_s: float,
    outbox_grace_s: float,
    republish_interval_s: float,
    limit: int,
) -> dict[str, int]:
    """Runs never claimed are re-published; a lost heartbeat is `worker_lost`; a cancel
    past its grace is `cancel_timeout` (the session stays held); runs in recovery with no
    live worker are re-published so the executor asks the runtime for the outcome. A run
    waiting behind a busy maintenance queue is re-published once per interval, not on every
    sweep."""
    counts = {"recovery": 0, "republished": 0}

    def mark(s: Session) -> int:
        n = 0
        for run in s.execute(
            select(MaintenanceRun)
            .where(
                MaintenanceRun.status.in_((S.RUNNING, S.CANCELLING, S.FINALIZING)),
                MaintenanceRun.lease_expires_at <= now,
            )
            .limit(limit)
        ).scalars():
            n += runs.transition(
                s, run, S.RECOVERY_REQUIRED, now, error_code=MaintenanceError.WORKER_LOST
            )
        grace_cutoff = now - timedelta(seconds=cancel_grace_s)
        for run in s.execute(
            select(MaintenanceRun)
            .where(
                MaintenanceRun.status.in_((S.RUNNING, S.CANCELLING)),
                MaintenanceRun.cancel_requested_at <= grace_cutoff,
            )
            .limit(limit)
        ).scalars():
            n += runs.transition(
                s, run, S.RECOVERY_REQUIRED, now, error_code=MaintenanceError.CANCEL_TIMEOUT
            )
        return n

    counts["recovery"] = run_transaction(engine, mark)
    started_cutoff = now - timedelta(seconds=outbox_grace_s)

    def reserve(s: Session) -> list[tuple[str, ...]]:
        due = s.execute(
            select(MaintenanceRun.run_id)
            .where(
                or_(
                    MaintenanceRun.status == S.RECOVERY_REQUIRED,
                    (MaintenanceRun.status == S.RUNNING)
                    & (MaintenanceRun.started_at <= started_cutoff),
                ),
                leases.unheld(MaintenanceRun, now),
            )
            .limit(limit)
        ).scalars()
        return leases.reserve_republish(
            s, "maintenance", [(run_id,) for run_id in due], republish_interval_s, now
        )

    for (run_id,) in run_transaction(engine, reserve):
        publish(EXECUTE_TASK, {"run_id": run_id})
        counts["republished"] += 1
    return counts

"""`agent_radar.sweep`: the task beat schedules, a thin wrapper over `beat.sweeper.sweep_once`.
It lives here, with the other tasks, so that `tasks/` imports `beat/` and never the reverse."""

from beat.schedule import SWEEP_TASK
from beat.sweeper import sweep_once
from models.base import utcnow
from tasks.strict import strict_task
from tasks.worker_id import worker_name

# The sweeper lease outlives a slow sweep; a sweeper that died frees it after this long.
SWEEPER_LEASE_MIN_S = 30


@strict_task(SWEEP_TASK)
def sweep(ctx):
    lease_s = max(ctx.settings.sweep_interval_s * 10, SWEEPER_LEASE_MIN_S)
    counts = sweep_once(
        ctx.engine,
        ctx.publisher.publish_after_commit,
        utcnow(),
        owner=worker_name(),
        lease_s=lease_s,
        cancel_grace_s=ctx.settings.maintenance_cancel_grace_s,
    )
    return counts.as_dict()

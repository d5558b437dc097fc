"""`agent_radar.sweep`: the task beat schedules, a thin wrapper over `beat.sweeper.sweep_once`.
It lives here, with the other tasks, so that `tasks/` imports `beat/` and never the reverse."""

from ..beat.sweeper import sweep_once
from ..models.base import utcnow
from ..workflows.client.operators import MAX_PRUNE_BATCHES
from ..workflows.task_names import PRUNE_TASK, SWEEP_TASK
from .strict import NONE, strict_task
from .worker_id import worker_name

# The sweeper lease outlives a slow sweep; a sweeper that died frees it after this long.
SWEEPER_LEASE_MIN_S = 30


@strict_task(SWEEP_TASK, events=NONE)
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


@strict_task(PRUNE_TASK, events=NONE)
def prune(ctx):
    """Retention (docs/operations.md): bounded batches until nothing old is left or the run's
    time is spent; the next run goes on."""
    return ctx.client.prune(max_batches=MAX_PRUNE_BATCHES, budget_s=PRUNE_BUDGET_S)


# A run goes on while there is something to delete, for up to a fifth of the interval between
# runs (beat/schedule.py): what a fleet writes in ten minutes is deleted in two
# (docs/scaling.md has the rate this keeps up with).
PRUNE_BUDGET_S = 120.0

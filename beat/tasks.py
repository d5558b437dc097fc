"""`agent_radar.sweep`: the beat task that wraps `sweep_once`."""

from beat.schedule import SWEEP_TASK
from beat.sweeper import sweep_once
from models.base import utcnow
from tasks import runtime_context as ctx
from tasks.app import worker_name
from tasks.strict import strict_task


@strict_task(SWEEP_TASK)
def sweep():
    counts = sweep_once(ctx.engine(), ctx.publisher().publish_after_commit, utcnow(),
                        owner=worker_name(), lease_s=max(ctx.settings().sweep_interval_s * 10, 30))
    return counts.as_dict()

"""The beat schedule: the sweeper every `sweep_interval_s`, retention every 10 minutes."""

from ..workflows.adapters.config import Settings
from ..workflows.task_names import PRUNE_TASK, SWEEP_TASK

# Retention runs in bounded batches this often (docs/operations.md).
PRUNE_INTERVAL_S = 600.0


def beat_schedule(settings: Settings) -> dict:
    interval_s = settings.sweep_interval_s
    return {
        "agent-radar-sweep": {
            "task": SWEEP_TASK,
            "schedule": interval_s,
            # A sweep queued while workers were down is worthless once the next is due;
            # expiring them keeps a backlog of sweeps from forming.
            "options": {"expires": max(interval_s * 5, 10.0)},
        },
        "agent-radar-prune": {
            "task": PRUNE_TASK,
            "schedule": PRUNE_INTERVAL_S,
            "options": {"expires": PRUNE_INTERVAL_S},
        },
    }

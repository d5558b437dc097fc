"""The beat schedule: one entry, the sweeper, every `sweep_interval_s`."""

from workflows.adapters.config import Settings

SWEEP_TASK = "agent_radar.sweep"


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
    }

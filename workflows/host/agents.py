"""Pieces for trying a host on the kit (host/agent_host.py): an agent whose turns and runs
are timers, and a reporter that publishes reports as the workers' own producers do."""

import threading
from collections.abc import Callable
from typing import Any

from ..adapters.config import Settings
from ..adapters.publisher import TaskPublisher
from ..task_names import REPORT_ACTIVITY_TASK
from .agent_host import AgentHost, Reporter
from .sessions import HostSession, Run, Turn


class TimerAgent:
    """An agent whose turns run `turn_s` and whose runs take `run_s`: for trying a host."""

    def __init__(self, turn_s: float = 0.3, run_s: float = 0.3) -> None:
        self.turn_s, self.run_s = turn_s, run_s

    def start_turn(self, host: AgentHost, session: HostSession, turn: Turn) -> None:
        ws, sid = session.workspace_id, session.session_id
        _later(self.turn_s, host.settle, ws, sid, turn.turn_id, "completed")

    def cancel_turn(self, host: AgentHost, session: HostSession, turn: Turn) -> bool:
        return host.settle(session.workspace_id, session.session_id, turn.turn_id, "canceled")

    def start_run(self, host: AgentHost, session: HostSession, run: Run) -> None:
        ws, sid = session.workspace_id, session.session_id
        done = {"applied": True, "input_tokens": 12000, "result_tokens": 800}
        _later(self.run_s, host.finish, ws, sid, run.run_id, summary="compacted", **done)

    def cancel_run(self, host: AgentHost, session: HostSession, run: Run) -> None:
        host.finish(session.workspace_id, session.session_id, run.run_id, cancelled=True)


def broker_reporter(settings: Settings | None = None) -> Reporter:
    """Reports published as `agent_radar.report_activity` tasks the way the workers' own
    producers publish (their queue, key prefix and confirms), to the broker of `settings`
    (by default the environment's, AGENT_RADAR_BROKER_URL, as the workers read it)."""
    publisher = TaskPublisher(settings or Settings.from_env())

    def publish(report: dict[str, Any]) -> None:
        publisher.publish(REPORT_ACTIVITY_TASK, {"report": report})

    return publish


def _later(delay_s: float, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    timer = threading.Timer(delay_s, fn, args, kwargs)
    timer.daemon = True
    timer.start()

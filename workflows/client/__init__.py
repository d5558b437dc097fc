"""The Python client: `from agent_radar import AgentRadar` (docs/packaging.md)."""

import time
from collections.abc import Callable
from typing import Any

from ..errors import InvalidArgument
from ..records import Fence, GoalOperation, MaintenanceRun, Prompt
from ..records import SessionStop as SessionStopRecord
from ..validation import MAX_WAIT_S, check_seconds
from .base import WAIT_POLL_S
from .goals import GoalCalls
from .operators import OperatorCalls


class AgentRadar(GoalCalls, OperatorCalls):
    """Submits operations and reads their records; the database is the source of truth."""

    def wait(self, record: Any, timeout: float = 30.0) -> Any:
        """Poll until the record reaches a terminal status; TimeoutError after `timeout`
        seconds (0 to MAX_WAIT_S) otherwise."""
        timeout = check_seconds("timeout", timeout, maximum=MAX_WAIT_S)
        reload: Callable[[], Any]
        if isinstance(record, GoalOperation):
            reload, name = (
                lambda: self.get_goal_operation(record.operation_id),
                f"goal operation {record.operation_id}",
            )
        elif isinstance(record, Fence):
            reload, name = lambda: self.get_fence(record.fence_id), f"fence {record.fence_id}"
        elif isinstance(record, MaintenanceRun):
            reload, name = (
                lambda: self.get_maintenance(record.run_id),
                f"maintenance run {record.run_id}",
            )
        elif isinstance(record, Prompt):
            # A prompt settles when its turn has ended (completed), or it could not be sent.
            reload, name = lambda: self.get_prompt(record.prompt_id), f"prompt {record.prompt_id}"
        elif isinstance(record, SessionStopRecord):
            reload, name = (
                lambda: self.get_session_stop(record.stop_id),
                f"session stop {record.stop_id}",
            )
        else:
            raise InvalidArgument(f"cannot wait on {type(record).__name__}")
        deadline = time.monotonic() + timeout
        while True:
            current = reload()
            if current.settled:
                return current
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{name} is still {current.status} after {timeout} s")
            time.sleep(WAIT_POLL_S)


__all__ = ["AgentRadar"]

"""The Python client: `from agent_radar import AgentRadar` (docs/packaging.md)."""

import time
from typing import Any

from ..errors import InvalidArgument, WaitTimedOut
from ..kinds import kind_of_record
from ..validation import MAX_WAIT_S, check_seconds
from .base import WAIT_POLL_S
from .goals import GoalCalls
from .operators import OperatorCalls


class AgentRadar(GoalCalls, OperatorCalls):
    """Submits operations and reads their records; the database is the source of truth."""

    def wait(self, record: Any, timeout: float = 30.0) -> Any:
        """Poll until the record, of any kind (workflows/kinds/), reaches a terminal status;
        WaitTimedOut (a TimeoutError) after `timeout` seconds (0 to MAX_WAIT_S) otherwise. A
        prompt settles when its turn has ended (completed), or it could not be sent."""
        timeout = check_seconds("timeout", timeout, maximum=MAX_WAIT_S)
        kind = kind_of_record(record)
        if kind is None:
            raise InvalidArgument(f"cannot wait on {type(record).__name__}")
        name = f"{kind.noun} {kind.id_of(record)}"
        deadline = time.monotonic() + timeout
        while True:
            current = self._load(kind.name, kind.id_of(record))  # NotFound once pruned
            if current.settled:
                return current
            if time.monotonic() >= deadline:
                raise WaitTimedOut(
                    f"{name} is still {current.status} after {timeout} s",
                    status=current.status,
                )
            time.sleep(WAIT_POLL_S)


__all__ = ["AgentRadar"]

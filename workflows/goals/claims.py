"""What a goal dispatch holds while its calls are in flight: a session lane, a claimed
operation, the runtime's answer to it, and what became of it (docs/dispatch.md)."""

import dataclasses
from dataclasses import dataclass
from typing import Any

from .. import ids
from ..kinds.goal import GoalOperation as GoalOperationRecord


@dataclass
class StepResult:
    operation_id: str
    # applied, accepted, superseded, held, retry, failed, skipped, lane_lost; in_flight (a
    # call handed to the worker's drain)
    outcome: str


@dataclass(frozen=True)
class Claim:
    op: GoalOperationRecord
    token: str
    reinstall: bool = False  # the session's fences go back to its host first
    # its host: (host_id, url, token)
    host: tuple[str, str | None, str | None] = ("default", None, None)
    # The claim-lookup row as it was before the claim (what a give-back restores).
    before: Any = dataclasses.field(default=None, compare=False, repr=False)
    # The ids of the task that claimed it, for the lines logged about it in other threads.
    log_context: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Lane:
    workspace_id: str
    session_id: str
    token: str

    @property
    def name(self) -> str:
        return ids.lane_name(self.workspace_id, self.session_id)


@dataclass(frozen=True)
class Attempt:
    """What the runtime said to one claimed operation: an answer, or a fault."""

    claim: Claim
    answer: dict[str, Any] | None = None
    fault: Exception | None = None
    retryable: bool = False

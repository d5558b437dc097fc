"""The prompt kind (docs/lifecycles.md: prompts): its statuses, record, task names and
declaration. Its rules are `prompts/queue.py`, its step `steps/prompt_dispatch.py`."""

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from ...models.operations import Prompt as PromptRow
from .base import Kind, settled_before

SUBMIT_PROMPT_TASK = "agent_radar.submit_prompt"  # public


class PromptStatus(StrEnum):
    QUEUED = "queued"
    DISPATCHED = "dispatched"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"  # its turn ended canceled (a session stop, or at its host)


SETTLED = (PromptStatus.COMPLETED, PromptStatus.FAILED, PromptStatus.CANCELLED)


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    workspace_id: str
    session_id: str
    client_submit_id: str
    text: str
    status: str
    position: int
    turn_id: str | None
    created_at: datetime
    dispatched_at: datetime | None
    attempt: int = 0  # failed sends (budgets.py); an offline session's wait uses none
    last_error: str | None = None

    @property
    def settled(self) -> bool:
        return self.status in SETTLED


KIND = Kind(
    "prompt",
    "prompt",
    PromptRow,
    PromptRow.prompt_id,
    PromptRow.created_at,
    PromptRow.last_error,
    Prompt,
    tuple(PromptStatus),
    settled=SETTLED,
    prunable=settled_before(PromptRow, SETTLED),
    public_tasks=(SUBMIT_PROMPT_TASK,),
)

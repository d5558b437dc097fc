"""Enumerations the session tables store (docs/lifecycles.md), as plain string enums stored as
text; an operation kind's statuses are in its module (workflows/kinds/)."""

from enum import StrEnum


class Admission(StrEnum):
    OPEN = "open"
    DRAINING = "draining"


class SyncStatus(StrEnum):
    PENDING = "pending"
    APPLYING = "applying"
    SYNCED = "synced"
    DIVERGED = "diverged"
    UNKNOWN = "unknown"
    FAILED = "failed"


class TurnPhase(StrEnum):
    SUBMITTED = "submitted"
    RUNNING = "running"
    SETTLED = "settled"


# Turn phases only move forward (docs/lifecycles.md: turns).
TURN_PHASE_ORDER = {TurnPhase.SUBMITTED: 0, TurnPhase.RUNNING: 1, TurnPhase.SETTLED: 2}


class TurnOutcome(StrEnum):
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELED = "canceled"
    INTERRUPTED = "interrupted"


class TurnOrigin(StrEnum):
    USER_PROMPT = "user_prompt"
    GOAL_CONTINUATION = "goal_continuation"
    PROVIDER_INITIATED = "provider_initiated"

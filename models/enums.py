"""Enumerations of DESIGN section 3, as plain string enums stored as text."""

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


class OperationStatus(StrEnum):
    PREPARED = "prepared"
    DISPATCHED = "dispatched"
    COMPLETED = "completed"
    FAILED = "failed"
    SUPERSEDED = "superseded"


OPEN_OPERATION_STATUSES = (OperationStatus.PREPARED, OperationStatus.DISPATCHED)
TERMINAL_OPERATION_STATUSES = (
    OperationStatus.COMPLETED,
    OperationStatus.FAILED,
    OperationStatus.SUPERSEDED,
)


class ProviderPhase(StrEnum):
    PREPARED = "prepared"
    DISPATCHED = "dispatched"
    ACCEPTED = "accepted"
    APPLIED = "applied"
    UNKNOWN = "unknown"


class Origin(StrEnum):
    CLIENT = "client"
    FENCE = "fence"


class GoalAction(StrEnum):
    SET = "set"
    CLEAR = "clear"
    PAUSE = "pause"
    RESUME = "resume"

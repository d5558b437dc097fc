"""The claim rule (docs/lifecycles.md: goals): whether a goal operation may be attempted now, and if
not, why. Its one source of truth: the dispatcher reads the rows under the session lock, judges them
here, and its claim statement only guards against a lease taken meanwhile."""

from datetime import datetime

from ..kinds.goal import OPEN_OPERATION_STATUSES, ProviderPhase
from .operations import budget_exhausted


def obstacle(row, operation_id: str, now: datetime) -> str | None:
    """Why an operation (its claim-lookup row) cannot be attempted now; None if it can.
    "gone" (settled or unknown), "leased" (another worker is on it), "superseded",
    "held" (a maintenance run holds the session), "failed" (its budget is spent: see
    budget_exhausted) or "accepted" (acknowledged, waiting for its applied report)."""
    if row is None or row.status not in OPEN_OPERATION_STATUSES:
        return "gone"
    if row.lease_expires_at is not None and row.lease_expires_at > now:
        return "leased"
    if row.state_revision != row.goal_revision or row.state_pending != operation_id:
        return "superseded"
    if row.held:
        return "held"
    if budget_exhausted(row, now):
        return "failed"
    if row.provider_phase == ProviderPhase.ACCEPTED:
        return "accepted"
    return None

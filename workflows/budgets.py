"""Budgets of background work (docs/lifecycles.md: fences: every background kind has one, attempts
and age as in 4.2): nothing is retried forever. Past its budget a row ends `failed` with the stable
error code BUDGET_EXHAUSTED, which `status` counts.

Only failed attempts use budget. A wait — the session offline, a fenced turn still running —
uses none: it gives its attempt back and clears `failing_since`, the start of the current
run of failures that the age budget measures.
"""

from datetime import datetime, timedelta

MAX_ATTEMPTS = 24
MAX_FAILING_S = 600
BUDGET_EXHAUSTED = "budget_exhausted"
# Backoff after a retryable failure: 1, 2, 4 … seconds, capped.
BACKOFF_CAP_S = 256


def backoff_s(attempt: int) -> float:
    """The wait before the attempt after `attempt` (counting from 1)."""
    return float(min(2 ** max(attempt - 1, 0), BACKOFF_CAP_S))


def spent(attempt: int, failing_since: datetime | None, now: datetime) -> str | None:
    """Why a row with `attempt` attempts made, failing since `failing_since`, may not be
    tried again at `now`; None while it may."""
    if attempt >= MAX_ATTEMPTS:
        return f"{attempt} attempts"
    if failing_since is not None and now - failing_since >= timedelta(seconds=MAX_FAILING_S):
        return f"failing for {int((now - failing_since).total_seconds())} s"
    return None


def exhausted(why: str, last_error: str | None) -> str:
    """The last_error of a row that ran out of budget."""
    return f"{BUDGET_EXHAUSTED} ({why}): {last_error or 'no answer'}"

"""What a goal operation's claim, call and answer lead to (docs/lifecycles.md: goals): the verdict
on an operation the claim rule holds back, and the record of each attempt's outcome. Each writes in
the caller's transaction and, for an attempt, only under its claim's lease token."""

import logging
from datetime import datetime, timedelta
from typing import Any, TypeGuard, cast

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from ...models.db import rowcount
from ...models.dialects import dialect_of
from ...models.enums import SyncStatus
from ...models.operations import GoalOperation
from ...models.tables import GoalState
from .. import budgets, leases, records
from ..adapters import logs
from ..adapters.runtime import STALE_REVISION
from ..errors import RuntimeFault
from ..kinds.goal import OPEN_OPERATION_STATUSES, OperationStatus, ProviderPhase
from ..kinds.goal import GoalOperation as GoalOperationRecord
from ..sessions.rows import lock_session
from .claims import Attempt, Claim, Lane, StepResult
from .lifecycle import GOAL
from .operations import (
    ACCEPTED_BUDGET_S,
    budget_exhausted,
    complete_applied,
    complete_applied_many,
    fail_operation,
    sync_of,
)
from .statements import RESCHEDULE
from .submit import supersede

log = logging.getLogger(__name__)

# A held operation is looked at again after this long even if no release woke it (the
# release is a publish after commit; this bounds the wait if that publish was lost).
HOLD_RECHECK_S = 30


def verdict(session: Session, row, operation_id: str, obstacle: str, now: datetime) -> StepResult:
    """What an operation's obstacle (see claim_rule.obstacle) means, with what that implies
    written."""
    if obstacle == "superseded":
        supersede(session, operation_id, now)
        return StepResult(operation_id, "superseded")
    conn = session.connection()
    if obstacle == "held":
        # Parked behind a maintenance run: no attempt, no budget used. The run's
        # release makes it due again; until then the sweeper leaves it alone.
        conn.execute(
            RESCHEDULE, {"b_op": operation_id, "b_at": now + timedelta(seconds=HOLD_RECHECK_S)}
        )
        return StepResult(operation_id, "held")
    if obstacle == "accepted":
        # Acknowledged; the applied report completes it. Wake again at the deadline.
        conn.execute(
            RESCHEDULE,
            {
                "b_op": operation_id,
                "b_at": row.accepted_at + timedelta(seconds=ACCEPTED_BUDGET_S),
            },
        )
        return StepResult(operation_id, "skipped")
    if obstacle == "failed":
        fail_operation(session, row, cast(str, budget_exhausted(row, now)), now)
        return StepResult(operation_id, "failed")
    return StepResult(operation_id, "skipped")  # gone, or another worker is on it


def record(
    s: Session,
    attempts: list[Attempt],
    lanes: list[Lane],
    now: datetime,
) -> tuple[list[StepResult], bool]:
    """Record every attempt's outcome in the caller's transaction. Applied answers, the
    common case, are recorded together; any other outcome one by one. Where every
    attempt was applied under one claim, and the lanes were taken together (PostgreSQL),
    the lanes are released in the record's statement: the results, and whether they
    were."""
    applied: list[Attempt] = []
    others: list[Attempt] = []
    for a in attempts:
        is_applied = a.answer is not None and a.answer.get("phase") == "applied"
        (applied if is_applied else others).append(a)
    tokens = {a.claim.token for a in applied}
    lane_tokens = {lane.token for lane in lanes}
    release = None
    if dialect_of(s).writes_together and not others and len(tokens) == 1 == len(lane_tokens):
        release = ([lane.name for lane in lanes], lane_tokens.pop())
    results = []
    for token in tokens:
        mine = [a for a in applied if a.claim.token == token]
        done = complete_applied_many(
            s,
            [
                (a.claim.op, (a.answer or {}).get("goal"), (a.answer or {}).get("evidence"))
                for a in mine
            ],
            now,
            token,
            release=release,
        )
        results += [
            StepResult(
                a.claim.op.operation_id,
                "applied" if a.claim.op.operation_id in done else "skipped",
            )
            for a in mine
        ]
    for a in others:
        with logs.task_context(**a.claim.log_context):
            if a.fault is not None:
                results.append(fault_outcome(s, a.claim, a.fault, a.retryable, now))
            else:
                results.append(answer_outcome(s, a.claim, a.answer or {}, now))
    return results, release is not None


def answer_outcome(s: Session, claim: Claim, answer: dict[str, Any], now: datetime) -> StepResult:
    op, token = claim.op, claim.token
    phase = answer.get("phase")
    if phase == "applied":
        ok = complete_applied(s, op, answer.get("goal"), answer.get("evidence"), now, token=token)
        return StepResult(op.operation_id, "applied" if ok else "skipped")
    if phase == "accepted":
        lock_session(s, op.workspace_id, op.session_id)
        result = s.execute(
            update(GoalOperation)
            .where(
                GoalOperation.operation_id == op.operation_id,
                GoalOperation.status == OperationStatus.DISPATCHED,
                GoalOperation.lease_token == token,
            )
            .values(
                provider_phase=ProviderPhase.ACCEPTED,
                accepted_at=now,
                evidence=answer.get("evidence"),
                next_attempt_at=now + timedelta(seconds=ACCEPTED_BUDGET_S),
                lease_owner=None,
                lease_token=None,
                lease_expires_at=None,
            )
        )
        return StepResult(op.operation_id, "accepted" if rowcount(result) == 1 else "skipped")
    fault = RuntimeFault(
        f"runtime answered an unknown phase {phase!r}",
        code="bad_response",
        retryable=False,
        http_status=200,
    )
    return fault_outcome(s, claim, fault, False, now)


def fault_outcome(
    s: Session, claim: Claim, exc: Exception, retryable: bool, now: datetime
) -> StepResult:
    op, token = claim.op, claim.token
    error = str(exc)
    held = (
        GoalOperation.operation_id == op.operation_id,
        GoalOperation.lease_token == token,
        GoalOperation.status == OperationStatus.DISPATCHED,
    )
    if getattr(exc, "code", None) == STALE_REVISION:
        lock_session(s, op.workspace_id, op.session_id)
        superseded = GOAL.move(
            s,
            op.operation_id,
            OperationStatus.SUPERSEDED,
            *held,
            last_error=error,
            completed_at=now,
            **leases.RELEASED,
        )
        if not superseded:
            return StepResult(op.operation_id, "skipped")
        s.execute(
            update(GoalState)
            .where(
                GoalState.workspace_id == op.workspace_id,
                GoalState.session_id == op.session_id,
                GoalState.pending_operation_id == op.operation_id,
            )
            .values(pending_operation_id=None, last_error=error, sync_status=SyncStatus.DIVERGED)
        )
        return StepResult(op.operation_id, "superseded")
    ids = {
        "workspace_id": op.workspace_id,
        "session_id": op.session_id,
        "operation_id": op.operation_id,
        "attempt": op.attempt,
    }
    if not retryable:
        ok = fail_operation(s, op, error, now, token)
        return StepResult(op.operation_id, "failed" if ok else "skipped")
    log.warning(
        "goal operation %s: attempt %d failed, retrying in %.0f s: %s",
        op.operation_id,
        op.attempt,
        budgets.backoff_s(op.attempt),
        error,
        extra=ids,
    )
    result = s.execute(
        update(GoalOperation)
        .where(*held)
        .values(
            last_error=error,
            next_attempt_at=now + timedelta(seconds=budgets.backoff_s(op.attempt)),
            lease_owner=None,
            lease_token=None,
            lease_expires_at=None,
        )
    )
    return StepResult(op.operation_id, "retry" if rowcount(result) == 1 else "skipped")


def _still_unknown(state: GoalState | None) -> TypeGuard[GoalState]:
    return (
        state is not None
        and state.sync_status == SyncStatus.UNKNOWN
        and state.pending_operation_id is None
        and state.revision > 0
    )


def unknown_current_goal(
    session: Session, workspace_id: str, session_id: str
) -> GoalOperationRecord | None:
    """The completed operation of the session's current goal revision, when the host's goal is
    not known (a move: the new host never received it; a clear settled offline)."""
    state = session.get(GoalState, (workspace_id, session_id), populate_existing=True)
    if not _still_unknown(state):
        return None
    op = session.execute(
        select(GoalOperation).where(
            GoalOperation.workspace_id == workspace_id,
            GoalOperation.session_id == session_id,
            GoalOperation.goal_revision == state.revision,
            GoalOperation.status == OperationStatus.COMPLETED,
        )
    ).scalar_one_or_none()
    return None if op is None else records.from_row(GoalOperationRecord, op)


def observe_delivered(session: Session, op: GoalOperationRecord, goal: Any) -> None:
    """The host applied the current goal delivered again (unknown_current_goal): what it
    answered is what the goal state observes, unless something newer came meanwhile."""
    state = session.get(GoalState, (op.workspace_id, op.session_id), populate_existing=True)
    if _still_unknown(state) and state.revision == op.goal_revision:
        state.observed = goal
        state.sync_status = sync_of(goal, state.desired, f"goal operation {op.operation_id}")


def where_it_stands(session: Session, operation_id: str) -> str:
    """Where an operation a claim passed over stands, for a caller that drives it (a fence's
    clear): "settled", "accepted" (the host has it and has not applied it) or "retry"."""
    op = session.get(GoalOperation, operation_id)
    if op is None or op.status not in OPEN_OPERATION_STATUSES:
        return "settled"
    return "accepted" if op.provider_phase == ProviderPhase.ACCEPTED else "retry"

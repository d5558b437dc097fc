"""What a goal operation may do next (docs/lifecycles.md: goals): when it is due, its budgets and
backoff, and its terminal outcomes (failed; applied, with the goal state synced or diverged)."""

import json
import logging
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import String, bindparam, column, func, literal_column, select, update
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Session

from ...models.db import rowcount
from ...models.dialects import dialect_of
from ...models.enums import SyncStatus
from ...models.operations import GoalOperation
from ...models.tables import GoalState
from .. import budgets, leases
from ..escape import escape
from ..kinds.goal import OPEN_OPERATION_STATUSES, OperationStatus, Origin, ProviderPhase
from ..kinds.goal import GoalOperation as GoalOperationRecord
from ..sessions.rows import SESSIONS, lock_session, same_session
from .lifecycle import GOAL
from .tables import OPS, OPS_IN, RESTORE_DUE, STATES, key_params, sessions_of_ops

# Budgets of docs/lifecycles.md: goals: past these an operation fails instead of retrying forever.
log = logging.getLogger(__name__)
# At most this much of a host's goal is shown in the line that says it diverged.
SHOWN_GOAL_CHARS = 300


def sync_of(goal: Any, desired: Any, where: str) -> SyncStatus:
    """A goal state's sync once its host holds `goal`: synced only if that is exactly the goal
    asked for, `{"objective", "status"}` or null (docs/protocol.md: the goal call). Diverged
    is said in one line (`where`: the operation or session), so a host that answers another
    shape — a key more, too — learns it from the log, not only from `status`."""
    if goal == desired:
        return SyncStatus.SYNCED
    log.warning(
        "%s: the host holds the goal %s where %s was asked for; the goal is diverged "
        "(docs/protocol.md: the goal call)",
        escape(where),
        escape(json.dumps(goal, default=str)[:SHOWN_GOAL_CHARS]),
        escape(json.dumps(desired, default=str)[:SHOWN_GOAL_CHARS]),
    )
    return SyncStatus.DIVERGED


DISPATCH_BUDGET_S = budgets.MAX_FAILING_S  # since the first dispatch
DISPATCH_MAX_ATTEMPTS = budgets.MAX_ATTEMPTS
ACCEPTED_BUDGET_S = 120


# "Open", stated with its values (see models.tables.OPEN_OPERATION_SQL): the partial index of
# open operations serves only a query that states it this way.
OPEN = GoalOperation.status.in_([literal_column(f"'{s.value}'") for s in OPEN_OPERATION_STATUSES])


def open_unheld(now) -> tuple:
    """SQL conditions: the goal operation is open and no live lease holds it. `now` is a
    datetime or a bound parameter."""
    return (OPEN, leases.unheld(GoalOperation, now))


def open_due(now) -> tuple:
    """SQL conditions: the goal operation is open, due, and no live lease holds it."""
    return (*open_unheld(now), GoalOperation.next_attempt_at <= now)


def due_operations(now) -> tuple:
    """SQL conditions of a client goal operation that a worker may attempt now (open_due). A
    fence drives its own clear, so fence-made ones are left out."""
    return (*open_due(now), GoalOperation.origin == Origin.CLIENT)


def open_client_operations(session: Session, workspace_id: str, session_id: str) -> list[str]:
    """The session's open client goal operations, in revision order (the order its lane
    drains them in)."""
    return list(
        session.execute(
            select(GoalOperation.operation_id)
            .where(
                GoalOperation.workspace_id == workspace_id,
                GoalOperation.session_id == session_id,
                GoalOperation.origin == Origin.CLIENT,
                GoalOperation.status.in_(OPEN_OPERATION_STATUSES),
            )
            .order_by(GoalOperation.goal_revision)
        ).scalars()
    )


def due_now(session: Session, operation_ids: list[str], now: datetime) -> list[str]:
    """These operations' next attempt is due now (a release woke them); the same ids."""
    if operation_ids:
        session.execute(
            update(GoalOperation)
            .where(GoalOperation.operation_id.in_(operation_ids))
            .values(next_attempt_at=now)
        )
    return operation_ids


def budget_exhausted(op: GoalOperation, now: datetime) -> str | None:
    """Why an open operation must fail now instead of being dispatched again, if it must:
    its last_error then, under the stable code every kind's spent budget has (budgets.py),
    with the error of its last attempt, so `status` counts it and an operator sees why."""
    why = None
    if op.provider_phase == ProviderPhase.ACCEPTED and op.accepted_at is not None:
        if now - op.accepted_at >= timedelta(seconds=ACCEPTED_BUDGET_S):
            why = f"accepted, no applied report in {ACCEPTED_BUDGET_S} s"
    elif op.first_dispatched_at is not None and (
        now - op.first_dispatched_at >= timedelta(seconds=DISPATCH_BUDGET_S)
    ):
        why = f"dispatching for {DISPATCH_BUDGET_S} s"
    elif op.attempt >= DISPATCH_MAX_ATTEMPTS:
        why = f"{op.attempt} attempts"
    return budgets.exhausted(why, op.last_error) if why else None


def fail_operation(
    session: Session,
    op: GoalOperation | GoalOperationRecord,
    error: str,
    now: datetime,
    token: str | None = None,
) -> bool:
    """Terminal failure: the operation and (if it still owns it) the goal state."""
    lock_session(session, op.workspace_id, op.session_id)
    failed = GOAL.move(
        session,
        op.operation_id,
        OperationStatus.FAILED,
        token=token,
        last_error=error,
        completed_at=now,
        provider_phase=(
            ProviderPhase.UNKNOWN
            if op.provider_phase != ProviderPhase.PREPARED
            else ProviderPhase.PREPARED
        ),
        **leases.RELEASED,
    )
    if not failed:
        return False  # settled already, or another holds it: nothing failed here
    log.warning(
        "goal operation %s failed: %s",
        op.operation_id,
        error,
        extra={
            "workspace_id": op.workspace_id,
            "session_id": op.session_id,
            "operation_id": op.operation_id,
            "attempt": op.attempt,
        },
    )
    session.execute(
        update(GoalState)
        .where(
            GoalState.workspace_id == op.workspace_id,
            GoalState.session_id == op.session_id,
            GoalState.pending_operation_id == op.operation_id,
        )
        .values(sync_status=SyncStatus.FAILED, pending_operation_id=None, last_error=error)
    )
    return True


# Statements for many sessions at once are built once; `b_ops` expands to a list.
_LOCK_STATES = (
    select(
        SESSIONS.c.workspace_id,
        SESSIONS.c.session_id,
        STATES.c.desired,
        STATES.c.pending_operation_id,
        STATES.c.sync_status,
    )
    .select_from(SESSIONS.outerjoin(STATES, same_session(STATES.c, SESSIONS.c)))
    .where(sessions_of_ops(SESSIONS))
    .order_by(SESSIONS.c.workspace_id, SESSIONS.c.session_id)
    .with_for_update(of=SESSIONS)
)
# What a completed operation's row becomes (besides its evidence). Its `last_error` stays:
# the error of its latest failed attempt, if any (`history` and `op show` show it).
_COMPLETED: dict[str, Any] = {
    "status": OperationStatus.COMPLETED,
    "provider_phase": ProviderPhase.APPLIED,
    "completed_at": bindparam("b_now"),
    "lease_owner": None,
    "lease_token": None,
    "lease_expires_at": None,
}
_COMPLETE = (
    update(OPS)
    .where(OPS_IN, OPS.c.status == OperationStatus.DISPATCHED)
    .values(_COMPLETED)
    .returning(OPS.c.operation_id)
)
_COMPLETE_HELD = _COMPLETE.where(OPS.c.lease_token == bindparam("b_token"))
# One operation with its evidence (the common case of a lone dispatch): one statement.
_COMPLETE_WITH_EVIDENCE = _COMPLETE.values(evidence=bindparam("b_evidence"))
_COMPLETE_HELD_WITH_EVIDENCE = _COMPLETE_HELD.values(evidence=bindparam("b_evidence"))
_SET_EVIDENCE = (
    update(OPS)
    .where(OPS.c.operation_id == bindparam("b_op"))
    .values(evidence=bindparam("b_evidence"))
)
_STATE_APPLIED = (
    update(STATES)
    .where(*key_params(STATES), STATES.c.pending_operation_id == bindparam("b_op"))
    .values(
        observed=bindparam("b_goal"),
        sync_status=bindparam("b_sync"),
        pending_operation_id=None,
        last_error=None,
    )
)


# On PostgreSQL, the whole record of a step's applied operations as one statement: each
# completion with its evidence (kept where the answer brought none), and the goal state of
# each one that this statement completed (the state update reads the completion's RETURNING
# rows). The rows come as arrays, so one prebuilt statement serves any batch size.
def _arrays(name: str, *columns):
    return (
        func.unnest(*(bindparam(f"b_{name}_{c.name}", type_=ARRAY(c.type)) for c in columns))
        .table_valued(*columns)
        .render_derived(name=name)
    )


_APPLIED = _arrays("applied", column("op", String), column("evidence", OPS.c.evidence.type))
_SYNCED = _arrays(
    "synced",
    column("ws", String),
    column("sid", String),
    column("op", String),
    column("goal", STATES.c.observed.type),
    column("sync", String),
)


def _record_applied(held: bool):
    completed = (
        update(OPS)
        .where(OPS.c.operation_id == _APPLIED.c.op, OPS.c.status == OperationStatus.DISPATCHED)
        .values({**_COMPLETED, "evidence": func.coalesce(_APPLIED.c.evidence, OPS.c.evidence)})
        .returning(OPS.c.operation_id)
    )
    if held:
        completed = completed.where(OPS.c.lease_token == bindparam("b_token"))
    done = completed.cte("completed")
    synced = (
        update(STATES)
        .where(
            STATES.c.workspace_id == _SYNCED.c.ws,
            STATES.c.session_id == _SYNCED.c.sid,
            STATES.c.pending_operation_id == _SYNCED.c.op,
            _SYNCED.c.op.in_(select(done.c.operation_id)),
        )
        .values(
            observed=_SYNCED.c.goal,
            sync_status=_SYNCED.c.sync,
            pending_operation_id=None,
            last_error=None,
        )
    )
    return select(done.c.operation_id).add_cte(synced.cte("states_synced"))


_RECORD_APPLIED = _record_applied(held=False)
_RECORD_APPLIED_HELD = _record_applied(held=True)
# _RECORD_APPLIED_HELD and the release of the step's lanes (leases.RELEASE_CTE).
_RECORD_APPLIED_HELD_RELEASING = _RECORD_APPLIED_HELD.add_cte(leases.RELEASE_CTE)


def complete_applied_many(
    session: Session,
    applied: list[tuple[Any, dict | None, dict | None]],
    now: datetime,
    token: str | None = None,
    release: tuple[list[str], str] | None = None,
) -> set[str]:
    """Record authoritative evidence that the agent applied each (operation, goal,
    evidence): the sessions are locked (in key order), then a few statements cover them all.
    With `token`, only operations still leased under it. Returns the ids completed.

    `release` (PostgreSQL, with `token`): lease names and their token, released in the
    same statement as the record."""
    conn = session.connection()
    operation_ids = [op.operation_id for op, _goal, _evidence in applied]
    states = {
        (row.workspace_id, row.session_id): row
        for row in conn.execute(_LOCK_STATES, {"b_ops": operation_ids})
    }
    params: dict[str, Any] = {"b_ops": operation_ids, "b_now": now}
    if token is not None:
        params["b_token"] = token
    # What each applied operation's goal state becomes, if it completes; `unknown` (a move while
    # the call was in flight, activity/epochs.py) stays so, for the new host's restore.
    synced: dict[str, dict[str, Any]] = {}
    moved: list[Any] = []
    for op, goal, _proof in applied:
        state = states.get((op.workspace_id, op.session_id))
        if state is not None and state.pending_operation_id == op.operation_id:
            sync = sync_of(goal, state.desired, f"goal operation {op.operation_id}")
            if state.sync_status == SyncStatus.UNKNOWN:
                sync = SyncStatus.UNKNOWN
                moved.append(op)
            synced[op.operation_id] = {
                "b_ws": op.workspace_id,
                "b_sid": op.session_id,
                "b_op": op.operation_id,
                "b_goal": goal,
                "b_sync": sync.value,
            }
    if dialect_of(conn).writes_together:
        params |= {
            "b_applied_op": params["b_ops"],
            "b_applied_evidence": [proof for _op, _goal, proof in applied],
        }
        for name in ("ws", "sid", "op", "goal", "sync"):
            params[f"b_synced_{name}"] = [values[f"b_{name}"] for values in synced.values()]
        statement = _RECORD_APPLIED if token is None else _RECORD_APPLIED_HELD
        if release is not None:
            if token is None:
                raise ValueError("a record that releases is one of held operations")
            statement = _RECORD_APPLIED_HELD_RELEASING
            params |= {"b_release_names": release[0], "b_release_token": release[1]}
        done = set(conn.execute(statement, params).scalars())
        _restore_moved(conn, moved, done, now)
        return done
    if release is not None:
        raise ValueError("a record releases in its own statement only on PostgreSQL")
    lone_proof = applied[0][2] if len(applied) == 1 else None
    if lone_proof is not None:
        statement = _COMPLETE_WITH_EVIDENCE if token is None else _COMPLETE_HELD_WITH_EVIDENCE
        params["b_evidence"] = lone_proof
    else:
        statement = _COMPLETE if token is None else _COMPLETE_HELD
    done = set(conn.execute(statement, params).scalars())
    evidence = [
        {"b_op": op.operation_id, "b_evidence": proof}
        for op, _goal, proof in applied
        if op.operation_id in done and proof is not None and lone_proof is None
    ]
    if evidence:
        conn.execute(_SET_EVIDENCE, evidence)
    states_done = [values for operation_id, values in synced.items() if operation_id in done]
    if states_done:
        conn.execute(_STATE_APPLIED, states_done)
    _restore_moved(conn, moved, done, now)
    return done


def _restore_moved(conn: Any, moved: list[Any], done: set[str], now: datetime) -> None:
    """The restore of each session whose goal a host it left applied (above), due now."""
    keys = {(op.workspace_id, op.session_id) for op in moved if op.operation_id in done}
    if keys:
        conn.execute(RESTORE_DUE, [{"b_ws": ws, "b_sid": sid, "b_now": now} for ws, sid in keys])


def complete_applied(
    session: Session,
    op: Any,
    goal: dict | None,
    evidence: dict | None,
    now: datetime,
    token: str | None = None,
) -> bool:
    """Record authoritative evidence that the agent applied this operation's revision."""
    return op.operation_id in complete_applied_many(session, [(op, goal, evidence)], now, token)


def settle_or_reserve(session: Session, operation_id: str, now: datetime, until: datetime) -> str:
    """The sweeper's look at a due operation: "failed" once its budget ran out, "republish"
    when it is reserved for the sweeper's message until `until` (nobody publishes it again
    meanwhile), else "skip" (settled, or taken meanwhile)."""
    op = session.get(GoalOperation, operation_id, populate_existing=True)
    if op is None or op.status not in OPEN_OPERATION_STATUSES:
        return "skip"
    reason = budget_exhausted(op, now)
    if reason:
        return "failed" if fail_operation(session, op, reason, now) else "skip"
    result = session.execute(
        update(GoalOperation)
        .where(
            GoalOperation.operation_id == operation_id,
            GoalOperation.next_attempt_at == op.next_attempt_at,
            leases.unheld(GoalOperation, now),
        )
        .values(next_attempt_at=until)
    )
    return "republish" if rowcount(result) == 1 else "skip"

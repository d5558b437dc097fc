"""A session's restore (docs/lifecycles.md: fences, sessions): whenever the control plane learns
that a session is live — a report, a liveness answer, ensure_session — every durable fence not known
to be installed at its (host, epoch) is installed, and a clear that was settled locally without
reaching the agent is delivered. A reconnect at the same epoch, a restart, a first epoch learnt
after a fence, a move: each leaves a fence whose record no longer matches.

`agent_radar.session.restore` runs it in the background: it confirms the session is live
with its own host (a liveness call, never a resume; the epoch it answers is the one that
counts), then installs and delivers. The session row's `restore_due_at` is its outbox: set
when a restore is wanted, stamped by the restore that runs, cleared by that restore only if
nobody asked again meanwhile; the sweeper publishes what is due.
"""

import logging
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TypeGuard

from sqlalchemy import select, update
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from ...models.base import utcnow
from ...models.db import rowcount, run_read, run_transaction
from ...models.enums import OperationStatus, ProviderPhase, SyncStatus
from ...models.tables import AgentSession, GoalFence, GoalOperation, GoalState
from .. import budgets, records
from ..activity.reconcile import Reconciled, apply_state
from ..adapters.host_state import HostState
from ..adapters.runtime import SESSION_NOT_FOUND, STALE_REVISION, RuntimePort
from ..errors import RuntimeDisconnected, RuntimeFault
from ..fences.reinstall import needs_restore
from ..sessions import hosts
from ..sessions.rows import lock_session
from ..task_names import (
    CANCEL_APPLY_TASK,
    FENCE_APPLY_TASK,
    PROMPT_TASK,
    Publish,
)
from .fence_install import ensure_fences_installed
from .goals.dispatch import apply_goal
from .wake import release_session

log = logging.getLogger(__name__)

# A restore that met a runtime fault (not a disconnect) is due again after this long, within
# its budget (workflows/budgets.py).
RESTORE_RETRY_S = 10.0
# An offline session with a fence or a clear still to deliver is asked again this often: it may
# come back without a report.
OFFLINE_RECHECK_S = 30.0


def restore_fences(
    engine: Engine,
    runtime: RuntimePort,
    workspace_id: str,
    session_id: str,
    *,
    require_live: bool,
) -> None:
    """Install the fences not known to be at the session's (host, epoch), then deliver the
    clears that were settled locally. The caller knows the session is live: background work
    passes require_live, a user's ensure_session does not. Runtime faults propagate."""
    ensure_fences_installed(engine, runtime, workspace_id, session_id, require_live=require_live)
    for fence_id, clear in run_transaction(
        engine, lambda s: _undelivered_clears(s, workspace_id, session_id)
    ):
        try:
            answer = apply_goal(runtime, clear, require_live=require_live)
        except RuntimeFault as exc:
            if exc.code != STALE_REVISION:
                raise
            # The host holds a newer revision than the clear's: nothing of the fenced one
            # is left there.
            answer = None
        _record_delivery(engine, fence_id, clear, answer)
    deliver_current_goal(engine, runtime, workspace_id, session_id, require_live=require_live)


def deliver_current_goal(
    engine: Engine, runtime: RuntimePort, workspace_id: str, session_id: str, *, require_live: bool
) -> None:
    """A goal not known to be at the session's host (a move: the new host never received it;
    the session was offline when it settled) goes there again, after the fences: the operation
    of the current revision, which the host applies once by its id. Its answer is what the
    goal state observes."""
    op = run_transaction(engine, lambda s: _unknown_current_goal(s, workspace_id, session_id))
    if op is None:
        return
    try:
        answer = apply_goal(runtime, op, require_live=require_live)
    except RuntimeFault as exc:
        if exc.code != STALE_REVISION:
            raise
        return  # the host holds a newer revision: the state answer tells which
    if answer.get("phase") != ProviderPhase.APPLIED:
        return
    goal = answer.get("goal")

    def observe(s: Session) -> None:
        state = s.get(GoalState, (workspace_id, session_id), populate_existing=True)
        if _still_unknown(state) and state.revision == op.goal_revision:
            state.observed = goal
            state.sync_status = SyncStatus.SYNCED if goal == state.desired else SyncStatus.DIVERGED

    run_transaction(engine, observe)


def _still_unknown(state: GoalState | None) -> TypeGuard[GoalState]:
    return (
        state is not None
        and state.sync_status == SyncStatus.UNKNOWN
        and state.pending_operation_id is None
        and state.revision > 0
    )


def _unknown_current_goal(
    session: Session, workspace_id: str, session_id: str
) -> records.GoalOperation | None:
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
    return None if op is None else records.from_row(records.GoalOperation, op)


def _undelivered_clears(
    session: Session, workspace_id: str, session_id: str
) -> list[tuple[str, records.GoalOperation]]:
    rows = session.execute(
        select(GoalFence.fence_id, GoalOperation)
        .join(GoalOperation, GoalOperation.operation_id == GoalFence.clear_operation_id)
        .where(
            GoalFence.workspace_id == workspace_id,
            GoalFence.session_id == session_id,
            GoalFence.clear_undelivered.is_(True),
        )
        .order_by(GoalFence.created_at)
    ).all()
    return [(fence_id, records.from_row(records.GoalOperation, op)) for fence_id, op in rows]


def _record_delivery(
    engine: Engine,
    fence_id: str,
    clear: records.GoalOperation,
    answer: dict | None,
) -> None:
    run_transaction(engine, lambda s: _delivered(s, fence_id, clear, answer))


def _delivered(
    session: Session,
    fence_id: str,
    clear: records.GoalOperation,
    answer: dict | None,
) -> None:
    """The clear reached the agent (or the agent already had something newer): the fence has
    nothing left to deliver. An applied answer is the evidence the local settlement lacked."""
    session.execute(
        update(GoalFence).where(GoalFence.fence_id == fence_id).values(clear_undelivered=False)
    )
    if answer is None or answer.get("phase") != ProviderPhase.APPLIED:
        return
    session.execute(
        update(GoalOperation)
        .where(
            GoalOperation.operation_id == clear.operation_id,
            GoalOperation.provider_phase == ProviderPhase.UNKNOWN,
        )
        .values(provider_phase=ProviderPhase.APPLIED, evidence=answer.get("evidence"))
    )
    goal = answer.get("goal")
    session.execute(
        update(GoalState)
        .where(
            GoalState.workspace_id == clear.workspace_id,
            GoalState.session_id == clear.session_id,
            GoalState.revision == clear.goal_revision,
            GoalState.pending_operation_id.is_(None),
        )
        .values(
            observed=goal,
            sync_status=SyncStatus.SYNCED if goal is None else SyncStatus.DIVERGED,
        )
    )


def reconcile_session(
    engine: Engine,
    runtime: RuntimePort,
    publish: Publish,
    workspace_id: str,
    session_id: str,
    clock: Callable[[], datetime] = utcnow,
) -> tuple[HostState, Reconciled]:
    """Ask the host what it runs for the session and make the mirror agree
    (workflows/activity/reconcile.py); then publish what that set in motion. Runtime faults
    propagate."""
    asked_at = clock()
    # The host is named before the call and asked by name: its answer is applied only while
    # the session is still there (a move in between leaves it unapplied: it tells of a host
    # the session left).
    key = (workspace_id, session_id)
    address = run_read(engine, lambda s: hosts.address_of(s, hosts.session_host(s, *key)))
    state = runtime.on_host(*address).session_state(workspace_id, session_id)
    done = run_transaction(
        engine,
        lambda s: apply_state(
            s, workspace_id, session_id, state, asked_at, clock(), asked_host=address[0]
        ),
    )
    if done.ended or done.recorded:
        log.warning(
            "session %s/%s: its host's answer ended %d turn(s) the mirror held unsettled"
            " and recorded %d it never saw",
            workspace_id,
            session_id,
            len(done.ended),
            len(done.recorded),
        )
    for cancel_id in done.cancels:
        publish(CANCEL_APPLY_TASK, {"operation_id": cancel_id})
    for fence_id in done.woken_fences:
        publish(FENCE_APPLY_TASK, {"fence_id": fence_id})
    if done.epoch.released:
        release_session(engine, publish, workspace_id, session_id, clock())
    elif done.wake_prompts:
        publish(PROMPT_TASK, {"workspace_id": workspace_id, "session_id": session_id})
    return state, done


class Restorer:
    """`agent_radar.session.restore`: confirm the session is live with its host, then
    restore its fences there (never a resume)."""

    def __init__(
        self,
        engine: Engine,
        runtime: RuntimePort,
        *,
        cancels,  # the CancelRunner: its liveness look and its end of a gone session
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.engine, self.runtime, self.cancels, self.clock = engine, runtime, cancels, clock
        self.lease_s = cancels.lease_s

    def restore(self, workspace_id: str, session_id: str) -> str:
        stamp = run_transaction(self.engine, lambda s: self._claim(s, workspace_id, session_id))
        if stamp is None:
            return "skipped"
        error: str | None = None
        try:
            self.cancels.require_live(workspace_id, session_id, restore=False)
            restore_fences(
                self.engine,
                self.runtime,
                workspace_id,
                session_id,
                require_live=True,
            )
            self.reconcile(workspace_id, session_id)
            outcome = "restored"
        except RuntimeDisconnected:
            # Offline: asked again after OFFLINE_RECHECK_S while something waits on it
            # (a session back with no report tells nobody), or at its next report.
            outcome = "offline"
        except RuntimeFault as exc:
            if exc.code == SESSION_NOT_FOUND:
                self.cancels.session_gone(workspace_id, session_id)
                outcome = "gone"
            else:
                error = str(exc.code or exc)
                log.warning("restore of session %s/%s: %s", workspace_id, session_id, error)
                outcome = "retry"
        run_transaction(
            self.engine,
            lambda s: self._finish(s, workspace_id, session_id, stamp, outcome, error),
        )
        return outcome

    def reconcile(self, workspace_id: str, session_id: str) -> Reconciled:
        return reconcile_session(
            self.engine, self.runtime, self.cancels.publish, workspace_id, session_id, self.clock
        )[1]

    def _claim(self, s: Session, workspace_id: str, session_id: str) -> datetime | None:
        """Stamp the due restore as ours (a lease on it: the sweeper leaves it alone until
        it runs out). None when no restore is due."""
        row = s.get(AgentSession, (workspace_id, session_id), populate_existing=True)
        if row is None or row.restore_due_at is None:
            return None
        stamp = self.clock() + timedelta(seconds=2 * self.lease_s)
        done = s.execute(
            update(AgentSession)
            .where(
                AgentSession.workspace_id == workspace_id,
                AgentSession.session_id == session_id,
                AgentSession.restore_due_at == row.restore_due_at,
            )
            .values(restore_due_at=stamp)
        )
        return stamp if rowcount(done) == 1 else None

    def _finish(
        self,
        s: Session,
        workspace_id: str,
        session_id: str,
        stamp: datetime,
        outcome: str,
        error: str | None,
    ) -> None:
        """Clear the due restore, unless someone asked again while this one ran (they set
        it to their now) — or what it was for is still there. A fault uses one attempt of
        the restore's budget (workflows/budgets.py) and is tried again after
        RESTORE_RETRY_S; past the budget it stops, and `status` shows it until the next
        restore someone asks for succeeds. An offline session is a wait."""
        now = self.clock()
        row = lock_session(s, workspace_id, session_id)
        if outcome == "offline":
            row.live = False  # background work settles locally until it is back
        if outcome == "restored" and needs_restore(s, row):
            # Still due: a fence came meanwhile, or the host's epoch moved on while it ran.
            # Again, as an attempt: a host whose epoch moves every time runs out of budget.
            outcome, error = "retry", "still due after a restore (the host's epoch moved on?)"
        if outcome == "retry":
            row.restore_attempt = (row.restore_attempt or 0) + 1
            row.restore_failing_since = row.restore_failing_since or now
            row.restore_error = error
        elif outcome != "offline":
            row.restore_attempt, row.restore_failing_since, row.restore_error = 0, None, None
        if row.restore_due_at != stamp:
            return
        retry_at: datetime | None = None
        if outcome == "retry":
            why = budgets.spent(row.restore_attempt, row.restore_failing_since, now)
            if why is None:
                retry_at = now + timedelta(seconds=RESTORE_RETRY_S)
            else:
                row.restore_error = budgets.exhausted(why, error)
                log.error(
                    "restore of session %s/%s: %s", workspace_id, session_id, row.restore_error
                )
        elif outcome == "offline" and needs_restore(s, row):
            retry_at = now + timedelta(seconds=OFFLINE_RECHECK_S)
        row.restore_due_at = retry_at

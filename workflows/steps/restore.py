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

import functools
import logging
from collections.abc import Callable
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from ...models.base import utcnow
from ...models.db import run_transaction
from ...models.operations import GoalFence, GoalOperation
from .. import ids, leases, records
from ..activity.reconcile import Reconciled, apply_state
from ..adapters.answers import HostState
from ..adapters.runtime import SESSION_NOT_FOUND, STALE_REVISION, RuntimePort
from ..errors import RuntimeDisconnected, RuntimeFault
from ..fences import restores
from ..fences.fencing import clear_delivered
from ..goals import outcomes
from ..kinds.cancel import CANCEL_APPLY_TASK
from ..kinds.fence import FENCE_APPLY_TASK
from ..kinds.goal import GoalOperation as GoalOperationRecord
from ..kinds.goal import ProviderPhase
from ..maintenance import runs
from ..sessions.rows import Heard, heard_in, lock_session
from ..task_names import PROMPT_TASK, Publish
from . import Pinned, pin
from .fence_install import ensure_fences_installed
from .goals.dispatch import apply_goal
from .wake import release_session

log = logging.getLogger(__name__)


def restore_fences(
    engine: Engine,
    runtime: RuntimePort,
    workspace_id: str,
    session_id: str,
    *,
    require_live: bool,
    lease_s: float,
) -> None:
    """Install the fences not known to be at the session's (host, epoch), then deliver the
    clears that were settled locally. The caller knows the session is live: background work
    passes require_live, a user's ensure_session does not. Runtime faults propagate. The
    clears and the goal go to the host named first, and its answers are recorded only while
    the session still lives there (a move meanwhile: the new host's restore delivers them)."""
    ensure_fences_installed(engine, runtime, workspace_id, session_id, require_live=require_live)
    taken = run_transaction(engine, lambda s: _take_delivery(s, workspace_id, session_id, lease_s))
    if taken is None:
        return
    token, clears = taken
    try:
        _deliver(engine, runtime, workspace_id, session_id, clears, require_live)
    finally:
        name = ids.delivery_name(workspace_id, session_id)
        run_transaction(engine, lambda s: leases.release(s, name, token))


def _take_delivery(
    s: Session, workspace_id: str, session_id: str, lease_s: float
) -> tuple[str, list[tuple[str, GoalOperationRecord]]] | None:
    """The delivery's lease and the clears to send, if there is anything to send: a run
    admitted while they are on their way would meet them at the host, and admission waits
    while the lease is held (sessions.rows.may_reach_the_host). None when there is nothing,
    when a run holds the session (its release asks for a restore again:
    fences.restores.request_after_hold), or when another restore is sending (this one is
    asked for again)."""
    row = lock_session(s, workspace_id, session_id)
    if runs.session_held(s, workspace_id, session_id):
        return None
    clears = _undelivered_clears(s, workspace_id, session_id)
    if not clears and outcomes.unknown_current_goal(s, workspace_id, session_id) is None:
        return None
    name, now = ids.delivery_name(workspace_id, session_id), utcnow()
    # Each call is bounded by the runtime's timeout, which a lease outlasts.
    token = leases.claim(s, name, "restore", lease_s * (len(clears) + 1), now)
    if token is None:
        restores.request(row, now)
        return None
    return token, clears


def _deliver(engine, runtime, workspace_id, session_id, clears, require_live: bool) -> None:
    there = pin(engine, runtime, workspace_id, session_id)
    for fence_id, clear in clears:
        try:
            answer = apply_goal(there.port, clear, require_live=require_live)
        except RuntimeFault as exc:
            if exc.code != STALE_REVISION:
                raise
            # The host holds a newer revision than the clear's: nothing of the fenced one
            # is left there.
            answer = None
        delivered = functools.partial(
            clear_delivered, fence_id=fence_id, clear=clear, answer=answer
        )
        run_transaction(engine, there.recorded(delivered))
    deliver_current_goal(engine, there, require_live=require_live)


def deliver_current_goal(engine: Engine, there: Pinned, *, require_live: bool) -> None:
    """A goal not known to be at the session's host (a move: the new host never received it;
    the session was offline when it settled) goes there again, after the fences: the operation
    of the current revision, which the host applies once by its id. Its answer is what the
    goal state observes."""
    ws, sid = there.workspace_id, there.session_id
    op = run_transaction(engine, lambda s: outcomes.unknown_current_goal(s, ws, sid))
    if op is None:
        return
    try:
        answer = apply_goal(there.port, op, require_live=require_live)
    except RuntimeFault as exc:
        if exc.code != STALE_REVISION:
            raise
        return  # the host holds a newer revision: the state answer tells which
    if answer.get("phase") != ProviderPhase.APPLIED:
        return
    goal = answer.get("goal")
    run_transaction(engine, there.recorded(lambda s: outcomes.observe_delivered(s, op, goal)))


def _undelivered_clears(
    session: Session, workspace_id: str, session_id: str
) -> list[tuple[str, GoalOperationRecord]]:
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
    return [(fence_id, records.from_row(GoalOperationRecord, op)) for fence_id, op in rows]


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
    there = pin(engine, runtime, workspace_id, session_id)
    state = there.port.session_state(workspace_id, session_id)
    done = run_transaction(
        engine,
        lambda s: apply_state(
            s, workspace_id, session_id, state, asked_at, clock(), asked_host=there.host_id
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
        until = self.clock() + timedelta(seconds=2 * self.lease_s)
        stamp = run_transaction(
            self.engine, lambda s: restores.claim(s, workspace_id, session_id, until)
        )
        if stamp is None:
            return "skipped"
        error: str | None = None
        offline: Heard | None = None  # the offline answer
        try:
            self.cancels.require_live(workspace_id, session_id, restore=False)
            restore_fences(
                self.engine,
                self.runtime,
                workspace_id,
                session_id,
                require_live=True,
                lease_s=self.lease_s,
            )
            self.reconcile(workspace_id, session_id)
            outcome = "restored"
        except RuntimeDisconnected as exc:
            # Offline: asked again after OFFLINE_RECHECK_S while something waits on it
            # (a session back with no report tells nobody), or at its next report.
            outcome, offline = "offline", heard_in(exc, self.clock())
        except RuntimeFault as exc:
            if exc.code == SESSION_NOT_FOUND:
                self.cancels.session_gone(workspace_id, session_id, heard_in(exc, self.clock()))
                outcome = "gone"
            else:
                error = str(exc.code or exc)
                log.warning("restore of session %s/%s: %s", workspace_id, session_id, error)
                outcome = "retry"
        run_transaction(
            self.engine,
            lambda s: restores.finish(
                s, workspace_id, session_id, stamp, outcome, error, self.clock(), offline
            ),
        )
        return outcome

    def reconcile(self, workspace_id: str, session_id: str) -> Reconciled:
        return reconcile_session(
            self.engine, self.runtime, self.cancels.publish, workspace_id, session_id, self.clock
        )[1]

"""Applying goal generation fences (DESIGN 4.3 apply) and running turn cancels (4.5).

Background work: neither ever resumes a session. A session known to be offline is settled
locally: the fence is installed nowhere yet and its clear is marked undelivered, so the
session's next return — a resume, a reconnect, a restart, a move — installs the one and
delivers the other (workflows/fences/restore.py).
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import func, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from models.base import utcnow
from models.db import rowcount, run_transaction
from models.enums import (
    OPEN_OPERATION_STATUSES,
    CancelResult,
    CancelStatus,
    FenceStatus,
    OperationStatus,
    ProviderPhase,
    SyncStatus,
    TurnPhase,
)
from models.tables import AgentSession, CancelOperation, GoalFence, GoalOperation, GoalState, Turn
from workflows import budgets, ids, leases
from workflows.adapters.runtime import NOT_FOUND, SESSION_NOT_FOUND, RuntimePort
from workflows.errors import RuntimeDisconnected, RuntimeFault
from workflows.fences import cancels
from workflows.fences.reinstall import ensure_fences_installed, needs_restore, request_restore
from workflows.goals.claims import Claim
from workflows.goals.dispatch import Dispatcher, apply_goal
from workflows.goals.operations import backoff_s, fail_operation
from workflows.sessions.epochs import EpochEffects, observe_epoch
from workflows.sessions.release import publish_epoch_effects
from workflows.sessions.rows import lock_session
from workflows.task_names import FENCE_APPLY_TASK, PROMPT_TASK, RESTORE_TASK

log = logging.getLogger(__name__)

WAITING_FOR_TURN = "waiting for the fenced turn to settle"

Publish = Callable[[str, dict], bool]


def mark_offline(session: Session, workspace_id: str, session_id: str) -> None:
    """The runtime said the session is offline: remember it, so background work settles
    locally instead of calling an agent host that is not there."""
    lock_session(session, workspace_id, session_id).live = False


def require_live(runtime: RuntimePort, workspace_id: str, session_id: str) -> int | None:
    """A liveness look (never a resume): RuntimeDisconnected if the session is offline;
    else the runtime epoch the host answered, if it did."""
    answer = runtime.liveness(workspace_id, session_id)
    if not answer.get("live"):
        raise RuntimeDisconnected("the session is offline at the agent host")
    return answer.get("runtime_epoch")


def _known_offline(session: Session, workspace_id: str, session_id: str) -> bool:
    row = session.get(AgentSession, (workspace_id, session_id), populate_existing=True)
    return row is not None and row.live is False


@dataclass(frozen=True)
class FenceClaim:
    fence_id: str
    workspace_id: str
    session_id: str
    target_operation_id: str
    target_revision: int
    clear_operation_id: str | None
    attempt: int
    token: str
    lane_token: str
    known_offline: bool

    @property
    def lane(self) -> str:
        return ids.lane_name(self.workspace_id, self.session_id)


class CancelRunner:
    """Requests and retries durable turn cancels."""

    def __init__(
        self,
        engine: Engine,
        runtime: RuntimePort,
        *,
        worker_id: str,
        lease_s: float,
        publish: Publish,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.engine, self.runtime, self.worker_id = engine, runtime, worker_id
        self.lease_s, self.publish, self.clock = lease_s, publish, clock

    @property
    def deadline_s(self) -> float:
        # How long an accepted cancel waits for its turn-settled report before the stale
        # cancel sweep looks at the session again.
        return 2 * self.lease_s

    def require_live(self, workspace_id: str, session_id: str, *, restore: bool = True) -> bool:
        """A liveness look (never a resume) whose answer counts as what it is: the session is
        live, at the epoch its host answered (DESIGN 4.9). A newer one ends the older
        epoch's turns and run here too, and what waited on them goes on; a fence not known
        to be installed there, or a clear not yet delivered, gets the session's restore
        (unless the caller is that restore). True if the epoch was newer. Raises
        RuntimeDisconnected when the session is offline."""
        epoch = require_live(self.runtime, workspace_id, session_id)

        def observe(s: Session) -> tuple[EpochEffects, bool]:
            now = self.clock()
            row = lock_session(s, workspace_id, session_id)
            row.live = True
            effects = EpochEffects()
            if epoch and epoch > (row.runtime_epoch or 0):
                effects = observe_epoch(s, row, epoch, now)
            wanted = restore and needs_restore(s, row) and request_restore(row, now)
            return effects, wanted

        effects, wanted = run_transaction(self.engine, observe)
        if wanted:
            self.publish(RESTORE_TASK, {"workspace_id": workspace_id, "session_id": session_id})
        if not effects.newer:
            return False
        publish_epoch_effects(
            self.engine, self.publish, workspace_id, session_id, effects, self.clock()
        )
        if not effects.released:  # a release wakes the prompt queue itself
            self.publish(PROMPT_TASK, {"workspace_id": workspace_id, "session_id": session_id})
        return True

    def request(self, workspace_id: str, session_id: str, turn_id: str, reason: str) -> str:
        """Cancel a turn (require_live), or join the cancel it already has for another cause
        (a session stop: a turn is cancelled once, whoever asked, DESIGN 4.3). Returns
        "settled" or "waiting"; raises RuntimeDisconnected (no row written) when the session
        is offline."""
        self.require_live(workspace_id, session_id)

        def prepare_and_claim(s: Session):
            cancel = cancels.prepare(
                s, workspace_id, session_id, turn_id, reason, self.clock(), join=True
            )
            if cancel.status == CancelStatus.COMPLETED:
                return cancel, None
            return cancel, cancels.claim(s, cancel, self.worker_id, self.lease_s, self.clock())

        cancel, token = run_transaction(self.engine, prepare_and_claim)
        if cancel.status == CancelStatus.COMPLETED:
            return "settled"
        if token is None:
            return "waiting"  # already requested; its answer or report is on the way
        return self._deliver(cancel, token)

    def _deliver(self, cancel: CancelOperation, token: str) -> str:
        """The cancel call (require_live) and its recorded answer: "settled" or "waiting".
        A host that does not know the turn (`not_found`: it restarted, or the turn never
        ran there) is an end for it: it is not running there, and the cancel completes
        `interrupted` instead of spending its budget on a turn nobody has."""
        try:
            answer = self.runtime.cancel_turn(
                cancel.workspace_id,
                cancel.session_id,
                cancel.turn_id,
                operation_id=cancel.operation_id,
                reason=cancel.reason,  # a joined cancel keeps the reason it was made for
                require_live=True,
            )
        except RuntimeFault as exc:
            if exc.code != NOT_FOUND:
                raise
            answer = {"result": CancelResult.INTERRUPTED}
        return run_transaction(self.engine, lambda s: self._record(s, cancel, token, answer))

    def _record(self, s: Session, cancel: CancelOperation, token: str, answer: dict) -> str:
        result = answer.get("result")
        if result in (
            CancelResult.CANCELED,
            CancelResult.ALREADY_SETTLED,
            CancelResult.INTERRUPTED,
        ):
            cancels.complete(s, cancel, result, self.clock(), token)
            return "settled"
        cancels.wait_for_settle(s, cancel, token, self.deadline_s, self.clock())
        return "waiting"

    def apply(self, operation_id: str) -> str:
        """`agent_radar.cancel.apply`, the stale-cancel path (DESIGN 4.5). A live session gets
        the cancel retried with backoff; an offline one waits, using no budget, and gets it
        once it is live again (a disconnect is no end: the turn may still run); a session that
        is gone (`session_not_found`) settles its turns as interrupted locally. Never a
        resume; past its budget the cancel ends `failed`."""

        def claim(s: Session):
            cancel = s.get(CancelOperation, operation_id, populate_existing=True)
            if cancel is None or cancel.status not in cancels.OPEN_CANCEL_STATUSES:
                return None, None
            return cancel, cancels.claim(s, cancel, self.worker_id, self.lease_s, self.clock())

        cancel, token = run_transaction(self.engine, claim)
        if token is None:
            return "skipped"
        # The claim counted this attempt: the budget is of the ones made before it.
        spent = budgets.spent(cancel.attempt - 1, cancel.failing_since, self.clock())
        if spent is not None:
            error = budgets.exhausted(spent, cancel.last_error)
            run_transaction(
                self.engine, lambda s: cancels.fail(s, cancel, token, error, self.clock())
            )
            log.warning("cancel %s failed: delivery budget exhausted", operation_id)
            return "failed"
        ws, sid = cancel.workspace_id, cancel.session_id
        try:
            if self.require_live(ws, sid) and not run_transaction(
                self.engine, lambda s: cancels.is_open(s, operation_id)
            ):
                return "interrupted"  # the host restarted: the turn ended with its process
            outcome = self._deliver(cancel, token)
        except RuntimeDisconnected:

            def wait(s: Session) -> None:
                mark_offline(s, ws, sid)
                cancels.wait_offline(s, cancel, token, self.clock())

            run_transaction(self.engine, wait)
            return "waiting_offline"
        except RuntimeFault as exc:
            if exc.code == SESSION_NOT_FOUND:
                self.session_gone(ws, sid)
                return "interrupted"
            error, delay = str(exc), backoff_s(cancel.attempt)  # attempt counts this one
            run_transaction(
                self.engine,
                lambda s: cancels.retry_later(s, cancel, token, error, delay, self.clock()),
            )
            return "retry"
        if outcome == "settled":
            self._wake(cancel)
        return outcome

    def session_gone(self, workspace_id: str, session_id: str, extra=None) -> object:
        """The host answered session_not_found: the session is gone, an authoritative end for
        every turn of it. They end interrupted (their open cancels too), in one transaction
        with `extra(s)` if given; the fences and the prompt queue that waited move on."""

        def settle(s: Session):
            mark_offline(s, workspace_id, session_id)
            result = extra(s) if extra is not None else None
            woken = cancels.interrupt_running_turns(s, workspace_id, session_id, self.clock())
            return result, woken

        result, woken = run_transaction(self.engine, settle)
        log.warning(
            "session %s/%s is gone at its host: its turns end interrupted", workspace_id, session_id
        )
        for fence_id in woken:
            self.publish(FENCE_APPLY_TASK, {"fence_id": fence_id})
        self.publish(PROMPT_TASK, {"workspace_id": workspace_id, "session_id": session_id})
        return result

    def _wake(self, cancel: CancelOperation) -> None:
        fence_ids = run_transaction(
            self.engine,
            lambda s: cancels.waiting_fences(
                s, cancel.workspace_id, cancel.session_id, cancel.turn_id, self.clock()
            ),
        )
        for fence_id in fence_ids:
            self.publish(FENCE_APPLY_TASK, {"fence_id": fence_id})


class FenceApplier:
    """Delivers a fence under the session's lane: install, cancel the fenced turn, drive the
    clear, complete — or settle locally when the session is offline."""

    def __init__(
        self,
        engine: Engine,
        runtime: RuntimePort,
        *,
        worker_id: str,
        lease_s: float,
        publish: Publish,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.engine, self.runtime, self.worker_id = engine, runtime, worker_id
        self.lease_s, self.publish, self.clock = lease_s, publish, clock
        self.cancels = CancelRunner(
            engine, runtime, worker_id=worker_id, lease_s=lease_s, publish=publish, clock=clock
        )
        # Fence-made clears never resume a session: no resume callback.
        self.dispatcher = Dispatcher(
            engine, runtime, worker_id=worker_id, lease_s=lease_s, clock=clock
        )

    def apply(self, fence_id: str) -> str:
        claim = run_transaction(self.engine, lambda s: self._claim(s, fence_id))
        if isinstance(claim, str):
            return claim
        try:
            outcome = self._deliver(claim)
        except RuntimeDisconnected:
            outcome = run_transaction(self.engine, lambda s: self._offline(s, claim))
        except RuntimeFault as exc:
            if exc.code == SESSION_NOT_FOUND:
                outcome = self._gone(claim)
            else:
                error = str(exc)
                outcome = run_transaction(
                    self.engine,
                    lambda s: self._back_to_pending(s, claim, error, backoff_s(claim.attempt)),
                )
        # The lane is free again: goal operations that found it busy are drained now.
        self.dispatcher.drain_lane(claim.workspace_id, claim.session_id)
        return outcome

    def _claim(self, s: Session, fence_id: str) -> FenceClaim | str:
        now = self.clock()
        fence = s.get(GoalFence, fence_id, populate_existing=True)
        if fence is None or fence.status == FenceStatus.COMPLETED:
            return "skipped"
        if fence.lease_expires_at is not None and fence.lease_expires_at > now:
            return "skipped"  # another worker is delivering it
        if fence.status == FenceStatus.FAILED:
            return "skipped"
        spent = budgets.spent(fence.attempt, fence.failing_since, now)
        if spent is not None:
            return self._fail(s, fence, now, spent)
        lane_token = leases.claim(
            s,
            ids.lane_name(fence.workspace_id, fence.session_id),
            self.worker_id,
            self.lease_s,
            now,
        )
        if lane_token is None:
            return "lane_busy"  # still due: the sweeper publishes it again shortly
        token = leases.new_token()
        s.execute(
            update(GoalFence)
            .where(GoalFence.fence_id == fence_id)
            .values(
                status=FenceStatus.PROCESSING,
                attempt=GoalFence.attempt + 1,
                lease_owner=self.worker_id,
                lease_token=token,
                lease_expires_at=now + timedelta(seconds=self.lease_s),
            )
        )
        return FenceClaim(
            fence_id=fence.fence_id,
            workspace_id=fence.workspace_id,
            session_id=fence.session_id,
            target_operation_id=fence.target_operation_id,
            target_revision=fence.target_revision,
            clear_operation_id=fence.clear_operation_id,
            attempt=fence.attempt,
            token=token,
            lane_token=lane_token,
            known_offline=_known_offline(s, fence.workspace_id, fence.session_id),
        )

    def _deliver(self, claim: FenceClaim) -> str:
        if claim.known_offline:
            # Known offline from an earlier answer: look whether it is back (a liveness
            # call, never a resume) before anything else reaches it.
            self.cancels.require_live(claim.workspace_id, claim.session_id)
        # This fence, and every durable fence not known to be at the session's (host,
        # epoch), is installed there (and recorded) before this one's clear.
        ensure_fences_installed(self.engine, self.runtime, claim.workspace_id, claim.session_id)
        turn_id = run_transaction(self.engine, lambda s: self._fenced_turn(s, claim))
        cancel_id = None
        if turn_id is not None:
            # Only a turn with exactly this provenance is cancelled; the active turn is never
            # a stand-in for it.
            cancel_id = ids.cancel_operation_id(claim.workspace_id, claim.session_id, turn_id)
            state = self.cancels.request(
                claim.workspace_id,
                claim.session_id,
                turn_id,
                reason=ids.fence_cause(claim.fence_id),
            )
            if state == "waiting":
                return run_transaction(
                    self.engine,
                    lambda s: self._back_to_pending(
                        s, claim, WAITING_FOR_TURN, self.cancels.deadline_s, cancel_id
                    ),
                )
        if claim.clear_operation_id and not self._drive_clear(claim):
            return run_transaction(
                self.engine,
                lambda s: self._back_to_pending(
                    s,
                    claim,
                    "the clear is waiting to be retried",
                    backoff_s(claim.attempt),
                    cancel_id,
                ),
            )
        return run_transaction(self.engine, lambda s: self._complete(s, claim, cancel_id))

    def _fenced_turn(self, s: Session, claim: FenceClaim) -> str | None:
        """The session's turn started by exactly the fenced generation, if it has one that
        is not settled; a settled one whose cancel is recorded counts as handled."""
        return s.execute(
            select(Turn.turn_id)
            .where(
                Turn.workspace_id == claim.workspace_id,
                Turn.session_id == claim.session_id,
                Turn.source_goal_operation_id == claim.target_operation_id,
                Turn.source_goal_revision == claim.target_revision,
                Turn.phase != TurnPhase.SETTLED,
            )
            .limit(1)
        ).scalar_one_or_none()

    def _drive_clear(self, claim: FenceClaim) -> bool:
        """Apply the fence's clear (require_live, never resume). True once it is settled."""
        clear_id = claim.clear_operation_id
        if clear_id is None:
            return True  # the fence made no clear: a newer goal owns the session
        current = run_transaction(self.engine, lambda s: self.dispatcher._claim(s, clear_id))
        if not isinstance(current, Claim):
            if current.outcome in ("held", "lane_lost"):
                return False  # a maintenance run holds the session: the clear waits
            return current.outcome != "skipped" or self._clear_settled(claim)
        try:
            answer = apply_goal(self.runtime, current.op)
        except RuntimeFault as exc:
            fault = exc
            result = run_transaction(
                self.engine,
                lambda s: self.dispatcher._fault_outcome(s, current, fault, fault.retryable),
            )
            return result.outcome != "retry"
        run_transaction(self.engine, lambda s: self.dispatcher._answer_outcome(s, current, answer))
        return True

    def _clear_settled(self, claim: FenceClaim) -> bool:
        op = run_transaction(self.engine, lambda s: s.get(GoalOperation, claim.clear_operation_id))
        return op is None or op.status not in OPEN_OPERATION_STATUSES

    # -- fence transitions, each conditional on the fence's lease token -------------------
    def _finish_fence(self, s: Session, claim: FenceClaim, **values) -> bool:
        result = s.execute(
            update(GoalFence)
            .where(GoalFence.fence_id == claim.fence_id, GoalFence.lease_token == claim.token)
            .values(lease_owner=None, lease_token=None, lease_expires_at=None, **values)
        )
        leases.release(s, claim.lane, claim.lane_token)
        return rowcount(result) == 1

    def _complete(self, s: Session, claim: FenceClaim, cancel_id: str | None) -> str:
        values = {"cancel_operation_id": cancel_id} if cancel_id else {}  # keep a recorded one
        ok = self._finish_fence(
            s,
            claim,
            status=FenceStatus.COMPLETED,
            completed_at=self.clock(),
            last_error=None,
            **values,
        )
        return "completed" if ok else "skipped"

    def _back_to_pending(
        self,
        s: Session,
        claim: FenceClaim,
        error: str,
        delay_s: float,
        cancel_id: str | None = None,
    ) -> str:
        values = {
            "status": FenceStatus.PENDING,
            "last_error": error,
            "next_attempt_at": self.clock() + timedelta(seconds=delay_s),
        }
        if error == WAITING_FOR_TURN:  # a wait uses no budget
            values.update(attempt=GoalFence.attempt - 1, failing_since=None)
        else:
            values["failing_since"] = func.coalesce(GoalFence.failing_since, self.clock())
        if cancel_id is not None:
            values["cancel_operation_id"] = cancel_id
        ok = self._finish_fence(s, claim, **values)
        return ("waiting" if error == WAITING_FOR_TURN else "retry") if ok else "skipped"

    def _offline(self, s: Session, claim: FenceClaim) -> str:
        """The session is offline (DESIGN 4.3 step 2). If the fenced generation's turn is
        running, its durable cancel is written (delivered once the session is live again,
        never by resuming it) and the fence waits for that turn's authoritative end, using no
        budget. Otherwise the fence completes locally."""
        mark_offline(s, claim.workspace_id, claim.session_id)
        turn_id = self._fenced_turn(s, claim)
        if turn_id is None:
            return self._settle_locally(s, claim)
        cancel_id = self._prepare_cancel(s, claim, turn_id)
        return self._back_to_pending(s, claim, WAITING_FOR_TURN, self.cancels.deadline_s, cancel_id)

    def _gone(self, claim: FenceClaim) -> str:
        """The host answered session_not_found: the session is gone. Its turns end
        interrupted — the fenced one through its durable cancel, so the fence records it — and
        the fence completes locally (DESIGN 4.3 step 6)."""

        def settle(s: Session) -> str:
            turn_id = self._fenced_turn(s, claim)
            cancel_id = self._prepare_cancel(s, claim, turn_id) if turn_id else None
            cancels.interrupt_running_turns(s, claim.workspace_id, claim.session_id, self.clock())
            return self._settle_locally(s, claim, cancel_id)

        return str(self.cancels.session_gone(claim.workspace_id, claim.session_id, settle))

    def _prepare_cancel(self, s: Session, claim: FenceClaim, turn_id: str) -> str:
        return cancels.prepare_or_existing(
            s,
            claim.workspace_id,
            claim.session_id,
            turn_id,
            ids.fence_cause(claim.fence_id),
            self.clock(),
        )

    def _settle_locally(self, s: Session, claim: FenceClaim, cancel_id: str | None = None) -> str:
        """No evidence from the agent: the clear completes with phase and sync `unknown`
        (observed kept) and the fence completes, recording the cancel it caused, if any. No
        runtime call and no resume: the session's next return installs the fence and
        delivers the clear (workflows/fences/restore.py)."""
        now = self.clock()
        if claim.clear_operation_id:
            done = s.execute(
                update(GoalOperation)
                .where(
                    GoalOperation.operation_id == claim.clear_operation_id,
                    GoalOperation.status.in_(OPEN_OPERATION_STATUSES),
                )
                .values(
                    status=OperationStatus.COMPLETED,
                    provider_phase=ProviderPhase.UNKNOWN,
                    completed_at=now,
                    lease_owner=None,
                    lease_token=None,
                    lease_expires_at=None,
                )
            )
            if rowcount(done) == 1:
                # It never reached the agent: delivered when the session is live again.
                s.execute(
                    update(GoalFence)
                    .where(GoalFence.fence_id == claim.fence_id)
                    .values(clear_undelivered=True)
                )
                s.execute(
                    update(GoalState)
                    .where(
                        GoalState.workspace_id == claim.workspace_id,
                        GoalState.session_id == claim.session_id,
                        GoalState.pending_operation_id == claim.clear_operation_id,
                    )
                    .values(sync_status=SyncStatus.UNKNOWN, pending_operation_id=None)
                )
        values = {"cancel_operation_id": cancel_id} if cancel_id else {}  # keep a recorded one
        ok = self._finish_fence(
            s, claim, status=FenceStatus.COMPLETED, completed_at=now, last_error=None, **values
        )
        return "completed_offline" if ok else "skipped"

    def _fail(self, s: Session, fence: GoalFence, now, why: str) -> str:
        """Past the budget: the fence ends `failed` with a stable code, and its clear (if it
        is still open) fails with it. The row still forbids its generation; every resume
        still preloads it."""
        error = budgets.exhausted(why, fence.last_error)
        result = s.execute(
            update(GoalFence)
            .where(GoalFence.fence_id == fence.fence_id, GoalFence.status != FenceStatus.COMPLETED)
            .values(
                status=FenceStatus.FAILED,
                last_error=error,
                completed_at=now,
                **leases.RELEASED,
            )
        )
        if fence.clear_operation_id:
            clear = s.get(GoalOperation, fence.clear_operation_id)
            if clear is not None:
                fail_operation(s, clear, "the fence's delivery budget ran out", now)
        log.warning("fence %s failed: %s", fence.fence_id, error)
        return "failed" if rowcount(result) == 1 else "skipped"

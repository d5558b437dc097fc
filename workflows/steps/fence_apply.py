"""Applying goal generation fences (docs/lifecycles.md: fences); the fenced turn's cancel is the
cancel step's (cancel.py). Background work: it never resumes a session. A session known to be
offline is settled locally: the fence is installed nowhere yet and its clear is marked
undelivered, so the session's next return — a resume, a reconnect, a restart, a move —
installs the one and delivers the other (workflows/steps/restore.py).
"""

import logging
from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property

from sqlalchemy.orm import Session

from ...models.db import run_read, run_transaction
from ...models.operations import GoalFence
from ...models.tables import AgentSession
from .. import budgets, ids, leases
from ..adapters.answers import HostState
from ..adapters.runtime import SESSION_NOT_FOUND
from ..budgets import backoff_s
from ..errors import RuntimeDisconnected, RuntimeFault
from ..fences import cancels, lifecycle, restores
from ..fences.fencing import fail_with_clear, settle_clear_locally
from ..goals.claims import Lane
from ..kinds.fence import FENCE_APPLY_TASK, FenceStatus
from ..maintenance import runs
from ..sessions import turns
from ..sessions.rows import Heard, heard_in, lock_session
from . import Step
from .cancel import CancelRunner, mark_offline
from .fence_install import ensure_fences_installed
from .goals.dispatch import Dispatcher
from .wake import wake_lane

log = logging.getLogger(__name__)

WAITING_FOR_TURN = "waiting for the fenced turn to settle"
# A maintenance run holds the session (docs/lifecycles.md): a hold, not a failure.
HELD_BY_MAINTENANCE = "the clear waits for the maintenance run that holds the session"
# The host accepted the clear and has not applied it: the clear's own budget
# (ACCEPTED_BUDGET_S) bounds the wait, and the fence looks again this often meanwhile.
CLEAR_ACCEPTED = "the host accepted the clear and has not applied it yet"
ACCEPTED_RECHECK_S = 15.0
# Waits use no budget: the fence's attempts and age clock stand still, however long.
WAITS = frozenset({WAITING_FOR_TURN, HELD_BY_MAINTENANCE, CLEAR_ACCEPTED})
# How soon a held fence looks again, should the run's release not wake it.
HELD_RECHECK_S = 5.0


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


class FenceApplier(Step):
    """Delivers a fence under the session's lane: install, cancel the fenced turn, drive the
    clear, complete — or settle locally when the session is offline."""

    @cached_property
    def cancels(self) -> CancelRunner:
        return self.alongside(CancelRunner)

    @cached_property
    def dispatcher(self) -> Dispatcher:
        # Fence-made clears never resume a session: no resume callback.
        return Dispatcher(
            self.engine,
            self.runtime,
            worker_id=self.worker_id,
            lease_s=self.lease_s,
            clock=self.clock,
        )

    def apply(self, fence_id: str) -> str:
        claim = run_transaction(self.engine, lambda s: self._claim(s, fence_id))
        if isinstance(claim, str):
            return claim
        try:
            outcome = self._deliver(claim)
        except RuntimeDisconnected as exc:
            heard = heard_in(exc, self.clock())
            outcome = run_transaction(self.engine, lambda s: self._offline(s, claim, heard))
        except RuntimeFault as exc:
            if exc.code == SESSION_NOT_FOUND:
                outcome = self._gone(claim, heard_in(exc, self.clock()))
            elif not exc.retryable:
                # A final refusal (docs/protocol.md: errors): the fence fails with it, as an
                # operation does; an operator retries it once the host is put right.
                refusal = str(exc)
                outcome = run_transaction(self.engine, lambda s: self._refused(s, claim, refusal))
            else:
                error = str(exc)
                outcome = run_transaction(
                    self.engine,
                    lambda s: self._back_to_pending(s, claim, error, backoff_s(claim.attempt)),
                )
        # The lane is free again: goal operations that found it busy go on.
        wake_lane(self.engine, self.publish, claim.workspace_id, claim.session_id)
        if outcome == "woken":
            self.publish(FENCE_APPLY_TASK, {"fence_id": claim.fence_id})
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
        if not lifecycle.claim(s, fence_id, self.worker_id, token, self.lease_s, now):
            return "skipped"  # failed or completed meanwhile
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
        state, turn_ids, states = self._look(claim)
        waiting = [cancel_id for cancel_id, how in states.items() if how == "waiting"]
        if not waiting and self._runs_unasked(claim, state, turn_ids):
            # The state answer may predate a turn's end that its report recorded since (the
            # host ended the turn, then reported it): a second look asks the host again.
            state, turn_ids, states = self._look(claim)
            waiting = [cancel_id for cancel_id, how in states.items() if how == "waiting"]
        if waiting:
            return run_transaction(self.engine, lambda s: self._wait_for_turn(s, claim, waiting[0]))
        cancel_id = next(iter(states), None)
        if self._runs_unasked(claim, state, turn_ids):
            return run_transaction(
                self.engine,
                lambda s: self._back_to_pending(
                    s, claim, WAITING_FOR_TURN, self.cancels.deadline_s, cancel_id
                ),
            )
        # The clear is a goal operation, claimed, called and recorded as every one is; the
        # fences went first, above. An offline session is the fence's to handle.
        clear = (
            self.dispatcher.apply_now(
                claim.clear_operation_id,
                Lane(claim.workspace_id, claim.session_id, claim.lane_token),
            )
            if claim.clear_operation_id
            else "settled"  # the fence made no clear: a newer goal owns the session
        )
        if clear == "held":
            return run_transaction(
                self.engine, lambda s: self._wait_for_release(s, claim, cancel_id)
            )
        if clear == "settled":
            return run_transaction(self.engine, lambda s: self._complete(s, claim, cancel_id))
        # An accepted clear is waited for (the claim fails it past its budget, and the fence
        # completes then); any other is retried.
        why, after = (
            (CLEAR_ACCEPTED, ACCEPTED_RECHECK_S)
            if clear == "accepted"
            else ("the clear is waiting to be retried", backoff_s(claim.attempt))
        )
        return run_transaction(
            self.engine, lambda s: self._back_to_pending(s, claim, why, after, cancel_id)
        )

    def _look(self, claim: FenceClaim) -> tuple[HostState, list[str], dict[str, str]]:
        """What runs there is the host's word (docs/lifecycles.md: reconcile): the record is
        made to agree with its state answer, so a turn of the generation no report told of is
        cancelled too, and the fence completes only once the host shows none running. Every
        unsettled turn of exactly this provenance on record (the active turn is never a
        stand-in) gets a cancel, as any may be the one still running; one the host does not
        know ends by its `not_found`. Returns the state answer, those turns, and each one's
        cancel: "settled" or "waiting"."""
        state, _done = self.host_state(claim.workspace_id, claim.session_id)
        turn_ids = run_transaction(self.engine, lambda s: self._fenced_turns(s, claim))
        cause = ids.fence_cause(claim.fence_id)
        states = {
            ids.cancel_operation_id(claim.workspace_id, claim.session_id, turn_id): (
                self.cancels.request(claim.workspace_id, claim.session_id, turn_id, reason=cause)
            )
            for turn_id in turn_ids
        }
        return state, turn_ids, states

    def _runs_unasked(self, claim: FenceClaim, state: HostState, turn_ids: list[str]) -> bool:
        """The host lists a running turn of the generation no cancel on record reaches (a
        host that gave an id twice): the fence waits and asks again."""
        ws, sid = claim.workspace_id, claim.session_id
        asked = run_read(
            self.engine, lambda s: {turns.host_turn_id(s, ws, sid, k) for k in turn_ids}
        )
        running = state.running_turns_of(claim.target_operation_id, claim.target_revision)
        return any(turn.turn_id not in asked for turn in running)

    def _fenced_turns(self, s: Session, claim: FenceClaim) -> list[str]:
        return cancels.unsettled_turns_of(
            s,
            claim.workspace_id,
            claim.session_id,
            claim.target_operation_id,
            claim.target_revision,
        )

    # -- the attempt's end (workflows/fences/lifecycle.py), and the lane let go -----------
    def _complete(self, s: Session, claim: FenceClaim, cancel_id: str | None) -> str:
        ok = lifecycle.complete(s, claim.fence_id, claim.token, self.clock(), cancel_id)
        leases.release(s, claim.lane, claim.lane_token)
        return "completed" if ok else "skipped"

    def _back_to_pending(
        self,
        s: Session,
        claim: FenceClaim,
        error: str,
        delay_s: float,
        cancel_id: str | None = None,
    ) -> str:
        now, wait = self.clock(), error in WAITS
        due_at = now + timedelta(seconds=delay_s)
        ok = lifecycle.back_to_pending(
            s, claim.fence_id, claim.token, error, due_at, now, wait=wait, cancel_id=cancel_id
        )
        leases.release(s, claim.lane, claim.lane_token)
        return ("waiting" if wait else "retry") if ok else "skipped"

    def _wait_for_turn(self, s: Session, claim: FenceClaim, cancel_id: str) -> str:
        """The fence waits for the turn of `cancel_id` to settle; the transaction that settles
        it wakes the fence (cancels.waiting_fences)."""
        still = lambda: cancels.still_waited_for(s, cancel_id)  # noqa: E731
        return self._wait(s, claim, WAITING_FOR_TURN, self.cancels.deadline_s, still, cancel_id)

    def _wait_for_release(self, s: Session, claim: FenceClaim, cancel_id: str | None) -> str:
        """The clear waits for the maintenance run that holds the session; its release wakes
        the fence (wake.release_session)."""
        ws, sid = claim.workspace_id, claim.session_id
        still = lambda: runs.session_held(s, ws, sid)  # noqa: E731
        return self._wait(s, claim, HELD_BY_MAINTENANCE, HELD_RECHECK_S, still, cancel_id)

    def _wait(
        self, s: Session, claim: FenceClaim, why: str, wait_s: float, still, cancel_id
    ) -> str:
        """The fence waits, using no budget, for what `why` names, until the transaction that
        ends it wakes the fence. What ended while this attempt ran found the fence claimed,
        not waiting, and woke nothing; so under the session's lock, which that transaction
        takes first too, `still()` is asked: if it has ended, the fence is due now ("woken",
        and `apply` publishes it again), else it looks again after `wait_s` at the latest."""
        lock_session(s, claim.workspace_id, claim.session_id)
        waiting = still()
        waited = self._back_to_pending(s, claim, why, wait_s if waiting else 0.0, cancel_id)
        return "woken" if waited == "waiting" and not waiting else waited

    def _offline(self, s: Session, claim: FenceClaim, heard: Heard) -> str:
        """The session is offline (docs/lifecycles.md: fences). For each of the fenced
        generation's turns that may be running, its durable cancel is written (delivered
        once the session is live again, never by resuming it), and the fence waits for their
        authoritative ends, using no budget. Otherwise the fence completes locally. An answer
        older than one on record, or of a host the session left, is none: it goes again."""
        if not mark_offline(s, claim.workspace_id, claim.session_id, heard):
            return self._back_to_pending(s, claim, "an older answer said offline", 0.0)
        cancel_ids = [self._prepare_cancel(s, claim, t) for t in self._fenced_turns(s, claim)]
        if not cancel_ids:  # settled locally; a look whether the session is back comes due
            restores.request(lock_session(s, claim.workspace_id, claim.session_id), self.clock())
            return self._settle_locally(s, claim)
        return self._wait_for_turn(s, claim, cancel_ids[0])

    def _gone(self, claim: FenceClaim, heard: Heard) -> str:
        """The host answered session_not_found: the session is gone, its turns end interrupted
        (the fenced one by its durable cancel) and the fence completes locally (see fences)."""

        def settle(s: Session) -> str:
            cancel_ids = [self._prepare_cancel(s, claim, t) for t in self._fenced_turns(s, claim)]
            cancels.interrupt_running_turns(s, claim.workspace_id, claim.session_id, self.clock())
            return self._settle_locally(s, claim, next(iter(cancel_ids), None))

        settled = self.cancels.session_gone(claim.workspace_id, claim.session_id, heard, settle)
        if settled is not None:
            return str(settled)
        moved = lambda s: self._back_to_pending(s, claim, "the session moved", 0.0)  # noqa: E731
        return run_transaction(self.engine, moved)  # a host it left answered: again, where it is

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
        delivers the clear (workflows/steps/restore.py)."""
        now = self.clock()
        if claim.clear_operation_id:
            # It never reached the agent: delivered when the session is live again.
            settle_clear_locally(
                s,
                claim.fence_id,
                claim.clear_operation_id,
                claim.workspace_id,
                claim.session_id,
                now,
            )
        ok = lifecycle.complete(s, claim.fence_id, claim.token, now, cancel_id)
        leases.release(s, claim.lane, claim.lane_token)
        return "completed_offline" if ok else "skipped"

    def _refused(self, s: Session, claim: FenceClaim, refusal: str) -> str:
        fence = s.get(GoalFence, claim.fence_id, populate_existing=True)
        if fence is None or fence.lease_token != claim.token:
            return "skipped"
        leases.release(s, claim.lane, claim.lane_token)
        return self._fail(s, fence, self.clock(), refusal, error=refusal)

    def _fail(self, s: Session, fence: GoalFence, now, why: str, error: str | None = None) -> str:
        """Past the budget (or refused for good): the fence ends `failed` with a stable code,
        and its clear (if it is still open) fails with it. The row still forbids its
        generation; every resume still preloads it."""
        error = error or budgets.exhausted(why, fence.last_error)
        failed = fail_with_clear(s, fence, error, f"the fence's delivery failed: {why}", now)
        log.warning("fence %s failed: %s", fence.fence_id, error)
        return "failed" if failed else "skipped"

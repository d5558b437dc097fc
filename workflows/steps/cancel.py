"""Durable turn cancels (docs/lifecycles.md: cancels): requested, delivered to the session's host
and retried; a session the host no longer has settles them locally. Background work: never resumes a
session (a liveness look only)."""

import logging

from sqlalchemy.orm import Session

from ...models.db import run_read, run_transaction
from ...models.operations import CancelOperation, MaintenanceRun
from ...models.tables import Turn
from .. import budgets
from ..activity.epochs import EpochEffects, observe_epoch
from ..adapters.runtime import NOT_FOUND, SESSION_NOT_FOUND, RuntimePort
from ..budgets import backoff_s
from ..errors import RuntimeDisconnected, RuntimeFault
from ..fences import cancels, restores
from ..fences.reinstall import needs_restore
from ..kinds.cancel import (
    CANCEL_APPLY_TASK,
    OPEN_CANCEL_STATUSES,
    RUN_STILL_STOPPING,
    CancelResult,
    CancelStatus,
)
from ..kinds.fence import FENCE_APPLY_TASK
from ..sessions import hosts, turns
from ..sessions.rows import Heard, heard_in, lock_session, record_liveness
from ..task_names import PROMPT_TASK, RESTORE_TASK
from . import Step, pin
from .wake import publish_epoch_effects

log = logging.getLogger(__name__)

MOVED = object()  # session_gone: the answer is of a host the session left


def mark_offline(session: Session, workspace_id: str, session_id: str, heard: Heard) -> bool:
    """The runtime said the session is offline (`heard`): remember it, so background work
    settles locally instead of calling an agent host that is not there; unless a newer answer
    is on record already, or the session left that host (False then)."""
    return record_liveness(lock_session(session, workspace_id, session_id), False, heard)


def require_live(
    runtime: RuntimePort, workspace_id: str, session_id: str, heard: Heard
) -> int | None:
    """A liveness look (never a resume), `heard` as it is asked: RuntimeDisconnected if the
    session is offline; else the runtime epoch the host answered, if it did."""
    answer = runtime.liveness(workspace_id, session_id)
    if not answer.get("live"):
        offline = RuntimeDisconnected("the session is offline at the agent host")
        offline.asked_at, offline.answered_by = heard
        raise offline
    return answer.get("runtime_epoch")


def _epoch_of(session: Session, cancel: CancelOperation) -> int:
    """The runtime epoch the cancelled turn (or maintenance run) ran in; 0 if not known."""
    if cancel.run_id is not None:
        run = session.get(MaintenanceRun, cancel.run_id)
        return (run.runtime_epoch or 0) if run is not None else 0
    turn = session.get(Turn, (cancel.workspace_id, cancel.session_id, cancel.turn_id))
    return (turn.runtime_epoch or 0) if turn is not None else 0


class CancelRunner(Step):
    """Requests and retries durable turn cancels."""

    @property
    def deadline_s(self) -> float:
        # How long an accepted cancel waits for its turn-settled report before the stale
        # cancel sweep looks at the session again.
        return 2 * self.lease_s

    def require_live(self, workspace_id: str, session_id: str, *, restore: bool = True) -> bool:
        """A liveness look (never a resume) whose answer counts as what it is: the session is live,
        at the epoch its host answered (docs/lifecycles.md: sessions). A newer one ends the older
        epoch's turns and run here too, and what waited on them goes on; a fence not known to be
        installed there, or a clear not yet delivered, gets the session's restore (unless the caller
        is that restore). True if the epoch was newer. Raises RuntimeDisconnected when the session
        is offline."""
        there = pin(self.engine, self.runtime, workspace_id, session_id)
        heard = Heard(self.clock(), there.host_id)
        epoch = require_live(there.port, workspace_id, session_id, heard)

        def observe(s: Session) -> tuple[EpochEffects, bool]:
            now = self.clock()
            row = lock_session(s, workspace_id, session_id)
            if not record_liveness(row, True, heard) and row.host_id != heard.host:
                return EpochEffects(), False  # a host the session left meanwhile answered
            effects = EpochEffects()
            if epoch and epoch > (row.runtime_epoch or 0):
                effects = observe_epoch(s, row, epoch, now)
            wanted = restore and needs_restore(s, row) and restores.request(row, now)
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
        """Cancel a turn (require_live), or join the cancel it already has for another cause (a
        session stop: a turn is cancelled once, whoever asked, docs/lifecycles.md: fences). Returns
        "settled" or "waiting"; raises RuntimeDisconnected (no row written) when the session is
        offline."""
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
        `interrupted` instead of spending its budget on a turn nobody has. The host is named
        before the call: a move meanwhile makes the cancel one owed to the host the session
        left, and another host's answer does not end it (`_record`)."""
        ws, sid = cancel.workspace_id, cancel.session_id
        there = pin(self.engine, self.runtime, ws, sid)
        try:
            answer = there.port.cancel_turn(
                ws,
                sid,
                self._host_turn_id(cancel),
                operation_id=cancel.operation_id,
                reason=cancel.reason,  # a joined cancel keeps the reason it was made for
                require_live=True,
            )
        except RuntimeFault as exc:
            if exc.code != NOT_FOUND:
                raise
            answer = {"result": CancelResult.INTERRUPTED}
        outcome = run_transaction(
            self.engine, lambda s: self._record(s, cancel, token, answer, there.host_id)
        )
        if outcome == "moved":
            self.publish(CANCEL_APPLY_TASK, {"operation_id": cancel.operation_id})
            return "waiting"
        return outcome

    def _host_turn_id(self, cancel: CancelOperation) -> str:
        """The id the host knows the cancel's turn by (workflows/sessions/turns.py)."""
        return run_read(
            self.engine,
            lambda s: turns.host_turn_id(s, cancel.workspace_id, cancel.session_id, cancel.turn_id),
        )

    def _record(
        self, s: Session, cancel: CancelOperation, token: str, answer: dict, host_id: str
    ) -> str:
        """Record `host_id`'s answer. A cancel a move made one owed to another host since the
        call (workflows/fences/moves.py) is not ended by this host's word: it is tried again
        at once, at the host it is owed to (`_apply_at_old_host`): "moved"."""
        owed_to = s.get(CancelOperation, cancel.operation_id, populate_existing=True)
        if owed_to is not None and owed_to.host_id not in (None, host_id):
            cancels.retry_later(s, cancel, token, f"moved from host {host_id}", 0.0, self.clock())
            return "moved"
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
        """`agent_radar.cancel.apply`, the stale-cancel path (docs/lifecycles.md: cancels). A live
        session gets the cancel retried with backoff; an offline one waits, using no budget, and
        gets it once it is live again (a disconnect is no end: the turn may still run); a session
        that is gone (`session_not_found`) settles its turns as interrupted locally. Never a resume;
        past its budget the cancel ends `failed`."""

        def claim(s: Session):
            cancel = s.get(CancelOperation, operation_id, populate_existing=True)
            if cancel is None or cancel.status not in OPEN_CANCEL_STATUSES:
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
        if cancel.host_id is not None:
            return self._apply_at_old_host(cancel, token)
        ws, sid = cancel.workspace_id, cancel.session_id
        try:
            if self.require_live(ws, sid) and not run_transaction(
                self.engine, lambda s: cancels.is_open(s, operation_id)
            ):
                return "interrupted"  # the host restarted: the turn ended with its process
            outcome = self._deliver(cancel, token)
        except RuntimeDisconnected as exc:
            heard = heard_in(exc, self.clock())

            def wait(s: Session) -> None:
                mark_offline(s, ws, sid, heard)
                cancels.wait(s, cancel, token, self.clock())

            run_transaction(self.engine, wait)
            return "waiting_offline"
        except RuntimeFault as exc:
            if exc.code == SESSION_NOT_FOUND:
                if self.session_gone(ws, sid, heard_in(exc, self.clock()), lambda s: True):
                    return "interrupted"
                error, delay = "the session moved", 0.0  # it goes again, where it is owed
            else:
                error, delay = str(exc), backoff_s(cancel.attempt)  # attempt counts this one
            run_transaction(
                self.engine,
                lambda s: cancels.retry_later(s, cancel, token, error, delay, self.clock()),
            )
            return "retry"
        if outcome == "settled":
            self._wake(cancel)
        return outcome

    def _apply_at_old_host(self, cancel: CancelOperation, token: str) -> str:
        """A cancel a move owes the host the session left (workflows/fences/moves.py): its turn,
        or its maintenance run, stopped there. Offline there: a wait (no budget), delivered when
        it is seen again; the session or the turn gone there: an end."""
        ws, sid = cancel.workspace_id, cancel.session_id
        host_id = cancel.host_id or ""
        address = run_read(self.engine, lambda s: hosts.address_of(s, host_id))
        try:
            runtime = self.runtime.on_host(*address)
            epoch = require_live(runtime, ws, sid, Heard(self.clock(), host_id))
            turn_epoch = lambda s: _epoch_of(s, cancel)  # noqa: E731
            if cancel.run_id is None and epoch and epoch > run_read(self.engine, turn_epoch) > 0:
                # That host restarted since: what ran there ended with its process, and
                # what has this id now is another turn (workflows/sessions/turns.py). A run's
                # stop goes all the same: a run id is never another's, and the stop has the
                # host refuse a start still on the wire (docs/protocol.md).
                answer = {"result": CancelResult.INTERRUPTED}
                return run_transaction(
                    self.engine, lambda s: self._record(s, cancel, token, answer, host_id)
                )
            if cancel.run_id is not None:
                runtime.cancel_maintenance(ws, sid, cancel.run_id)
                if runtime.maintenance_status(ws, sid, cancel.run_id).get("state") == "running":
                    # Asked, not stopped yet: owed (a move back waits) until it has, a wait
                    # using no budget, as an offline session's is (the host's run, not ours).
                    why = RUN_STILL_STOPPING.format(run_id=cancel.run_id, host_id=host_id)
                    run_transaction(
                        self.engine,
                        lambda s: cancels.wait(s, cancel, token, self.clock(), why),
                    )
                    return "waiting"
                answer = {"result": CancelResult.CANCELED}
            else:
                answer = runtime.cancel_turn(
                    ws,
                    sid,
                    self._host_turn_id(cancel),
                    operation_id=cancel.operation_id,
                    reason=cancel.reason,
                    require_live=True,
                )
        except RuntimeDisconnected:
            run_transaction(self.engine, lambda s: cancels.wait(s, cancel, token, self.clock()))
            return "waiting_offline"
        except RuntimeFault as exc:
            if exc.code not in (NOT_FOUND, SESSION_NOT_FOUND):
                error, delay = f"at host {host_id}: {exc}", backoff_s(cancel.attempt)
                run_transaction(
                    self.engine,
                    lambda s: cancels.retry_later(s, cancel, token, error, delay, self.clock()),
                )
                return "retry"
            answer = {"result": CancelResult.INTERRUPTED}  # nothing of it runs there
        return run_transaction(
            self.engine, lambda s: self._record(s, cancel, token, answer, host_id)
        )

    def session_gone(self, workspace_id: str, session_id: str, heard: Heard, extra=None) -> object:
        """The host answered session_not_found (`heard`): the session is gone, an authoritative
        end for every turn of it. They end interrupted (their open cancels too), in one
        transaction with `extra(s)` if given (its result is returned); the fences and the
        prompt queue that waited move on. Nothing ends, and None is returned, when the session
        lives on another host now (a move meanwhile): the answer tells of the host it left."""

        def settle(s: Session):
            if heard.host not in (None, lock_session(s, workspace_id, session_id).host_id):
                return MOVED, []
            mark_offline(s, workspace_id, session_id, heard)
            result = extra(s) if extra is not None else None
            woken = cancels.interrupt_running_turns(s, workspace_id, session_id, self.clock())
            return result, woken

        result, woken = run_transaction(self.engine, settle)
        if result is MOVED:
            return None
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

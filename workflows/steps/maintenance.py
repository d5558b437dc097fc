"""Executing maintenance runs (docs/lifecycles.md: maintenance): claim with a heartbeat lease, run
the work at the runtime (idempotent by run_id), poll it with cancel checks between polls, finalize,
release the session's held work. Also the sweeper's timeouts and the recovery barrier."""

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from ...models.base import utcnow
from ...models.db import run_transaction
from ...models.operations import MaintenanceRun
from .. import leases
from ..adapters.runtime import BUSY, NOT_FOUND, SESSION_NOT_FOUND, RuntimePort
from ..errors import RuntimeDisconnected, RuntimeFault
from ..fences import moves
from ..kinds.cancel import CANCEL_APPLY_TASK
from ..kinds.maintenance import EXECUTE_TASK, MaintenanceError, MaintenanceStatus
from ..maintenance import runs
from ..sessions.rows import lock_session
from ..task_names import Publish
from . import Step, pin
from .fence_install import ensure_fences_installed
from .wake import release_session

log = logging.getLogger(__name__)

S = MaintenanceStatus
# Between two status polls of the runtime; also how soon a cancel request is noticed.
POLL_S = 0.2
# One execute task polls at most this long, then hands the run back (published again): well
# under the task's soft time limit (tasks/app.py, 300 s), so no task is cut off mid-poll.
MAX_WAIT_S = 240.0
# _host_busy's answer when the run ended while the host was asked.
ENDED = "ended"
# _poll's answer when the run goes back to another worker.
HAND_BACK: dict = {"hand_back": True}
# How long an executor keeps trying to record a failed terminal write as recovery before
# leaving it to lease expiry and the sweeper.
PERSIST_RETRY_S = 120


@dataclass(frozen=True)
class RunClaim:
    run_id: str
    workspace_id: str
    session_id: str
    kind: str
    args: dict | None
    token: str
    status: str = S.RUNNING  # the run's status when it was claimed

    @property
    def key(self) -> tuple[str, str]:
        return self.workspace_id, self.session_id


# How often `finish` reads the run again when its change to `finalizing` found the row moved
# (a cancel committed in between): each move is one more status, and they are few.
FINALIZE_TRIES = 3


class MaintenanceExecutor(Step):
    def __init__(
        self,
        engine: Engine,
        runtime: RuntimePort,
        *,
        worker_id: str,
        lease_s: float,
        publish: Publish,
        clock: Callable[[], datetime] = utcnow,
        poll_s: float = POLL_S,
        max_wait_s: float = MAX_WAIT_S,
        stopping: Callable[[], bool] = lambda: False,
    ) -> None:
        super().__init__(
            engine, runtime, worker_id=worker_id, lease_s=lease_s, publish=publish, clock=clock
        )
        self.poll_s, self.max_wait_s, self.stopping = poll_s, max_wait_s, stopping

    def execute(self, run_id: str) -> str:
        claim = run_transaction(self.engine, lambda s: self._claim(s, run_id))
        if claim is None:
            return "skipped"
        try:
            if claim.status == S.RECOVERY_REQUIRED:
                # Recovery asks for the run's outcome first (docs/lifecycles.md: maintenance): a
                # host that lost the run (it restarted) must not be asked to run it again.
                state = self._status_or_gone(claim)
                if state is None and self._refused_there(claim):
                    return self._end_restarted(claim)
                done = state is not None and state.get("state") == "done"
                outcome = state if done else self._poll(claim)
            else:
                ensure_fences_installed(
                    self.engine, self.runtime, claim.workspace_id, claim.session_id
                )
                # The host is named before it is asked: the run starts, and is polled, where
                # it was found idle, wherever the session moves meanwhile.
                port = pin(self.engine, self.runtime, *claim.key).port
                busy = self._host_busy(claim)
                if busy is not None:
                    return self._end_busy(claim, busy)
                try:
                    port.start_maintenance(
                        claim.workspace_id,
                        claim.session_id,
                        run_id=claim.run_id,
                        kind=claim.kind,
                        args=claim.args,
                    )
                except RuntimeFault as exc:
                    if exc.code != BUSY:
                        raise
                    return self._end_busy(claim, f"the agent host is busy: {exc}")
                outcome = self._poll(claim, port)
                if outcome is None:
                    self._stop_if_ended(claim, port)
        except (RuntimeFault, RuntimeDisconnected) as exc:
            # Unreachable: let go; an expired lease sends it through recovery, which asks the
            # runtime again on every sweep until it answers.
            log.warning("maintenance %s: runtime unavailable (%s)", run_id, exc)
            run_transaction(self.engine, lambda s: self._release(s, claim))
            return "runtime_unavailable"
        if outcome is None:
            return "lost_lease"
        if outcome is HAND_BACK:
            return self._hand_back(claim)
        return self.finish(claim, outcome)

    def _host_busy(self, claim: RunClaim) -> str | None:
        """Ask the host what it runs before the run starts there (docs/lifecycles.md: reconcile):
        the mirror may say idle while a turn runs (its report still in the broker, or lost), or
        lag an epoch the host is already at. Why the run may not start (None: it may; also
        when the host already runs this very run, handed back)."""
        state, _done = self.host_state(claim.workspace_id, claim.session_id)
        run = run_transaction(self.engine, lambda s: runs.reload(s, claim.run_id))
        if run.status in runs.TERMINAL or run.lease_token != claim.token:
            return ENDED  # the answer ended it (a newer epoch), or it moved meanwhile
        if state.maintenance_run_id == claim.run_id:
            return None
        busy = None
        if state.maintenance_run_id is not None:
            busy = f"the agent host runs maintenance run {state.maintenance_run_id}"
        elif state.turns:
            busy = f"the agent host runs turn {state.turns[0].turn_id}"
        if busy is not None and self._status_or_gone(claim) is not None:
            return None  # it started there already (a run handed back): it is re-attached
        return busy

    def _end_busy(self, claim: RunClaim, reason: str) -> str:
        """The host is busy with another turn or run: this one ends `failed` (session_busy,
        as admission answers), never started there, and the session's held work goes on. An
        earlier worker's start may still be on the wire: the run's stop goes to the host,
        which then refuses it (moves.stop_run)."""
        if reason == ENDED:
            return run_transaction(self.engine, lambda s: runs.reload(s, claim.run_id)).status

        def end(s: Session) -> list[str] | None:
            run = runs.reload(s, claim.run_id)
            if not runs.transition(
                s,
                run,
                S.FAILED,
                self.clock(),
                token=claim.token,
                error_code=MaintenanceError.SESSION_BUSY,
                detail=reason,
            ):
                return None
            host_id = lock_session(s, claim.workspace_id, claim.session_id).host_id
            return moves.stop_run(s, run, host_id, "session-busy", self.clock())

        stops = run_transaction(self.engine, end)
        if stops is None:
            return "lost_lease"
        for stop_id in stops:
            self.publish(CANCEL_APPLY_TASK, {"operation_id": stop_id})
        release_session(
            self.engine, self.publish, claim.workspace_id, claim.session_id, self.clock()
        )
        return S.FAILED

    def _hand_back(self, claim: RunClaim) -> str:
        """Let the run go to another worker at once: the lease released and the execute task
        published again; that worker re-attaches (the start is idempotent by run_id at the
        host). Used when this worker is stopping, and after max_wait_s, so that no task runs
        past its time limit."""
        released = run_transaction(self.engine, lambda s: self._release(s, claim))
        if not released:
            return "lost_lease"
        self.publish(EXECUTE_TASK, {"run_id": claim.run_id})
        log.info("maintenance %s: handed back to another worker", claim.run_id)
        return "handed_back"

    def _status_or_gone(self, claim: RunClaim) -> dict | None:
        """The host's state of a run in recovery; None when the host has no such run or no
        such session (it restarted, or lost the session)."""
        try:
            return self.runtime.maintenance_status(
                claim.workspace_id, claim.session_id, claim.run_id
            )
        except RuntimeFault as exc:
            if exc.code in (NOT_FOUND, SESSION_NOT_FOUND):
                return None
            raise

    def _refused_there(self, claim: RunClaim) -> bool:
        """The host does not know the run: asked to stop it, it refuses the run's start from
        now on, so that a start still on the wire never lands after the run ended here
        (docs/protocol.md: a run cancelled before it came). True if the run is not there
        (not_found, or the session is gone); False if it is now (the start landed in
        between): it stops, and recovery polls it to its end."""
        try:
            self.runtime.cancel_maintenance(claim.workspace_id, claim.session_id, claim.run_id)
        except RuntimeFault as exc:
            if exc.code in (NOT_FOUND, SESSION_NOT_FOUND):
                return True
            raise
        return False

    def _end_restarted(self, claim: RunClaim) -> str:
        def end(s: Session) -> bool:
            return runs.transition(
                s,
                runs.reload(s, claim.run_id),
                S.INTERRUPTED,
                self.clock(),
                token=claim.token,
                error_code=MaintenanceError.RUNTIME_RESTARTED,
                detail="the agent host no longer has the run",
            )

        if not run_transaction(self.engine, end):
            return "lost_lease"
        release_session(
            self.engine, self.publish, claim.workspace_id, claim.session_id, self.clock()
        )
        return S.INTERRUPTED

    def _claim(self, s: Session, run_id: str) -> RunClaim | None:
        now = self.clock()
        run = s.get(MaintenanceRun, run_id, populate_existing=True)
        if run is None or run.status not in runs.ALLOWED:
            return None
        token = leases.claim_row(
            s,
            MaintenanceRun,
            MaintenanceRun.run_id,
            run_id,
            self.worker_id,
            self.lease_s,
            now,
            MaintenanceRun.status == run.status,
        )
        if token is None:
            return None
        return RunClaim(
            run.run_id, run.workspace_id, run.session_id, run.kind, run.args, token, run.status
        )

    def _heartbeat(self, s: Session, claim: RunClaim) -> MaintenanceRun | None:
        key = (MaintenanceRun, MaintenanceRun.run_id, claim.run_id, claim.token)
        if not leases.renew_row(s, *key, self.lease_s, self.clock()):
            return None
        return s.get(MaintenanceRun, claim.run_id, populate_existing=True)

    def _release(self, s: Session, claim: RunClaim) -> bool:
        return leases.release_row(
            s, MaintenanceRun, MaintenanceRun.run_id, claim.run_id, claim.token
        )

    def _stop_if_ended(self, claim: RunClaim, port: RuntimePort) -> None:
        """The run this worker just started there ended meanwhile in the record (a move or a
        restart while the start was in flight): nobody else stops it at that host, so this
        worker does (best effort: the host ends it with the process it ran in otherwise)."""
        run = run_transaction(self.engine, lambda s: runs.reload(s, claim.run_id))
        if run.status not in runs.TERMINAL:
            return  # another worker took it over: it polls, it ends it
        try:
            port.cancel_maintenance(claim.workspace_id, claim.session_id, claim.run_id)
        except (RuntimeFault, RuntimeDisconnected) as exc:
            log.warning("maintenance %s: ended here, not stopped at its host: %s", run.run_id, exc)

    def _poll(self, claim: RunClaim, port: RuntimePort | None = None) -> dict | None:
        """The run's final state, asked of `port` (the session's host when None); None if the
        lease was lost; HAND_BACK when this worker is stopping or waited max_wait_s (the next
        worker goes on polling)."""
        runtime = port or self.runtime
        cancel_sent = False
        deadline = time.monotonic() + self.max_wait_s
        while True:
            if self.stopping() or time.monotonic() >= deadline:
                return HAND_BACK
            run = run_transaction(self.engine, lambda s: self._heartbeat(s, claim))
            if run is None:
                return None  # our lease is gone: another worker owns the run now
            if run.cancel_requested_at is not None and not cancel_sent:
                runtime.cancel_maintenance(claim.workspace_id, claim.session_id, claim.run_id)
                cancel_sent = True
            state = runtime.maintenance_status(claim.workspace_id, claim.session_id, claim.run_id)
            if state.get("state") == "done":
                return state
            time.sleep(self.poll_s)

    def finish(self, claim: RunClaim, outcome: dict) -> str:
        """finalizing (durable on its own: no cancel after this point), then the terminal
        record in a second transaction."""

        def finalizing(s: Session) -> str | None:
            # A cancel may commit between the read and the guarded change (PostgreSQL reads
            # each statement afresh): the run is then `cancelling`, still ours, and its
            # outcome is in. Read again rather than give up the lease and let the sweeper
            # take the run for a lost worker.
            for _ in range(FINALIZE_TRIES):
                run = runs.reload(s, claim.run_id)
                if run.status in runs.TERMINAL or run.status == S.FINALIZING:
                    return run.status
                if run.lease_token != claim.token:
                    return None
                if runs.transition(s, run, S.FINALIZING, self.clock(), token=claim.token):
                    return S.FINALIZING
            return None

        def terminal(s: Session) -> str | None:
            run = runs.reload(s, claim.run_id)
            status, fields = runs.terminal_for(outcome)
            ok = runs.transition(s, run, status, self.clock(), token=claim.token, **fields)
            return status if ok else None

        state = run_transaction(self.engine, finalizing)
        if state is None:
            return "lost_lease"
        if state in runs.TERMINAL:
            return state
        try:
            status = run_transaction(self.engine, terminal)
        except SQLAlchemyError as exc:
            log.warning(
                "maintenance %s: terminal record not written (%s)",
                claim.run_id,
                exc.__class__.__name__,
            )
            return self._persist_failed(claim)
        if status is None:
            return "lost_lease"
        release_session(
            self.engine, self.publish, claim.workspace_id, claim.session_id, self.clock()
        )
        return status

    def _persist_failed(self, claim: RunClaim) -> str:
        """The terminal write failed: once the database answers again, leave the run in
        recovery (`operation_persist_failed`) and let go; recovery asks the runtime for the
        outcome and writes it again. The session stays held meanwhile."""

        def mark(s: Session) -> bool:
            run = runs.reload(s, claim.run_id)
            ok = runs.transition(
                s,
                run,
                S.RECOVERY_REQUIRED,
                self.clock(),
                token=claim.token,
                error_code=MaintenanceError.OPERATION_PERSIST_FAILED,
            )
            self._release(s, claim)
            return ok

        deadline = time.monotonic() + PERSIST_RETRY_S
        while time.monotonic() < deadline:
            try:
                run_transaction(self.engine, mark)
                return "persist_failed"
            except SQLAlchemyError:
                time.sleep(self.poll_s * 10)
        # Still no database: the lease runs out and the sweeper recovers the run later.
        return "persist_failed"

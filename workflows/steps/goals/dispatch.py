"""Goal dispatch (docs/lifecycles.md: goals dispatch, 4.8 lanes): the batched step a worker runs.

A dispatch reads which lanes to open, claims them (goals/lanes.py), and hands the claims to a
drain that calls the hosts, each within its bulkhead (flight.py), and records the outcomes
(goals/outcomes.py) as the calls finish.
"""

import functools
import logging
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from ....models.base import utcnow
from ....models.db import run_read, run_transaction
from ....models.dialects import dialect_of
from ... import leases, records
from ...adapters.runtime import RuntimePort
from ...errors import RuntimeDisconnected, RuntimeFault
from ...goals import outcomes
from ...goals.claims import Attempt, Claim, Lane, StepResult
from ...goals.lanes import GoalClaims, with_due_along
from ...goals.statements import (
    MAX_LANES_PER_STEP,
    NAMED_CLAIM,
    OPS_LANES_AND_DUE,
    lookup_and_claim_params,
    named_claim_params,
)
from ...kinds.goal import GoalOperation as GoalOperationRecord
from ...kinds.goal import Origin
from ..fence_install import ensure_fences_installed
from . import flight

log = logging.getLogger(__name__)


def apply_goal(
    runtime: RuntimePort, op: GoalOperationRecord, *, require_live: bool = True
) -> dict[str, Any]:
    """The runtime call of one goal operation (require_live: no background call resumes a
    session; only a user's own ensure_session passes False)."""
    return runtime.apply_goal(
        op.workspace_id,
        op.session_id,
        operation_id=op.operation_id,
        action=op.action,
        objective=op.objective,
        revision=op.goal_revision,
        client_submit_id=op.client_submit_id,
        require_live=require_live,
    )


# What apply_now answers for a claim's or a record's outcome ("skipped" aside: see there).
_APPLIED_NOW = {"held": "held", "lane_lost": "retry", "retry": "retry", "accepted": "accepted"}


class Dispatcher(GoalClaims):
    """Runs goal operations against the runtime, one session lane at a time (docs/lifecycles.md:
    goals, leases).

    A short transaction takes lanes and claims their operations (lane + operation lease,
    `dispatched`), up to MAX_LANES_PER_STEP at a time; the calls then run in a drain
    (flight.py: per-host bulkheads), whose transactions record the outcomes as calls finish,
    release the lanes, and take back those with due work and claim it.
    """

    def __init__(
        self,
        engine: Engine,
        runtime: RuntimePort,
        *,
        worker_id: str,
        lease_s: float,
        clock: Callable[[], datetime] = utcnow,
        resume_session: Callable[[str, str], Any] | None = None,
    ) -> None:
        super().__init__(engine, worker_id=worker_id, lease_s=lease_s, clock=clock)
        self.runtime = runtime
        # Client operations may bring an offline session back (user-triggered, fences
        # preloaded); fence-made operations never do.
        self.resume_session = resume_session

    def dispatch(self, operation_id: str) -> list[StepResult]:
        return self.dispatch_many([operation_id])

    def dispatch_many(
        self, operation_ids: list[str], session_of: tuple[str, str] | None = None
    ) -> list[StepResult]:
        """Claim these operations (claim_many) and drain each step's lanes in this thread
        until they have no due work left (a worker's drain runs in a thread of its own:
        tasks/worker_process.py)."""
        results: list[StepResult] = []
        for work, behind in self.claim_many(operation_ids, session_of):
            drain = flight.Drain(self, behind)
            drain.add(work)
            results += drain.run()
        return results

    def claim_many(
        self, operation_ids: list[str], session_of: tuple[str, str] | None = None
    ) -> Iterator[tuple[dict[Lane, Claim | StepResult], bool]]:
        """Take the session lane of each given operation and claim it, a step of up to
        MAX_LANES_PER_STEP lanes at a time, each step's claims yielded for a drain (with
        whether the messages are behind their work: see Drain.behind), which calls their
        hosts. A dispatch also takes other due operations along — where it
        `steals_anywhere`, even when its own were already taken: under load the messages
        queue behind their work and most find it taken along by an earlier one, and taking
        what is due then serves the operations whose messages are still in the queue.

        `session_of` names the session of the one given operation, as its message says (see
        `_claim_named`; where the database runs functions of its own)."""
        # Where the database holds the named claim's function: on SQLite the lanes read is no
        # round trip, and taking the write lock at once, instead of after it, made the paced
        # phases' tail worse (docs/benchmarks.md: figures the code rests on).
        if session_of and len(operation_ids) == 1 and dialect_of(self.engine).server_functions:
            named = self._claim_named(operation_ids[0], session_of)
            if named is not None:
                yield named, False
                return

        def lanes_to_open(
            s: Session, wanted: list[str]
        ) -> tuple[dict[tuple[str, str], str], set[tuple[str, str]], bool]:
            """Per session lane to open, the operation to start with: the given ones' and
            other due ones'; the sessions taken along; and whether none of the given ones
            was there to take (their message came late)."""
            params = {"b_ops": wanted, "b_now": self.clock()}
            rows = s.connection().execute(OPS_LANES_AND_DUE, params).all()
            late = not any(row.wanted for row in rows)
            if not self.steals_anywhere and late:
                return {}, set(), late
            return (*with_due_along(rows, lambda row: row.wanted), late)

        for start in range(0, len(operation_ids), MAX_LANES_PER_STEP):
            wanted = list(operation_ids[start : start + MAX_LANES_PER_STEP])
            # The read needs no transaction of its own (the claim checks every row again
            # under the session lock), so a message whose work is already done or taken,
            # with nothing else due, costs one statement.
            first, along, late = run_read(
                self.engine, functools.partial(lanes_to_open, wanted=wanted), direct=True
            )
            if first:
                # Lanes taken along are not waited for: a dispatch that is taking one right
                # now (another stealing the same backlog, most often) keeps it, and this one
                # goes on with the rest instead of waiting to find it taken. The given
                # operations' lanes are waited for. A message that came after its work was
                # taken says the messages lag behind the work: its steps then take all due
                # work at their ends, however young (see STEAL_AFTER).
                opened = run_transaction(
                    self.engine,
                    functools.partial(self._open, first=first, along=along),
                    direct=True,
                )
                yield opened, late

    def _claim_named(
        self, operation_id: str, key: tuple[str, str]
    ) -> dict[Lane, Claim | StepResult] | None:
        """Take the lane of the session a message names and claim the operation in one
        call (goals/statements.py: NAMED_CLAIM, the function of migration 0016), without
        the read that finds its session (a message of one operation: a lone operation's
        round trips are most of its time, docs/benchmarks.md); None if the dispatch is then to go
        on as if nothing were named. The name is the message's word: the lane is taken only
        if the operation is open and unleased in that very session, and let go again in the
        same call if the claim then does not take it: nothing is left written but the claim
        of that very operation."""
        now = self.clock()
        lane = Lane(*key, leases.new_token())
        expires = now + timedelta(seconds=self.lease_s)
        claim = lookup_and_claim_params(
            [operation_id], now, self.worker_id, leases.new_token(), expires
        )
        params = named_claim_params(operation_id, key, lane.name, lane.token, claim)
        rows = run_read(
            self.engine, lambda s: s.connection().execute(NAMED_CLAIM, params).all(), direct=True
        )
        if not rows:
            return None
        op = records.from_row(GoalOperationRecord, rows[0])
        return {lane: self._claim_of(op, rows[0], claim["b_token"], now, expires)}

    def record(
        self, s: Session, attempts: list[Attempt], lanes: list[Lane]
    ) -> tuple[list[StepResult], bool]:
        """Record the attempts' outcomes (goals.outcomes.record) in the caller's transaction;
        where it can, the lanes are released in the same statement."""
        return outcomes.record(s, attempts, lanes, self.clock())

    def apply_now(self, operation_id: str, lane: Lane) -> str:
        """One operation claimed under `lane` (the caller's: a fence's clear,
        docs/lifecycles.md: fences; renewed, or the claim is refused), called at the host it
        was claimed at (the goal alone: the caller installed the fences) and recorded as
        every attempt is, in this thread; require_live, never a resume. "settled" once it
        is, "held" while a maintenance run holds the session, "accepted" while the host has
        accepted it and not applied it, else "retry". An offline session is the caller's to
        handle: RuntimeDisconnected goes up, and nothing is recorded (the claim's lease
        lapses)."""
        current = run_transaction(self.engine, lambda s: self.claim(s, operation_id, lane))
        if isinstance(current, Claim):
            # The goal alone: its caller installed the session's fences first (a fence's step).
            call = lambda runtime, claim: apply_goal(runtime, claim.op)  # noqa: E731
            attempt = self._attempt(current, call)
            if isinstance(attempt.fault, RuntimeDisconnected):
                raise attempt.fault
            recorded, _released = run_transaction(
                self.engine, lambda s: self.record(s, [attempt], [])
            )
            current = recorded[0]
        if current.outcome == "skipped":  # passed over, or another holds it: where it stands
            return run_read(self.engine, lambda s: outcomes.where_it_stands(s, operation_id))
        return _APPLIED_NOW.get(current.outcome, "settled")

    def attempt(self, claim: Claim) -> Attempt:
        """Call the runtime (outside any transaction): the fences the host lacks, the goal."""
        return self._attempt(claim, self._call_runtime)

    def _attempt(
        self, claim: Claim, call: Callable[[RuntimePort, Claim], dict[str, Any]]
    ) -> Attempt:
        try:
            runtime = self.runtime.on_host(*claim.host)
            return Attempt(claim, answer=call(runtime, claim))
        except RuntimeFault as exc:
            return Attempt(claim, fault=exc, retryable=exc.retryable)
        except RuntimeDisconnected as exc:
            return Attempt(claim, fault=exc, retryable=True)
        except Exception as exc:  # noqa: BLE001 - one call's failure stays that call's
            log.exception("goal operation %s: runtime call failed", claim.op.operation_id)
            fault = RuntimeFault(
                f"runtime call failed: {exc.__class__.__name__}",
                code="bad_response",
                retryable=True,
                http_status=None,
            )
            return Attempt(claim, fault=fault, retryable=True)

    def _call_runtime(self, runtime: RuntimePort, claim: Claim) -> dict[str, Any]:
        """The fences the session's host lacks, then the goal. A client's operation that finds
        the session offline, at either, resumes it (with every fence preloaded) and applies."""
        op = claim.op
        try:
            if claim.reinstall:
                ensure_fences_installed(self.engine, runtime, op.workspace_id, op.session_id)
            return apply_goal(runtime, op)
        except RuntimeDisconnected:
            if op.origin != Origin.CLIENT or self.resume_session is None:
                raise
            self.resume_session(op.workspace_id, op.session_id)
            return apply_goal(runtime, op)

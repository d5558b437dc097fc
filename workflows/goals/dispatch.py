"""Goal dispatch (DESIGN 4.2 dispatch, 4.8 lanes): the batched step a worker runs.

Rules are plain functions over a database session (or an engine, where one step needs several
short transactions around a runtime call) and a runtime port. They never import Celery.
"""

import dataclasses
import functools
import logging
from collections.abc import Callable, Collection, Iterable
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import update
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from models.base import utcnow
from models.db import rowcount, run_read, run_transaction
from models.dialects import dialect_of
from models.enums import OPEN_OPERATION_STATUSES, OperationStatus, Origin, ProviderPhase, SyncStatus
from models.tables import GoalOperation, GoalState
from workflows import ids, leases, records
from workflows.adapters import logs
from workflows.adapters.runtime import STALE_REVISION, RuntimePort
from workflows.errors import RuntimeDisconnected, RuntimeFault
from workflows.fences.reinstall import ensure_fences_installed
from workflows.goals import claim_rule, flight
from workflows.goals.claims import Attempt, Claim, Lane, StepResult
from workflows.goals.operations import (
    ACCEPTED_BUDGET_S,
    backoff_s,
    budget_exhausted,
    complete_applied,
    complete_applied_many,
    fail_operation,
)
from workflows.goals.statements import (
    CLAIM,
    CLAIM_AND_APPLYING,
    CLAIM_LOOKUP,
    GIVE_BACK,
    LOCK_SESSIONS_OF_OPS,
    MAX_LANES_PER_STEP,
    NEXT_DUE,
    NEXT_DUE_AND_ANYWHERE,
    OPS_LANES,
    OPS_LANES_AND_DUE,
    RESCHEDULE,
    RESCHEDULE_HELD,
    STATE_SYNC,
    STATES_APPLYING,
    TAKE_LANES_AND_LOCK,
    claim_params,
)
from workflows.goals.submit import supersede
from workflows.sessions.rows import lock_session

log = logging.getLogger(__name__)

# A held operation is looked at again after this long even if no release woke it (the
# release is a publish after commit; this bounds the wait if that publish was lost).
HOLD_RECHECK_S = 30
# A step's end takes other sessions' due work (PostgreSQL, a dispatch that steals) only once
# it has been due this long: work due for less has its message on the way, most often to
# the other pool process, idle. Taking it at the step's end then only made the two collide
# (its message's dispatch waited for the lane the step was creating, to find its work taken:
# one submit at a time, 300 each, three alternating runs: CPU of the whole machine 14.2 →
# 11.1 ms an operation, p50 8.1 → 7.0 ms). Under load the messages queue for longer than
# this, and their work is taken along as before. A dispatch whose message came after its work
# was taken knows they queue: its steps take all due work, however young (`eager`: at 285
# submits/s, where each submit's message costs a task and the messages fall behind, p50 at
# the agent 8.6–10.3 → 5.9–6.8 ms, p99 19–20 → 17–18, two rounds each of two alternating runs).
STEAL_AFTER = timedelta(milliseconds=10)


def _first_per_session(rows) -> dict[tuple[str, str], str]:
    """The lowest-revision open operation of each session among `rows`."""
    first: dict[tuple[str, str], str] = {}
    for row in sorted(rows, key=lambda r: r.goal_revision):
        if row.status in OPEN_OPERATION_STATUSES:
            first.setdefault((row.workspace_id, row.session_id), row.operation_id)
    return first


def _with_due_along(
    rows, is_given: Callable[[Any], bool]
) -> tuple[dict[tuple[str, str], str], set[tuple[str, str]]]:
    """Per session, the operation to start its lane with: the given rows' first, then
    other due ones' (rows of a read that steals), up to MAX_LANES_PER_STEP lanes; and the
    sessions taken along (those that only other due rows brought)."""
    rows = list(rows)
    first = _first_per_session(row for row in rows if is_given(row))
    along: set[tuple[str, str]] = set()
    for key, operation_id in _first_per_session(r for r in rows if not is_given(r)).items():
        if len(first) >= MAX_LANES_PER_STEP:
            break
        if key not in first:
            first[key] = operation_id
            along.add(key)
    return first, along


def _mine(row) -> bool:
    return bool(row.mine)


def _give_back(conn, row, token: str) -> None:
    """Undo a claim of one operation (under its lease token): its row and its goal state's
    sync status as the claim's statement read them."""
    given = conn.execute(
        GIVE_BACK,
        {
            "b_op": row.operation_id,
            "b_token": token,
            "b_status": row.status,
            "b_phase": row.provider_phase,
            "b_attempt": row.attempt,
            "b_first": row.first_dispatched_at,
            "b_owner": row.lease_owner,
            "b_old_token": row.lease_token,
            "b_expires": row.lease_expires_at,
        },
    )
    if rowcount(given) == 1:
        conn.execute(
            STATE_SYNC,
            {"b_ws": row.workspace_id, "b_sid": row.session_id, "b_sync": row.state_sync},
        )


def apply_goal(
    runtime: RuntimePort, op: records.GoalOperation, *, require_live: bool = True
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


class Dispatcher:
    """Runs goal operations against the runtime, one session lane at a time (DESIGN 4.2, 4.8).

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
        hand_off: bool = False,
    ) -> None:
        self.engine = engine
        # A worker's dispatch hands its claims to the process's drain and returns (flight.py).
        self.hand_off = hand_off
        self.runtime = runtime
        self.worker_id = worker_id
        self.lease_s = lease_s
        self.clock = clock
        # Client operations may bring an offline session back (user-triggered, fences
        # preloaded); fence-made operations never do.
        self.resume_session = resume_session
        # Whether a dispatch that steals takes due work wherever it is: with its own
        # operations already taken, and at the end of each step. On PostgreSQL it skips the
        # lanes others are taking (SKIP LOCKED). On SQLite every write transaction waits
        # for the one write lock, so such a dispatch queues behind the one already draining
        # the backlog to find its work taken (embedded, 400 operations: 282 → 167 ops/s and
        # CPU ×1.9); there it takes other due work only along its own.
        self.steals_anywhere = dialect_of(engine).locks_rows
        # Whether a step's record releases its lanes in its own statement (PostgreSQL:
        # data-modifying CTEs), one round trip less on every step.
        self.releases_in_record = dialect_of(engine).writes_together

    # -- lanes -----------------------------------------------------------------------------
    def dispatch(self, operation_id: str) -> list[StepResult]:
        return self.dispatch_many([operation_id])

    def dispatch_many(
        self,
        operation_ids: list[str],
        steal: bool = False,
    ) -> list[StepResult]:
        """Entry point of `agent_radar.goal.dispatch`: take the session lane of each given
        operation and drain those lanes together, starting with these operations. With
        `steal`, a dispatch also takes other due operations along — where it
        `steals_anywhere`, even when its own were already taken: under load the messages
        queue behind their work and most find it taken along by an earlier one, and taking
        what is due then serves the operations whose messages are still in the queue."""

        def lanes_to_open(
            s: Session, wanted: list[str]
        ) -> tuple[dict[tuple[str, str], str], set[tuple[str, str]], bool]:
            """Per session lane to open, the operation to start with: the given ones' and
            (stealing) other due ones'; the sessions taken along; and whether none of the
            given ones was there to take (their message came late)."""
            conn = s.connection()
            params = {"b_ops": wanted, "b_now": self.clock()}
            if not steal:
                return _first_per_session(conn.execute(OPS_LANES, params)), set(), False
            rows = conn.execute(OPS_LANES_AND_DUE, params).all()
            late = not any(row.wanted for row in rows)
            if not self.steals_anywhere and late:
                return {}, set(), late
            return (*_with_due_along(rows, lambda row: row.wanted), late)

        results: list[StepResult] = []
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
                # operations' lanes are waited for (see _drain). A message that came after
                # its work was taken says the messages lag behind the work: its steps then
                # take all due work at their ends, however young (see STEAL_AFTER).
                results += self._drain(
                    run_transaction(
                        self.engine,
                        functools.partial(self._open, first=first, along=along),
                        direct=True,
                    ),
                    steal,
                    eager=late,
                )
        return results

    def drain_lane(self, workspace_id: str, session_id: str) -> list[StepResult]:
        """Drain whatever is due on a session's lane (a wake-up without a given operation)."""
        return self._drain(
            run_transaction(
                self.engine,
                lambda s: self._next(s, [(workspace_id, session_id)]),
                direct=True,
            )
        )

    def _take_lanes(
        self,
        s: Session,
        keys: Iterable[tuple[str, str]],
        along: Collection[tuple[str, str]] = (),
        first: dict[tuple[str, str], str] | None = None,
    ) -> dict[tuple[str, str], Lane]:
        """Take the lanes of these sessions that nobody holds. A held lane is not ours to
        drain: its holder checks once more for due work when it releases. A lane of `along`
        that another transaction is taking or letting go of is left out without waiting.
        Given `first` (each lane's operation to claim; PostgreSQL), the same statement locks
        the sessions of the operations of the lanes it took (TAKE_LANES_AND_LOCK)."""
        names = {ids.lane_name(*key): key for key in keys}
        and_then = None
        if first is not None:
            lane_ops = {name: first[key] for name, key in names.items()}
            and_then = (
                TAKE_LANES_AND_LOCK,
                {"b_lane_names": list(lane_ops), "b_lane_ops": list(lane_ops.values())},
            )
        token, taken = leases.claim_many(
            s,
            sorted(names),
            self.worker_id,
            self.lease_s,
            self.clock(),
            unlocked_only={ids.lane_name(*key) for key in along},
            and_then=and_then,
        )
        return {(ws, sid): Lane(ws, sid, token) for ws, sid in (names[name] for name in taken)}

    def _open(
        self,
        s: Session,
        first: dict[tuple[str, str], str],
        along: Collection[tuple[str, str]] = (),
    ) -> dict[Lane, Claim | StepResult]:
        """Take the lanes of these sessions and claim each one's given operation (a fresh
        lane needs no renewal before the claim)."""
        if not first:
            return {}
        locks = dialect_of(s).locks_rows
        lanes = self._take_lanes(s, first, along, first if locks else None)
        if not lanes:
            return {}
        claims = self._claim_ops(s, [first[key] for key in lanes], sessions_locked=locks)
        return {lane: claims[first[key]] for key, lane in lanes.items()}

    def _drain(
        self, work: dict[Lane, Claim | StepResult], steal: bool = False, eager: bool = False
    ) -> list[StepResult]:
        """Call the runtime for every claimed operation, each host within its bulkhead
        (flight.py); as calls finish, one transaction records their outcomes, releases their
        lanes, takes back those that have due work and claims it (with `steal`, other due
        work too). Handing off (a worker), the calls go on in this process's drain and the
        claims are reported `in_flight`."""
        if self.hand_off:
            if work:
                flight.hand_off(self, work, eager)
            return [
                current
                if isinstance(current, StepResult)
                else StepResult(current.op.operation_id, "in_flight")
                for current in work.values()
            ]
        drain = flight.Drain(self, steal, eager)
        drain.add(work)
        return drain.run()

    @staticmethod
    def _release(s: Session, lanes: list[Lane]) -> None:
        for token in {lane.token for lane in lanes}:
            leases.release_many(s, [lane.name for lane in lanes if lane.token == token], token)

    def _next(
        self, s: Session, keys: list[tuple[str, str]], steal: bool = False, eager: bool = False
    ) -> dict[Lane, Claim | StepResult]:
        """Take the lanes of these sessions that have due work, and claim it; with `steal`,
        other due work too (its lanes not waited for, as in dispatch_many): due for
        STEAL_AFTER, or (`eager`) at all. A lane someone holds is left to its holder, who
        runs this check after its release commits."""
        now = self.clock()
        stale = now if eager else now - STEAL_AFTER
        params = {"b_keys": sorted(set(keys)), "b_now": now, "b_stale": stale}
        conn = s.connection()
        if not steal or not self.steals_anywhere:
            return self._open(s, _first_per_session(conn.execute(NEXT_DUE, params)))
        first, along = _with_due_along(conn.execute(NEXT_DUE_AND_ANYWHERE, params).all(), _mine)
        return self._open(s, first, along)

    # -- operations ------------------------------------------------------------------------
    def _claim(
        self, session: Session, operation_id: str, lane: Lane | None = None
    ) -> Claim | StepResult:
        if lane is not None and not leases.renew(
            session, lane.name, lane.token, self.lease_s, self.clock()
        ):
            return StepResult(operation_id, "lane_lost")
        return self._claim_ops(session, [operation_id])[operation_id]

    def _claim_ops(
        self, session: Session, operation_ids: list[str], sessions_locked: bool = False
    ) -> dict[str, Claim | StepResult]:
        """Claim these operations for an attempt now (their lanes are held), or say why
        not: the session rows locked (unless the lanes' statement did, `sessions_locked`),
        then their rows read (operations, goal states, maintenance holds) and judged by the
        claim rule (goals.claim_rule.obstacle, its one source of truth), and those it lets
        go claimed under a guard that takes a row only while it is open and unleased."""
        now = self.clock()
        conn = session.connection()
        wanted = {"b_ops": list(operation_ids)}
        if not sessions_locked:
            conn.execute(LOCK_SESSIONS_OF_OPS, wanted).all()
        rows = {row.operation_id: row for row in conn.execute(CLAIM_LOOKUP, wanted)}
        verdicts: dict[str, Claim | StepResult] = {}
        claimable: list[records.GoalOperation] = []
        for operation_id in operation_ids:
            row = rows.get(operation_id)
            obstacle = claim_rule.obstacle(row, operation_id, now)
            if obstacle is not None:
                verdicts[operation_id] = self._verdict(session, row, operation_id, obstacle, now)
            else:
                claimable.append(records.from_row(records.GoalOperation, row))
        if not claimable:
            return verdicts
        token = leases.new_token()
        expires = now + timedelta(seconds=self.lease_s)
        params = claim_params(now, self.worker_id, token, expires)
        taken = self._claim_now(conn, params, claimable)
        for op in claimable:
            if op.operation_id not in taken:
                verdicts[op.operation_id] = StepResult(op.operation_id, "skipped")
                continue
            verdicts[op.operation_id] = self._claim_of(
                op, rows[op.operation_id], token, now, expires
            )
        return verdicts

    def _claim_of(
        self,
        op: records.GoalOperation,
        row,
        token: str,
        now: datetime,
        expires: datetime,
    ) -> Claim:
        """The claim of an operation as its claim-lookup row read it before the claim."""
        return Claim(
            op=dataclasses.replace(
                op,
                status=OperationStatus.DISPATCHED.value,
                provider_phase=ProviderPhase.DISPATCHED.value,
                attempt=op.attempt + 1,
                first_dispatched_at=op.first_dispatched_at or now,
                lease_owner=self.worker_id,
                lease_token=token,
                lease_expires_at=expires,
            ),
            token=token,
            reinstall=bool(row.reinstall),
            host=(row.host_id, row.host_url, row.host_token),
            before=row,
            log_context=logs.current_context(),
        )

    @staticmethod
    def _claim_now(conn, params: dict[str, Any], ops: list[records.GoalOperation]) -> set[str]:
        """CLAIM (with their goal states' `applying`) of operations judged free to go; the
        ids it took."""
        params = {**params, "b_ops": [op.operation_id for op in ops]}
        if dialect_of(conn).writes_together:
            return set(conn.execute(CLAIM_AND_APPLYING, params).scalars())
        taken = set(conn.execute(CLAIM, params).scalars())
        keys = {(op.workspace_id, op.session_id) for op in ops if op.operation_id in taken}
        if keys:
            conn.execute(STATES_APPLYING, {"b_keys": sorted(keys)})
        return taken

    def _verdict(
        self, session: Session, row, operation_id: str, obstacle: str, now: datetime
    ) -> StepResult:
        """What an operation's obstacle (see _obstacle) means, with what that implies
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

    def _unclaim(self, session: Session, claim: Claim, due_at: datetime | None = None) -> None:
        """Give back a claim that will not be attempted: the operation (and its goal state's
        sync status) as it was before the claim, no budget spent; due at `due_at`, or as it
        was. Nothing if the claim's lease was taken over meanwhile."""
        conn = session.connection()
        if due_at is not None:
            conn.execute(
                RESCHEDULE_HELD,
                {"b_op": claim.op.operation_id, "b_token": claim.token, "b_at": due_at},
            )
        _give_back(conn, claim.before, claim.token)

    def _attempt(self, claim: Claim) -> Attempt:
        """Call the runtime (outside any transaction)."""
        try:
            runtime = self.runtime.on_host(*claim.host)
            if claim.reinstall:
                ensure_fences_installed(
                    self.engine, runtime, claim.op.workspace_id, claim.op.session_id
                )
            return Attempt(claim, answer=self._call_runtime(runtime, claim.op))
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

    def _record(
        self, s: Session, attempts: list[Attempt], lanes: list[Lane]
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
        if self.releases_in_record and not others and len(tokens) == 1 == len(lane_tokens):
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
                self.clock(),
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
                    results.append(self._fault_outcome(s, a.claim, a.fault, a.retryable))
                else:
                    results.append(self._answer_outcome(s, a.claim, a.answer or {}))
        return results, release is not None

    def _call_runtime(self, runtime: RuntimePort, op: records.GoalOperation) -> dict[str, Any]:
        try:
            return apply_goal(runtime, op)
        except RuntimeDisconnected:
            if op.origin != Origin.CLIENT or self.resume_session is None:
                raise
            self.resume_session(op.workspace_id, op.session_id)
            return apply_goal(runtime, op)

    # -- outcomes, each in the caller's transaction and conditional on the lease token --
    def _answer_outcome(self, s: Session, claim: Claim, answer: dict[str, Any]) -> StepResult:
        op, token, now = claim.op, claim.token, self.clock()
        phase = answer.get("phase")
        if phase == "applied":
            ok = complete_applied(
                s, op, answer.get("goal"), answer.get("evidence"), now, token=token
            )
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
        return self._fault_outcome(s, claim, fault, False)

    def _fault_outcome(
        self, s: Session, claim: Claim, exc: Exception, retryable: bool
    ) -> StepResult:
        op, token, now = claim.op, claim.token, self.clock()
        error = str(exc)
        held = (
            GoalOperation.operation_id == op.operation_id,
            GoalOperation.lease_token == token,
            GoalOperation.status == OperationStatus.DISPATCHED,
        )
        if getattr(exc, "code", None) == STALE_REVISION:
            lock_session(s, op.workspace_id, op.session_id)
            result = s.execute(
                update(GoalOperation)
                .where(*held)
                .values(
                    status=OperationStatus.SUPERSEDED,
                    last_error=error,
                    completed_at=now,
                    lease_owner=None,
                    lease_token=None,
                    lease_expires_at=None,
                )
            )
            if rowcount(result) != 1:
                return StepResult(op.operation_id, "skipped")
            s.execute(
                update(GoalState)
                .where(
                    GoalState.workspace_id == op.workspace_id,
                    GoalState.session_id == op.session_id,
                    GoalState.pending_operation_id == op.operation_id,
                )
                .values(
                    pending_operation_id=None, last_error=error, sync_status=SyncStatus.DIVERGED
                )
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
            backoff_s(op.attempt),
            error,
            extra=ids,
        )
        result = s.execute(
            update(GoalOperation)
            .where(*held)
            .values(
                last_error=error,
                next_attempt_at=now + timedelta(seconds=backoff_s(op.attempt)),
                lease_owner=None,
                lease_token=None,
                lease_expires_at=None,
            )
        )
        return StepResult(op.operation_id, "retry" if rowcount(result) == 1 else "skipped")

    # For tests that drive an attempt by hand, each in its own transaction.
    def _record_answer(self, claim: Claim, answer: dict[str, Any]) -> StepResult:
        return run_transaction(self.engine, lambda s: self._answer_outcome(s, claim, answer))

    def _record_fault(self, claim: Claim, exc: Exception, retryable: bool) -> StepResult:
        return run_transaction(self.engine, lambda s: self._fault_outcome(s, claim, exc, retryable))

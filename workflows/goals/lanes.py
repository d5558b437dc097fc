"""Lanes and claims, the claim side of goal dispatch (docs/lifecycles.md: goals, leases): a
dispatch's lanes taken, their operations read under the session locks, judged by the claim rule
(claim_rule.py) and claimed under a lease; a claim given back unattempted; the lanes released
and taken again for their next due work. Every method runs in its caller's transaction; the
steps (workflows/steps/goals/) call them and write nothing themselves."""

import dataclasses
from collections.abc import Callable, Collection, Iterable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from ...models.base import utcnow
from ...models.db import rowcount
from ...models.dialects import dialect_of
from .. import ids, leases, records
from ..adapters import logs
from ..kinds.goal import OPEN_OPERATION_STATUSES, OperationStatus, ProviderPhase
from ..kinds.goal import GoalOperation as GoalOperationRecord
from . import claim_rule, outcomes
from .claims import Claim, Lane, StepResult
from .statements import (
    CLAIM,
    CLAIM_AND_APPLYING,
    CLAIM_LOOKUP,
    GIVE_BACK,
    LOCK_SESSIONS_OF_OPS,
    LOOKUP_AND_CLAIM,
    MAX_LANES_PER_STEP,
    NEXT_DUE,
    NEXT_DUE_AND_ANYWHERE,
    RESCHEDULE_HELD,
    STATE_SYNC,
    STATES_APPLYING,
    TAKE_LANES_AND_LOCK,
    lookup_and_claim_params,
)

# A step's end takes other sessions' due work (PostgreSQL) only once it has been due this
# long: work due for less has its message on the way, most often to the other pool process,
# idle. Taking it at the step's end then only made the two collide (its message's dispatch
# waited for the lane the step was creating, to find its work taken). Under load the
# messages queue for longer than this, and their work is taken along as before. A dispatch
# whose message came after its work was taken knows they queue: its drain is then `behind`
# and takes all due work, however young (`young`: where each submit's message costs a task
# and the messages fall behind). The figures: docs/benchmarks.md, figures the code rests on.
STEAL_AFTER = timedelta(milliseconds=10)


def first_per_session(rows) -> dict[tuple[str, str], str]:
    """The lowest-revision open operation of each session among `rows`."""
    first: dict[tuple[str, str], str] = {}
    for row in sorted(rows, key=lambda r: r.goal_revision):
        if row.status in OPEN_OPERATION_STATUSES:
            first.setdefault((row.workspace_id, row.session_id), row.operation_id)
    return first


def with_due_along(
    rows, is_given: Callable[[Any], bool]
) -> tuple[dict[tuple[str, str], str], set[tuple[str, str]]]:
    """Per session, the operation to start its lane with: the given rows' first, then
    other due ones' (rows of a read that steals), up to MAX_LANES_PER_STEP lanes; and the
    sessions taken along (those that only other due rows brought)."""
    rows = list(rows)
    first = first_per_session(row for row in rows if is_given(row))
    along: set[tuple[str, str]] = set()
    for key, operation_id in first_per_session(r for r in rows if not is_given(r)).items():
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


class GoalClaims:
    """Lanes and claims of one worker (`worker_id`), each lease `lease_s` long."""

    def __init__(
        self,
        engine: Engine,
        *,
        worker_id: str,
        lease_s: float,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.lease_s = lease_s
        self.clock = clock
        # Whether a dispatch takes due work wherever it is: with its own operations already
        # taken, and at the end of each step. On PostgreSQL it skips the lanes others are
        # taking (SKIP LOCKED). On SQLite every write transaction waits for the one write
        # lock, so such a dispatch queues behind the one already draining the backlog to find
        # its work taken (docs/benchmarks.md: figures the code rests on); there it takes other
        # due work only along its own.
        self.steals_anywhere = dialect_of(engine).locks_rows

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

    @staticmethod
    def release(s: Session, lanes: list[Lane]) -> None:
        for token in {lane.token for lane in lanes}:
            leases.release_many(s, [lane.name for lane in lanes if lane.token == token], token)

    def next_work(
        self, s: Session, keys: list[tuple[str, str]], anywhere: bool, young: bool = False
    ) -> dict[Lane, Claim | StepResult]:
        """Take the lanes of these sessions that have due work, and claim it; `anywhere`,
        other due work too (its lanes not waited for, as in claim_many): due for
        STEAL_AFTER, or (`young`) at all. A lane someone holds is left to its holder, who
        runs this check after its release commits."""
        now = self.clock()
        stale = now if young else now - STEAL_AFTER
        params = {"b_keys": sorted(set(keys)), "b_now": now, "b_stale": stale}
        conn = s.connection()
        if not anywhere or not self.steals_anywhere:
            return self._open(s, first_per_session(conn.execute(NEXT_DUE, params)))
        first, along = with_due_along(conn.execute(NEXT_DUE_AND_ANYWHERE, params).all(), _mine)
        return self._open(s, first, along)

    # -- operations ------------------------------------------------------------------------
    def claim(
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
        then their rows read (operations, goal states, maintenance holds) and those the claim
        rule lets go claimed. On PostgreSQL the read and the claim are one statement
        (LOOKUP_AND_CLAIM), whose conditions are the claim rule's (goals/claim_rule.py; a
        test proves the two equal); elsewhere the read, the rule, and a claim that takes a
        row only while it is open and unleased."""
        now = self.clock()
        conn = session.connection()
        wanted = {"b_ops": list(operation_ids)}
        if not sessions_locked:
            conn.execute(LOCK_SESSIONS_OF_OPS, wanted).all()
        token = leases.new_token()
        expires = now + timedelta(seconds=self.lease_s)
        params = lookup_and_claim_params(operation_ids, now, self.worker_id, token, expires)
        together = dialect_of(conn).writes_together
        lookup = conn.execute(LOOKUP_AND_CLAIM if together else CLAIM_LOOKUP, params)
        rows = {row.operation_id: row for row in lookup}
        verdicts: dict[str, Claim | StepResult] = {}
        taken: set[str] = set()
        claimable: list[GoalOperationRecord] = []
        for operation_id in operation_ids:
            row = rows.get(operation_id)
            if together and row is not None and row.taken:
                taken.add(operation_id)
                claimable.append(records.from_row(GoalOperationRecord, row))
                continue
            obstacle = claim_rule.obstacle(row, operation_id, now)
            if obstacle is not None:
                verdicts[operation_id] = outcomes.verdict(session, row, operation_id, obstacle, now)
            else:
                claimable.append(records.from_row(GoalOperationRecord, row))
        late = [op for op in claimable if op.operation_id not in taken]
        if late:
            # What the rule lets go and the statement did not take (SQLite; on PostgreSQL a
            # row another transaction changed after the statement's snapshot, which the
            # update then found no longer passing), claimed on its own: taken if it still
            # may go.
            taken |= self._claim_now(conn, params, late)
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
        op: GoalOperationRecord,
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
    def _claim_now(conn, params: dict[str, Any], ops: list[GoalOperationRecord]) -> set[str]:
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

    def unclaim(self, session: Session, claim: Claim, due_at: datetime | None = None) -> None:
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

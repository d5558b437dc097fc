"""Goal control submit (docs/lifecycles.md: accept, goals): validate, replay or conflict, supersede,
bump the revision, insert the operation and its audit event, in the caller's transaction."""

import dataclasses
import functools
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, select, update
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import Session

from ...models.db import bound, execute_writes, insert_bound, rowcount
from ...models.dialects import dialect_of
from ...models.enums import SyncStatus
from .. import accept, ids, records
from ..errors import (
    GoalGenerationSuperseded,
    GoalOperationConflict,
    GoalStateAbsent,
    InvalidArgument,
)
from ..kinds.goal import GoalAction, OperationStatus, Origin, ProviderPhase
from ..kinds.goal import GoalOperation as GoalOperationRecord
from ..leases import LEASES
from ..sessions.rows import (
    INSERT_EVENT,
    INSERT_SESSION,
    SESSIONS,
    SET_SEQUENCE,
    event_params,
    new_session_params,
    same_session,
)
from ..validation import (
    MAX_OBJECTIVE_BYTES,
    check_id,
    check_optional_int,
    check_submit_id,
    check_text,
)
from .lifecycle import GOAL
from .tables import OPS, STATES, key_params


def check_action(value: Any) -> GoalAction:
    if not isinstance(value, str):
        raise InvalidArgument(
            f"goal action must be a string, got {type(value).__name__}", field="action"
        )
    try:
        return GoalAction(value)
    except ValueError:
        choices = ", ".join(a.value for a in GoalAction)
        raise InvalidArgument(
            f"unknown goal action {value!r}; expected one of {choices}", field="action"
        ) from None


def check_objective(action: GoalAction, objective: Any) -> str | None:
    if action is not GoalAction.SET:
        if objective is not None:
            raise InvalidArgument(f"goal {action.value} takes no objective", field="objective")
        return None
    if not isinstance(objective, str) or not objective.strip():
        raise InvalidArgument("goal set needs a non-empty objective string", field="objective")
    return check_text("objective", objective, MAX_OBJECTIVE_BYTES)


@dataclass(frozen=True)
class GoalRequest:
    workspace_id: str
    session_id: str
    action: GoalAction
    objective: str | None
    client_submit_id: str
    expected_revision: int | None = None
    origin: Origin = Origin.CLIENT
    # A fence-made clear names its fence; its id comes from a family of its own that no
    # client submit ID can produce (ids.fence_clear_operation_id).
    fence_id: str | None = None

    @classmethod
    def parse(
        cls,
        workspace_id: Any,
        session_id: Any,
        action: Any,
        objective: Any = None,
        *,
        client_submit_id: Any,
        expected_revision: Any = None,
    ) -> "GoalRequest":
        """Validate raw input (from Python, the CLI or a task message)."""
        parsed_action = check_action(action)
        return cls(
            workspace_id=check_id("workspace_id", workspace_id),
            session_id=check_id("session_id", session_id),
            action=parsed_action,
            objective=check_objective(parsed_action, objective),
            client_submit_id=check_submit_id("client_submit_id", client_submit_id),
            expected_revision=check_optional_int("expected_revision", expected_revision),
        )

    @functools.cached_property  # a submit asks it three times; each is a uuid5
    def operation_id(self) -> str:
        if self.fence_id is not None:
            return ids.fence_clear_operation_id(self.workspace_id, self.session_id, self.fence_id)
        return ids.goal_operation_id(self.workspace_id, self.session_id, self.client_submit_id)


def desired_after(action: GoalAction, objective: str | None, desired: dict | None) -> dict | None:
    if action is GoalAction.SET:
        return {"objective": objective, "status": "active"}
    if action is GoalAction.CLEAR:
        return None
    status = "paused" if action is GoalAction.PAUSE else "active"
    return {**(desired or {}), "status": status}


# Submit's reads: the session row, locked, with its event counter; then, in a statement of
# its own, its goal state and whether the operation already exists. Not one statement: on
# PostgreSQL a statement reads every table at the snapshot it started with, and only the
# rows it locks are read again after a wait for their lock, so a state read beside the lock
# could predate the submit that held the lock (two submits would both take revision n+1).
# The writes are prebuilt too, with bound parameters of their own prefixes, so that they go
# to the database together (execute_writes): on PostgreSQL a submit is two reads and one
# write statement (a new session's: one and one).
_LOCK_SESSION = select(SESSIONS.c.event_sequence).where(*key_params(SESSIONS)).with_for_update()
_SUBMIT_LOOKUP = (
    select(
        STATES.c.revision,
        STATES.c.desired,
        STATES.c.pending_operation_id,
        OPS.c.operation_id.label("existing"),
    )
    .select_from(
        SESSIONS.outerjoin(STATES, same_session(STATES.c, SESSIONS.c)).outerjoin(
            OPS, OPS.c.operation_id == bindparam("b_op")
        )
    )
    .where(*key_params(SESSIONS))
)
_STATE_COLUMNS = (
    "revision",
    "desired",
    "tombstoned",
    "sync_status",
    "pending_operation_id",
    "last_error",
)
_INSERT_STATE = insert_bound(
    STATES, "st_", ("workspace_id", "session_id", "observed", *_STATE_COLUMNS)
)
_UPDATE_STATE = (
    update(STATES)
    .where(*key_params(STATES))
    .values({name: bindparam("st_" + name, type_=STATES.c[name].type) for name in _STATE_COLUMNS})
)
_INSERT_OPERATION = insert_bound(
    OPS, "op_", [f.name for f in dataclasses.fields(GoalOperationRecord)]
)
_LOAD_OPERATION = select(OPS).where(OPS.c.operation_id == bindparam("b_op"))
# An open operation superseded (`b_superseded`): by a newer submit, beside its other
# writes, or by a claim that finds its goal state moved on (supersede).
_SUPERSEDE = (
    update(OPS)
    .where(
        OPS.c.operation_id == bindparam("b_superseded"),
        OPS.c.status.in_(GOAL.sources(OperationStatus.SUPERSEDED)),
    )
    .values(
        status=OperationStatus.SUPERSEDED,
        completed_at=bindparam("b_now"),
        lease_owner=None,
        lease_token=None,
        lease_expires_at=None,
    )
)


_CREATE_LANE = postgresql.insert(LEASES).values(name=bindparam("b_lane")).on_conflict_do_nothing()


def load_operation(session: Session, operation_id: str) -> GoalOperationRecord | None:
    row = session.connection().execute(_LOAD_OPERATION, {"b_op": operation_id}).first()
    return None if row is None else records.from_row(GoalOperationRecord, row)


def submit(
    session: Session, request: GoalRequest, now: datetime
) -> tuple[GoalOperationRecord, bool]:
    """Accept a goal control intent in the caller's transaction (docs/lifecycles.md: goals, submit
    1-7).

    Returns (operation, created). A replay returns the existing operation and writes
    nothing. The session row is locked first, as by every writer of a session.
    """
    conn = session.connection()
    key = {"b_ws": request.workspace_id, "b_sid": request.session_id}
    locked = conn.execute(_LOCK_SESSION, key).first()
    # A new session: its row is created (and so locked) by the writes below, and nothing
    # of it exists (a concurrent first submit makes one of the two inserts fail; its
    # transaction is retried and finds the row).
    found = None
    if locked is not None:
        found = conn.execute(_SUBMIT_LOOKUP, {**key, "b_op": request.operation_id}).first()
    if found is not None and found.existing is not None:
        existing = accept.replay(
            load_operation(session, request.operation_id),
            (request.action.value, request.objective),
            lambda op: (op.action, op.objective),
            lambda op: GoalOperationConflict(
                f"client_submit_id {request.client_submit_id!r} was used for "
                f"{op.action} {op.objective!r}",
                operation_id=op.operation_id,
            ),
        )
        if existing is None:  # the lookup just found it, under the session lock
            raise LookupError(f"goal operation {request.operation_id} disappeared")
        return existing, False
    has_state = found is not None and found.revision is not None
    revision, desired, pending = (
        (found.revision, found.desired, found.pending_operation_id)
        if found is not None and has_state
        else (0, None, None)
    )

    if request.expected_revision is not None and request.expected_revision != revision:
        raise GoalGenerationSuperseded(
            f"expected revision {request.expected_revision}, current is {revision}",
            expected_revision=request.expected_revision,
            current_revision=revision,
        )
    if request.action in (GoalAction.PAUSE, GoalAction.RESUME) and desired is None:
        raise GoalStateAbsent(f"cannot {request.action.value}: the session has no goal")

    # The session's event counter: read under the session lock, so the next value is
    # exact; a new session's row is inserted with its first event counted.
    sequence = 1 if locked is None else locked.event_sequence + 1
    params: dict[str, Any] = {**key, "b_now": now, "b_seq": sequence}
    writes: list[Any] = []
    if locked is None:
        writes.append(INSERT_SESSION)
        params |= new_session_params(request.workspace_id, request.session_id, sequence)
        if dialect_of(conn).locks_rows:
            # The session's lane, free: a dispatch then takes it by an update, which one
            # stealing the same backlog can skip while it is being taken (an insert of the
            # same new row would wait for the other's commit).
            writes.append(_CREATE_LANE)
            params["b_lane"] = ids.lane_name(request.workspace_id, request.session_id)
    else:
        writes.append(SET_SEQUENCE)
    if pending:
        writes.append(_SUPERSEDE)
        params["b_superseded"] = pending
    state = {
        "revision": revision + 1,
        "desired": desired_after(request.action, request.objective, desired),
        "tombstoned": request.action is GoalAction.CLEAR,
        "sync_status": SyncStatus.PENDING.value,
        "pending_operation_id": request.operation_id,
        "last_error": None,
    }
    if has_state:
        writes.append(_UPDATE_STATE)
    else:
        writes.append(_INSERT_STATE)
        state |= {
            "workspace_id": request.workspace_id,
            "session_id": request.session_id,
            "observed": None,
        }
    params |= bound("st_", state)
    op = GoalOperationRecord(
        operation_id=request.operation_id,
        workspace_id=request.workspace_id,
        session_id=request.session_id,
        client_submit_id=request.client_submit_id,
        origin=request.origin.value,
        action=request.action.value,
        objective=request.objective,
        goal_revision=revision + 1,
        status=OperationStatus.PREPARED.value,
        provider_phase=ProviderPhase.PREPARED.value,
        evidence=None,
        last_error=None,
        attempt=0,
        lease_owner=None,
        lease_token=None,
        lease_expires_at=None,
        next_attempt_at=now,
        first_dispatched_at=None,
        accepted_at=None,
        completed_at=None,
        created_at=now,
    )
    writes += [_INSERT_OPERATION, INSERT_EVENT]
    params |= bound("op_", vars(op))  # its fields, not copied (asdict copies deeply)
    params |= event_params(
        op.workspace_id,
        op.session_id,
        sequence,
        kind="goal-control",
        record_id=f"goal-control:{op.operation_id}",
        revision=op.goal_revision,
        payload={
            "action": op.action,
            "objective": op.objective,
            "origin": op.origin,
            "client_submit_id": op.client_submit_id,
        },
        now=now,
    )
    execute_writes(session, writes, params)
    return op, True


def supersede(session: Session, operation_id: str, now: datetime) -> bool:
    result = session.connection().execute(_SUPERSEDE, {"b_superseded": operation_id, "b_now": now})
    return rowcount(result) == 1

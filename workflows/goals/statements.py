"""The dispatcher's prebuilt statements (docs/lifecycles.md: goals, leases): built once, with bound
parameters (`b_ops`, `b_keys` expand to lists), since building a statement costs more than running a
cached one on the hot path."""

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    Integer,
    String,
    bindparam,
    exists,
    func,
    literal,
    or_,
    select,
    text,
    tuple_,
    union_all,
    update,
)
from sqlalchemy.dialects import postgresql

from ...models.base import UTCDateTime, table_of
from ...models.enums import SyncStatus
from ...models.operations import GoalFence
from ..kinds.goal import OperationStatus, ProviderPhase
from ..leases import CLAIMED
from ..maintenance.runs import holds
from ..sessions.hosts import HOSTS
from ..sessions.rows import SESSIONS, same_session
from .operations import (
    DISPATCH_BUDGET_S,
    DISPATCH_MAX_ATTEMPTS,
    due_operations,
    open_unheld,
)
from .tables import (
    OPS,
    OPS_IN,
    STATES,
    key_params,
    keys_in,
    not_installed_at,
    sessions_of_ops,
)

FENCES = table_of(GoalFence)
OP_KEY = OPS.c.operation_id == bindparam("b_op")
LANE_COLUMNS = (
    OPS.c.operation_id,
    OPS.c.workspace_id,
    OPS.c.session_id,
    OPS.c.status,
    OPS.c.goal_revision,
)
# Of the given operations, those open and not leased: a message for one that settled or
# that another worker holds costs this one read.
OPS_LANES = select(*LANE_COLUMNS).where(OPS_IN, *open_unheld(bindparam("b_now")))
# A step drains at most this many lanes, and calls the runtime for all of them at once, so
# a step's calls take one call's time: below the lease, as a single call is (the lease is
# configured longer than the runtime timeout). A dispatch under a backlog fills its step
# with other due operations, so one message and a few transactions serve many operations.
MAX_LANES_PER_STEP = 32
DUE_ANYWHERE = (
    select(*LANE_COLUMNS)
    .where(*due_operations(bindparam("b_now")))
    .order_by(OPS.c.next_attempt_at)
    .limit(MAX_LANES_PER_STEP)
)
# OPS_LANES and DUE_ANYWHERE in one read, a dispatch's (`wanted` tells which rows are the
# given operations): one round trip less on every message.
_DUE = DUE_ANYWHERE.subquery()
OPS_LANES_AND_DUE = union_all(
    OPS_LANES.add_columns(literal(True).label("wanted")),
    select(*_DUE.c, literal(False).label("wanted")),
)
NEXT_DUE = (
    select(*LANE_COLUMNS)
    .where(keys_in(OPS), *due_operations(bindparam("b_now")))
    .order_by(OPS.c.goal_revision)
)
# NEXT_DUE and DUE_ANYWHERE in one read, for a step that steals (`mine` tells which rows are
# of its own lanes): work that came due during the step is taken at its end, in the
# transaction already open, instead of after its message has gone through the broker —
# elsewhere only work due since `b_stale` (see dispatch.STEAL_AFTER).
_STALE_DUE = DUE_ANYWHERE.where(OPS.c.next_attempt_at <= bindparam("b_stale")).subquery()
NEXT_DUE_AND_ANYWHERE = union_all(
    # (unordered: SQLite takes no ORDER BY in a part of a UNION; _first_per_session sorts)
    NEXT_DUE.order_by(None).add_columns(literal(True).label("mine")),
    select(*_STALE_DUE.c, literal(False).label("mine")),
)
# A claim first locks the session rows of its operations (in key order), then reads what it
# needs in a statement of its own: on PostgreSQL a statement reads at the snapshot it started
# with, so a read beside the lock could miss a maintenance run that started while the claim
# waited for the lock, and call the agent during that run.
LOCK_SESSIONS_OF_OPS = (
    select(SESSIONS.c.workspace_id)
    .where(sessions_of_ops(SESSIONS))
    .order_by(SESSIONS.c.workspace_id, SESSIONS.c.session_id)
    .with_for_update()
)
# The lanes taken (leases.claim_many, its rows `lease`) and LOCK_SESSIONS_OF_OPS for the
# operations of the lanes it took, in one statement (PostgreSQL): one round trip less on
# every claim. `b_lane_names` and `b_lane_ops` pair each lane with its operation. The lanes
# are taken first (the locks' order stays the lanes, then the sessions), and the claim's read
# is still a statement of its own, started after the lock.
_LANE_OPS = (
    func.unnest(
        bindparam("b_lane_names", type_=postgresql.ARRAY(String)),
        bindparam("b_lane_ops", type_=postgresql.ARRAY(String)),
    )
    .table_valued("lane_name", "lane_op")
    .render_derived(name="lane_ops")
)
_LOCKED = (
    select(SESSIONS.c.workspace_id)
    .where(
        tuple_(SESSIONS.c.workspace_id, SESSIONS.c.session_id).in_(
            select(OPS.c.workspace_id, OPS.c.session_id).where(
                OPS.c.operation_id.in_(
                    select(_LANE_OPS.c.lane_op).where(
                        _LANE_OPS.c.lane_name.in_(select(CLAIMED.c.name))
                    )
                )
            )
        )
    )
    .order_by(SESSIONS.c.workspace_id, SESSIONS.c.session_id)
    .with_for_update()
    .cte("locked")
)
TAKE_LANES_AND_LOCK = select(CLAIMED.c.name, literal(True).label("lease")).union_all(
    select(_LOCKED.c.workspace_id, literal(False))
)
# A named message's claim as one call (Dispatcher._claim_named): the function that
# migration 0016 makes (PostgreSQL) takes the named session's lane, locks the session, then
# reads and claims the operation, each a statement of its own; it returns the claimed row
# as LOOKUP_AND_CLAIM reads it, or nothing, with nothing left written.
NAMED_CLAIM = text(
    "SELECT * FROM agent_radar_named_claim(:b_op, :b_ws, :b_sid, :b_lane, :b_lane_token, "
    ":b_owner, :b_token, :b_now, :b_expires, :b_budget_since, :b_max_attempts)"
).bindparams(
    *(bindparam(name, type_=String) for name in ("b_op", "b_ws", "b_sid", "b_lane")),
    *(bindparam(name, type_=String) for name in ("b_lane_token", "b_owner", "b_token")),
    *(bindparam(name, type_=UTCDateTime()) for name in ("b_now", "b_expires", "b_budget_since")),
    bindparam("b_max_attempts", type_=Integer),
)


def named_claim_params(
    op: str, key: tuple[str, str], lane: str, lane_token: str, claim: dict[str, Any]
) -> dict[str, Any]:
    """NAMED_CLAIM's parameters: `claim` is lookup_and_claim_params' for this operation."""
    return {
        "b_op": op,
        "b_ws": key[0],
        "b_sid": key[1],
        "b_lane": lane,
        "b_lane_token": lane_token,
        "b_owner": claim["b_owner"],
        "b_token": claim["b_token"],
        "b_now": claim["b_now"],
        "b_expires": claim["b_expires"],
        "b_budget_since": claim["b_budget_since"],
        "b_max_attempts": DISPATCH_MAX_ATTEMPTS,
    }


# A claim's read: the operations, goal states, and whether a maintenance run holds each
# session (their session rows locked by LOCK_SESSIONS_OF_OPS).
CLAIM_LOOKUP = (
    select(
        OPS,
        STATES.c.revision.label("state_revision"),
        STATES.c.pending_operation_id.label("state_pending"),
        STATES.c.sync_status.label("state_sync"),  # what a give-back restores
        holds(OPS.c.workspace_id, OPS.c.session_id).label("held"),
        # Whether a fence of the session is not known to be installed at its (host, epoch):
        # the fences go there before this goal call (docs/lifecycles.md: sessions).
        exists()
        .where(
            same_session(FENCES.c, SESSIONS.c),
            not_installed_at(FENCES.c, SESSIONS.c.host_id, SESSIONS.c.runtime_epoch),
        )
        .label("reinstall"),
        # Where the call goes (docs/lifecycles.md: sessions), read here so the step needs no read
        # per call.
        SESSIONS.c.host_id.label("host_id"),
        HOSTS.c.url.label("host_url"),
        HOSTS.c.token.label("host_token"),
    )
    .select_from(
        OPS.join(SESSIONS, same_session(SESSIONS.c, OPS.c))
        .outerjoin(STATES, same_session(STATES.c, OPS.c))
        .outerjoin(HOSTS, HOSTS.c.host_id == SESSIONS.c.host_id)
    )
    .where(OPS_IN)
)
CLAIM = (
    update(OPS)
    .where(OPS_IN, *open_unheld(bindparam("b_now")))
    .values(
        lease_owner=bindparam("b_owner"),
        lease_token=bindparam("b_token"),
        lease_expires_at=bindparam("b_expires"),
        status=OperationStatus.DISPATCHED,
        provider_phase=ProviderPhase.DISPATCHED,
        attempt=OPS.c.attempt + 1,
        first_dispatched_at=func.coalesce(
            OPS.c.first_dispatched_at, bindparam("b_first", type_=OPS.c.first_dispatched_at.type)
        ),
    )
    .returning(OPS.c.operation_id)
)
STATES_APPLYING = update(STATES).where(keys_in(STATES)).values(sync_status=SyncStatus.APPLYING)


# CLAIM and STATES_APPLYING for the sessions of the operations it took, as one statement
# (PostgreSQL: the state update reads the claim's RETURNING rows): one round trip less on
# every claim. Returns the ids taken, as CLAIM does.
def _applying(claimed, name: str):
    """STATES_APPLYING for the sessions of a claim's RETURNING rows, as a CTE."""
    return (
        update(STATES)
        .where(
            tuple_(STATES.c.workspace_id, STATES.c.session_id).in_(
                select(claimed.c.workspace_id, claimed.c.session_id)
            )
        )
        .values(sync_status=SyncStatus.APPLYING)
        .cte(name)
    )


_CLAIMED = CLAIM.returning(OPS.c.workspace_id, OPS.c.session_id).cte("claimed")
CLAIM_AND_APPLYING = select(_CLAIMED.c.operation_id).add_cte(_applying(_CLAIMED, "applying"))
# CLAIM_LOOKUP and the claim in one statement (PostgreSQL): one round trip less on every
# claim. The claim takes exactly the operations that the claim rule lets through
# (goals/claim_rule.py; tests/rules/test_claim_rule.py proves the two equal, state by state)
# (open and unheld, its goal state's current operation, no maintenance run holding the
# session, not accepted, within its dispatch budget: `b_budget_since` is now − the time
# budget) and says which it took (`taken`); the rows are read at the statement's snapshot,
# taken after the session lock, as CLAIM_LOOKUP's own statement would be, so they show each
# operation as it was before this claim. The update takes a row only if that version passed
# (PostgreSQL re-checks a row another transaction changed meanwhile, and may then leave it),
# so the rule and the claim agree. The claim rule judges the rest (superseded, held,
# failed …) from those rows.
_TAKEN = (
    CLAIM.where(
        same_session(STATES.c, OPS.c),
        STATES.c.revision == OPS.c.goal_revision,
        STATES.c.pending_operation_id == OPS.c.operation_id,
        ~holds(OPS.c.workspace_id, OPS.c.session_id),
        OPS.c.provider_phase != ProviderPhase.ACCEPTED,
        OPS.c.attempt < DISPATCH_MAX_ATTEMPTS,
        or_(
            OPS.c.first_dispatched_at.is_(None),
            OPS.c.first_dispatched_at > bindparam("b_budget_since"),
        ),
    )
    .returning(OPS.c.workspace_id, OPS.c.session_id)
    .cte("taken")
)
LOOKUP_AND_CLAIM = (
    CLAIM_LOOKUP.add_columns(_TAKEN.c.operation_id.is_not(None).label("taken"))
    .outerjoin(_TAKEN, _TAKEN.c.operation_id == OPS.c.operation_id)
    .add_cte(_applying(_TAKEN, "taken_applying"))
)


def lookup_and_claim_params(
    operation_ids: list[str], now: datetime, owner: str, token: str, expires: datetime
) -> dict[str, Any]:
    """LOOKUP_AND_CLAIM's parameters: these operations claimed at `now` under `token` until
    `expires` (the claim's own CLAIM takes the same, but `b_budget_since`)."""
    return {
        "b_ops": list(operation_ids),
        "b_now": now,
        "b_first": now,
        "b_owner": owner,
        "b_token": token,
        "b_expires": expires,
        "b_budget_since": now - timedelta(seconds=DISPATCH_BUDGET_S),
    }


# LOOKUP_AND_CLAIM's claim of one operation undone: the row as the statement read it (the
# lease columns included), and its goal state's sync status.
GIVE_BACK = (
    update(OPS)
    .where(OP_KEY, OPS.c.lease_token == bindparam("b_token"))
    .values(
        status=bindparam("b_status"),
        provider_phase=bindparam("b_phase"),
        attempt=bindparam("b_attempt"),
        first_dispatched_at=bindparam("b_first", type_=OPS.c.first_dispatched_at.type),
        lease_owner=bindparam("b_owner"),
        lease_token=bindparam("b_old_token"),
        lease_expires_at=bindparam("b_expires", type_=OPS.c.lease_expires_at.type),
    )
)
STATE_SYNC = update(STATES).where(*key_params(STATES)).values(sync_status=bindparam("b_sync"))
RESCHEDULE = update(OPS).where(OP_KEY).values(next_attempt_at=bindparam("b_at"))
# The same, only under the claim's lease token (a give-back's: see Dispatcher.unclaim).
RESCHEDULE_HELD = (
    update(OPS)
    .where(OP_KEY, OPS.c.lease_token == bindparam("b_token"))
    .values(next_attempt_at=bindparam("b_at"))
)

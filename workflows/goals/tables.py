"""The goal tables as SQLAlchemy Core objects, and the conditions the prebuilt statements of
goal control share: hot paths execute statements built once, with bound parameters."""

from sqlalchemy import bindparam, or_, select, tuple_, update

from ...models.base import table_of
from ...models.operations import GoalOperation
from ...models.tables import GoalState
from ..sessions.rows import SESSIONS

OPS = table_of(GoalOperation)
STATES = table_of(GoalState)


def key_params(table):
    """`(workspace_id, session_id) = (:b_ws, :b_sid)` for a table's columns."""
    return (table.c.workspace_id == bindparam("b_ws"), table.c.session_id == bindparam("b_sid"))


def keys_in(column_owner):
    """`(workspace_id, session_id) IN :b_keys` for a table's columns."""
    return tuple_(column_owner.c.workspace_id, column_owner.c.session_id).in_(
        bindparam("b_keys", expanding=True)
    )


# `b_ops` expands to a list of operation ids.
OPS_IN = OPS.c.operation_id.in_(bindparam("b_ops", expanding=True))


def sessions_of_ops(column_owner):
    """`(workspace_id, session_id)` is that of one of the operations `:b_ops`. Reached through
    the operations' primary key, its plan does not rest on the tables' statistics: a list of
    session keys (keys_in) in one busy workspace, on a table that grew since its last ANALYZE,
    was planned as a scan of the whole workspace (docs/benchmarks.md, eleventh series)."""
    return tuple_(column_owner.c.workspace_id, column_owner.c.session_id).in_(
        select(OPS.c.workspace_id, OPS.c.session_id).where(OPS_IN)
    )


def not_installed_at(fences, host_id, epoch):
    """SQL: a fence (columns of `fences`) not known to be installed at (host_id, epoch): the
    fences go there before a goal call (fences/reinstall.py)."""
    return or_(
        fences.installed_host.is_distinct_from(host_id),
        fences.installed_epoch.is_distinct_from(epoch),
    )


# A session's restore due now (a goal applied at a host it left meanwhile: goals/operations.py),
# by the rule of fences/restores.request, which this layer cannot import.
RESTORE_DUE = (
    update(SESSIONS)
    .where(
        *key_params(SESSIONS),
        or_(SESSIONS.c.restore_due_at.is_(None), SESSIONS.c.restore_due_at > bindparam("b_now")),
    )
    .values(restore_due_at=bindparam("b_now"))
)

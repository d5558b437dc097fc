"""The goal tables as SQLAlchemy Core objects, and the conditions the prebuilt statements of
goal control share: hot paths execute statements built once, with bound parameters."""

from sqlalchemy import bindparam, tuple_

from models.base import table_of
from models.tables import GoalOperation, GoalState

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

"""The goal tables as SQLAlchemy Core objects, and the conditions the prebuilt statements of
goal control share: hot paths execute statements built once, with bound parameters."""

from sqlalchemy import bindparam, tuple_

from models.base import table_of
from models.db import in_list
from models.tables import GoalOperation, GoalState

OPS = table_of(GoalOperation)
STATES = table_of(GoalState)


def key_params(table):
    """`(workspace_id, session_id) = (:b_ws, :b_sid)` for a table's columns."""
    return (table.c.workspace_id == bindparam("b_ws"), table.c.session_id == bindparam("b_sid"))


def keys_in(column_owner):
    """`(workspace_id, session_id) IN :b_keys` for a table's columns (`b_keys` expands to a
    list of (workspace_id, session_id) pairs). An expanding IN on PostgreSQL too: the server
    plans a list of pairs given as arrays without knowing their length, and then joins a
    whole table where the literal list uses its key index."""
    return tuple_(column_owner.c.workspace_id, column_owner.c.session_id).in_(
        bindparam("b_keys", expanding=True)
    )


# `b_ops`: a list of operation ids.
OPS_IN = in_list(OPS.c.operation_id, "b_ops")

"""The open goal operations in due order, as a partial index (docs/lifecycles.md: goals).

A dispatch and the sweeper read due operations (open, unleased, due) ordered by when they
are due. Through ix_goal_operations_due (status, next_attempt_at) PostgreSQL answered with a
bitmap scan that re-read every dead index entry that operations left behind as they moved
from prepared to dispatched to completed, until vacuum came: 3.6 ms per read after 18,000
operations. This index holds open operations only, in due order; and on PostgreSQL autovacuum visits
goal_operations once 2 % of it (plus 500 rows) is dead, instead of the default 20 %, as is
usual for a table that works as a queue — so dead entries stay few however large the
history grows.

Revision ID: 0009
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

# Written out, not imported: a migration keeps the condition it was written with.
OPEN = "status IN ('prepared', 'dispatched')"


def upgrade() -> None:
    op.create_index(
        "ix_goal_operations_open_due",
        "goal_operations",
        ["next_attempt_at"],
        postgresql_where=sa.text(OPEN),
        sqlite_where=sa.text(OPEN),
    )
    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            "ALTER TABLE goal_operations SET (autovacuum_vacuum_scale_factor = 0.02, "
            "autovacuum_vacuum_threshold = 500, autovacuum_analyze_scale_factor = 0.02)"
        )


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            "ALTER TABLE goal_operations RESET (autovacuum_vacuum_scale_factor, "
            "autovacuum_vacuum_threshold, autovacuum_analyze_scale_factor)"
        )
    op.drop_index("ix_goal_operations_open_due", table_name="goal_operations")

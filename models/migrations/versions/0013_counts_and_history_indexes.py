"""Costs that stay flat as the history grows (docs/operations.md: counts).

- `settled_counts`: settled rows per kind, workspace and status, kept by the sweeper; each
  counted table gets `counted_as` (the status a row is counted under) and a partial index of
  the rows not counted under their status (open, newly settled, reopened). Rows already here
  start uncounted: the sweeper counts them in bounded batches after the upgrade, and the
  counts are exact meanwhile (they add what is not yet counted).
- Indexes for what operators filter on and retention prunes by: age, and workspace and age.

On a large PostgreSQL history the index builds take a while and block writes to their table
while they run (docs/operations.md: counts).

Revision ID: 0013
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

# Written out, not imported: a migration keeps what it was written with.
UNCOUNTED_PG = "counted_as IS DISTINCT FROM status"
UNCOUNTED_SQLITE = "counted_as IS NOT status"
# table: its acceptance time column
COUNTED = {
    "goal_operations": "created_at",
    "goal_fences": "created_at",
    "cancel_operations": "created_at",
    "maintenance_runs": "started_at",
    "prompts": "created_at",
}
AGED = {"session_events": "created_at", "session_stops": "created_at"}


def upgrade() -> None:
    op.create_table(
        "settled_counts",
        sa.Column("kind", sa.String(32), primary_key=True),
        sa.Column("workspace_id", sa.String(255), primary_key=True),
        sa.Column("status", sa.String(32), primary_key=True),
        sa.Column("count", sa.BigInteger(), nullable=False),
    )
    for table, created in COUNTED.items():
        op.add_column(table, sa.Column("counted_as", sa.String(32)))
        op.create_index(f"ix_{table}_created", table, [created])
        op.create_index(f"ix_{table}_workspace_created", table, ["workspace_id", created])
        op.create_index(
            f"ix_{table}_uncounted",
            table,
            ["status", "workspace_id", "counted_as"],
            postgresql_where=sa.text(UNCOUNTED_PG),
            sqlite_where=sa.text(UNCOUNTED_SQLITE),
        )
    for table, created in AGED.items():
        op.create_index(f"ix_{table}_created", table, [created])
    op.create_index("ix_turns_settled", "turns", ["settled_at"])


def downgrade() -> None:
    op.drop_index("ix_turns_settled", "turns")
    for table in AGED:
        op.drop_index(f"ix_{table}_created", table)
    for table in COUNTED:
        for name in ("uncounted", "workspace_created", "created"):
            op.drop_index(f"ix_{table}_{name}", table)
        with op.batch_alter_table(table) as batch:
            batch.drop_column("counted_as")
    op.drop_table("settled_counts")

"""The host is the truth (docs/lifecycles.md: reconcile): when the mirror first saw each turn,
when each session's host was last asked what it runs, the restore's budget, the cancels a move
owes the host a session left, and a turn's identity (host, epoch, turn id).

Revision ID: 0015
"""

import sqlalchemy as sa
from alembic import op

from agent_radar.models.base import UTCDateTime

# Frozen here: the model's copy may change with later migrations.
UNSURE_GOALS = "sync_status IN ('unknown', 'diverged')"

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("turns") as batch:
        batch.add_column(sa.Column("seen_at", UTCDateTime()))
        batch.add_column(sa.Column("host_id", sa.String(255)))
        batch.add_column(sa.Column("host_turn_id", sa.String(255)))
    with op.batch_alter_table("cancel_operations") as batch:
        batch.add_column(sa.Column("host_id", sa.String(255)))
        batch.add_column(sa.Column("run_id", sa.String(36)))
    # An unsettled turn of before the upgrade counts as seen when it started.
    op.execute("UPDATE turns SET seen_at = started_at WHERE settled_at IS NULL")
    with op.batch_alter_table("agent_sessions") as batch:
        batch.add_column(sa.Column("reconciled_at", UTCDateTime()))
        batch.add_column(
            sa.Column("restore_attempt", sa.Integer(), nullable=False, server_default="0")
        )
        batch.add_column(sa.Column("restore_failing_since", UTCDateTime()))
        batch.add_column(sa.Column("restore_error", sa.Text()))
    op.create_index(
        "ix_agent_sessions_restore_failing",
        "agent_sessions",
        ["restore_attempt"],
        postgresql_where=sa.text("restore_attempt > 0"),
        sqlite_where=sa.text("restore_attempt > 0"),
    )
    op.create_index(
        "ix_goal_states_unsure",
        "goal_states",
        ["sync_status"],
        postgresql_where=sa.text(UNSURE_GOALS),
        sqlite_where=sa.text(UNSURE_GOALS),
    )


def downgrade() -> None:
    op.drop_index("ix_goal_states_unsure", table_name="goal_states")
    op.drop_index("ix_agent_sessions_restore_failing", table_name="agent_sessions")
    with op.batch_alter_table("agent_sessions") as batch:
        batch.drop_column("restore_error")
        batch.drop_column("restore_failing_since")
        batch.drop_column("restore_attempt")
        batch.drop_column("reconciled_at")
    with op.batch_alter_table("turns") as batch:
        batch.drop_column("host_turn_id")
        batch.drop_column("host_id")
        batch.drop_column("seen_at")
    with op.batch_alter_table("cancel_operations") as batch:
        batch.drop_column("run_id")
        batch.drop_column("host_id")

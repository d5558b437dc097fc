"""Where each fence is installed (docs/lifecycles.md: sessions): the (host, epoch) at which each durable fence
was last installed, explicitly, per fence, instead of one epoch per session inferred from the
first epoch learnt; whether a fence's clear was settled locally without reaching the agent
(it is delivered once the session is live again); and when a session's restore is due (the
sweeper publishes it: fences installed, clears delivered, a claimed epoch confirmed).

Revision ID: 0010
"""

import sqlalchemy as sa
from alembic import op

from agent_radar.models.base import UTCDateTime

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("goal_fences") as batch:
        batch.add_column(sa.Column("installed_host", sa.String(255)))
        batch.add_column(sa.Column("installed_epoch", sa.Integer()))
        batch.add_column(
            sa.Column("clear_undelivered", sa.Boolean(), nullable=False, server_default=sa.false())
        )
    # What the session-wide epoch said carries over: installed at the session's (host,
    # epoch) where it was current, else nowhere known (installed again once the session is
    # known live).
    op.execute(
        "UPDATE goal_fences SET installed_host = ("
        " SELECT s.host_id FROM agent_sessions s WHERE s.workspace_id = goal_fences.workspace_id"
        " AND s.session_id = goal_fences.session_id AND s.fences_epoch >= s.runtime_epoch),"
        " installed_epoch = ("
        " SELECT s.runtime_epoch FROM agent_sessions s"
        " WHERE s.workspace_id = goal_fences.workspace_id"
        " AND s.session_id = goal_fences.session_id AND s.fences_epoch >= s.runtime_epoch)"
    )
    # A clear settled locally (phase unknown) may never have reached the agent.
    op.execute(
        "UPDATE goal_fences SET clear_undelivered = TRUE WHERE clear_operation_id IN ("
        " SELECT operation_id FROM goal_operations"
        " WHERE status = 'completed' AND provider_phase = 'unknown')"
    )
    with op.batch_alter_table("agent_sessions") as batch:
        batch.drop_column("fences_epoch")
        batch.add_column(sa.Column("restore_due_at", UTCDateTime()))
    op.create_index(
        "ix_agent_sessions_restore_due",
        "agent_sessions",
        ["restore_due_at"],
        postgresql_where=sa.text("restore_due_at IS NOT NULL"),
        sqlite_where=sa.text("restore_due_at IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_agent_sessions_restore_due", table_name="agent_sessions")
    with op.batch_alter_table("agent_sessions") as batch:
        batch.drop_column("restore_due_at")
        batch.add_column(
            sa.Column("fences_epoch", sa.Integer(), nullable=False, server_default="0")
        )
    with op.batch_alter_table("goal_fences") as batch:
        batch.drop_column("clear_undelivered")
        batch.drop_column("installed_epoch")
        batch.drop_column("installed_host")

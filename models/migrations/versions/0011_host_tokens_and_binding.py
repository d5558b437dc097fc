"""Hosts are identities (docs/lifecycles.md: sessions): each registered agent host has a token of its own, and
a session is bound to its host — by ensure_session(host_id=) or by its first report naming
one — so that a report naming another host is refused instead of moving it.

Revision ID: 0011
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runtime_hosts") as batch:
        batch.add_column(sa.Column("token", sa.String(255)))
    with op.batch_alter_table("agent_sessions") as batch:
        batch.add_column(
            sa.Column("host_bound", sa.Boolean(), nullable=False, server_default=sa.false())
        )
    # A session that reported, or was given a host, has one.
    op.execute(
        "UPDATE agent_sessions SET host_bound = TRUE"
        " WHERE host_id <> 'default' OR last_report_at IS NOT NULL"
    )


def downgrade() -> None:
    with op.batch_alter_table("agent_sessions") as batch:
        batch.drop_column("host_bound")
    with op.batch_alter_table("runtime_hosts") as batch:
        batch.drop_column("token")

"""Many agent hosts (docs/lifecycles.md: sessions): the registered hosts, and the host each session lives on.

Revision ID: 0006
"""

import sqlalchemy as sa
from alembic import op

from agent_radar.models.base import UTCDateTime

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "runtime_hosts",
        sa.Column("host_id", sa.String(255), nullable=False),
        sa.Column("url", sa.String(2048), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("host_id", name="pk_runtime_hosts"),
    )
    with op.batch_alter_table("agent_sessions") as batch:
        batch.add_column(
            sa.Column("host_id", sa.String(255), nullable=False, server_default="default")
        )


def downgrade() -> None:
    with op.batch_alter_table("agent_sessions") as batch:
        batch.drop_column("host_id")
    op.drop_table("runtime_hosts")

"""Runtime epochs (docs/lifecycles.md: sessions): the epoch at which a session's durable fences were last
installed, and the epoch each turn ran in.

Revision ID: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("agent_sessions") as batch:
        batch.add_column(
            sa.Column("fences_epoch", sa.Integer(), nullable=False, server_default="0")
        )
    with op.batch_alter_table("turns") as batch:
        batch.add_column(sa.Column("runtime_epoch", sa.Integer()))


def downgrade() -> None:
    with op.batch_alter_table("turns") as batch:
        batch.drop_column("runtime_epoch")
    with op.batch_alter_table("agent_sessions") as batch:
        batch.drop_column("fences_epoch")

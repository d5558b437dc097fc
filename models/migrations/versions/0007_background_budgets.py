"""Budgets for every background kind (docs/lifecycles.md: fences): when the current run of failures of a
fence, a turn cancel or a prompt began (the age budget), and a prompt's attempts and last
error.

Revision ID: 0007
"""

import sqlalchemy as sa
from alembic import op

from agent_radar.models.base import UTCDateTime

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for table in ("goal_fences", "cancel_operations"):
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("failing_since", UTCDateTime()))
    with op.batch_alter_table("prompts") as batch:
        batch.add_column(sa.Column("attempt", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("last_error", sa.Text()))
        batch.add_column(sa.Column("failing_since", UTCDateTime()))


def downgrade() -> None:
    with op.batch_alter_table("prompts") as batch:
        batch.drop_column("failing_since")
        batch.drop_column("last_error")
        batch.drop_column("attempt")
    for table in ("cancel_operations", "goal_fences"):
        with op.batch_alter_table(table) as batch:
            batch.drop_column("failing_since")

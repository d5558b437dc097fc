"""Pulling under load: a worker pool process's promise to take due goal work when notified
(PostgreSQL; docs/dispatch.md). Empty and unused on SQLite.

Revision ID: 0014
"""

import sqlalchemy as sa
from alembic import op

from agent_radar.models.base import UTCDateTime

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "goal_pullers",
        sa.Column("channel", sa.String(63), primary_key=True),
        sa.Column("expires_at", UTCDateTime(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("goal_pullers")

"""Heartbeats (docs/lifecycles.md: leases; docs/operations.md): when the sweep last finished, so a dead beat shows.

Revision ID: 0008
"""

import sqlalchemy as sa
from alembic import op

from agent_radar.models.base import UTCDateTime

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "heartbeats",
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("owner", sa.String(255), nullable=False),
        sa.Column("beat_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_heartbeats"),
    )


def downgrade() -> None:
    op.drop_table("heartbeats")

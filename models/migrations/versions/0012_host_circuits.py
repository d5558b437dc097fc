"""Bulkheads: a host whose calls keep failing is skipped for a while (its circuit breaker
opens), and `status` shows it.

Revision ID: 0012
"""

import sqlalchemy as sa
from alembic import op

from agent_radar.models.base import UTCDateTime

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "host_circuits",
        sa.Column("host_id", sa.String(255), primary_key=True),
        sa.Column("open_until", UTCDateTime(), nullable=False),
        sa.Column("failures", sa.Integer(), nullable=False),
        sa.Column("last_error", sa.String(512)),
        sa.Column("opened_by", sa.String(255), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("host_circuits")

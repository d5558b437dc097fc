"""Reports refused, per host they named: `status` shows them (docs/protocol.md: reports).

Revision ID: 0017
"""

import sqlalchemy as sa
from alembic import op

from agent_radar.models.base import UTCDateTime

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "report_refusals",
        sa.Column("host_id", sa.String(255), primary_key=True),
        sa.Column("refused", sa.BigInteger(), nullable=False),
        sa.Column("last_code", sa.String(32), nullable=False),
        sa.Column("last_at", UTCDateTime(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("report_refusals")

"""Session stops (docs/lifecycles.md: sessions): one idempotent operation that cancels a session's running turn
and its active maintenance run.

Revision ID: 0005
"""

import sqlalchemy as sa
from alembic import op

from agent_radar.models.base import UTCDateTime

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

ID = sa.String(255)


def upgrade() -> None:
    op.create_table(
        "session_stops",
        sa.Column("stop_id", sa.String(36), nullable=False),
        sa.Column("workspace_id", ID, nullable=False),
        sa.Column("session_id", ID, nullable=False),
        sa.Column("client_submit_id", ID, nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("turn_id", ID),
        sa.Column("cancel_operation_id", sa.String(36)),
        sa.Column("run_id", sa.String(36)),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("stop_id", name="pk_session_stops"),
        sa.UniqueConstraint(
            "workspace_id", "session_id", "client_submit_id", name="uq_session_stops_submit"
        ),
    )


def downgrade() -> None:
    op.drop_table("session_stops")

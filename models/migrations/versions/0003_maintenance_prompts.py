"""Maintenance runs and prompts.

Revision ID: 0003
"""

import sqlalchemy as sa
from alembic import op

from agent_radar.models.base import UTCDateTime

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

ID = sa.String(255)
SHORT = sa.String(32)


def upgrade() -> None:
    op.create_table(
        "maintenance_runs",
        sa.Column("run_id", sa.String(36), nullable=False),
        sa.Column("workspace_id", ID, nullable=False),
        sa.Column("session_id", ID, nullable=False),
        sa.Column("client_submit_id", ID, nullable=False),
        sa.Column("kind", SHORT, nullable=False),
        sa.Column("args", sa.JSON()),
        sa.Column("status", SHORT, nullable=False),
        sa.Column("error_code", SHORT),
        sa.Column("detail", sa.Text()),
        sa.Column("revision", sa.Integer(), nullable=False),
        sa.Column("runtime_epoch", sa.Integer(), nullable=False),
        sa.Column("applied", sa.Boolean()),
        sa.Column("input_tokens", sa.Integer()),
        sa.Column("result_tokens", sa.Integer()),
        sa.Column("summary", sa.Text()),
        sa.Column("cancel_requested_at", UTCDateTime()),
        sa.Column("started_at", UTCDateTime(), nullable=False),
        sa.Column("finished_at", UTCDateTime()),
        sa.Column("lease_owner", ID),
        sa.Column("lease_token", sa.String(64)),
        sa.Column("lease_expires_at", UTCDateTime()),
        sa.PrimaryKeyConstraint("run_id", name="pk_maintenance_runs"),
        sa.UniqueConstraint("workspace_id", "session_id", "client_submit_id",
                            name="uq_maintenance_runs_submit"),
    )
    op.create_index("ix_maintenance_runs_live", "maintenance_runs",
                    ["status", "lease_expires_at"])
    op.create_index("ix_maintenance_runs_session", "maintenance_runs",
                    ["workspace_id", "session_id", "status"])
    op.create_table(
        "prompts",
        sa.Column("prompt_id", sa.String(36), nullable=False),
        sa.Column("workspace_id", ID, nullable=False),
        sa.Column("session_id", ID, nullable=False),
        sa.Column("client_submit_id", ID, nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("status", SHORT, nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("turn_id", ID),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("dispatched_at", UTCDateTime()),
        sa.PrimaryKeyConstraint("prompt_id", name="pk_prompts"),
        sa.UniqueConstraint("workspace_id", "session_id", "client_submit_id",
                            name="uq_prompts_submit"),
    )
    op.create_index("ix_prompts_due", "prompts",
                    ["status", "workspace_id", "session_id", "position"])


def downgrade() -> None:
    op.drop_table("prompts")
    op.drop_table("maintenance_runs")

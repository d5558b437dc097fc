"""Goal generation fences, turns and cancel operations.

Revision ID: 0002
"""

import sqlalchemy as sa
from alembic import op

from agent_radar.models.base import UTCDateTime

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

ID = sa.String(255)
SHORT = sa.String(32)


def _lease_columns():
    return [
        sa.Column("lease_owner", ID),
        sa.Column("lease_token", sa.String(64)),
        sa.Column("lease_expires_at", UTCDateTime()),
    ]


def upgrade() -> None:
    op.create_table(
        "goal_fences",
        sa.Column("fence_id", sa.String(36), nullable=False),
        sa.Column("workspace_id", ID, nullable=False),
        sa.Column("session_id", ID, nullable=False),
        sa.Column("target_operation_id", sa.String(36), nullable=False),
        sa.Column("target_revision", sa.Integer(), nullable=False),
        sa.Column("client_submit_id", ID, nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("status", SHORT, nullable=False),
        sa.Column("clear_operation_id", sa.String(36)),
        sa.Column("cancel_operation_id", sa.String(36)),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", UTCDateTime()),
        sa.Column("last_error", sa.Text()),
        sa.Column("completed_at", UTCDateTime()),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        *_lease_columns(),
        sa.PrimaryKeyConstraint("fence_id", name="pk_goal_fences"),
        sa.UniqueConstraint("workspace_id", "session_id", "client_submit_id",
                            name="uq_goal_fences_submit"),
        sa.UniqueConstraint("target_operation_id", name="uq_goal_fences_target"),
    )
    op.create_index("ix_goal_fences_due", "goal_fences", ["status", "next_attempt_at"])
    op.create_index("ix_goal_fences_session", "goal_fences", ["workspace_id", "session_id"])
    op.create_table(
        "turns",
        sa.Column("workspace_id", ID, nullable=False),
        sa.Column("session_id", ID, nullable=False),
        sa.Column("turn_id", ID, nullable=False),
        sa.Column("phase", SHORT, nullable=False),
        sa.Column("outcome", SHORT),
        sa.Column("origin", SHORT),
        sa.Column("source_goal_operation_id", sa.String(36)),
        sa.Column("source_goal_revision", sa.Integer()),
        sa.Column("prompt_id", sa.String(36)),
        sa.Column("started_at", UTCDateTime()),
        sa.Column("settled_at", UTCDateTime()),
        sa.PrimaryKeyConstraint("workspace_id", "session_id", "turn_id", name="pk_turns"),
    )
    op.create_table(
        "cancel_operations",
        sa.Column("operation_id", sa.String(36), nullable=False),
        sa.Column("workspace_id", ID, nullable=False),
        sa.Column("session_id", ID, nullable=False),
        sa.Column("turn_id", ID, nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("status", SHORT, nullable=False),
        sa.Column("result", SHORT),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", UTCDateTime()),
        sa.Column("last_error", sa.Text()),
        sa.Column("completed_at", UTCDateTime()),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        *_lease_columns(),
        sa.PrimaryKeyConstraint("operation_id", name="pk_cancel_operations"),
    )
    op.create_index("ix_cancel_operations_due", "cancel_operations",
                    ["status", "next_attempt_at"])


def downgrade() -> None:
    for table in ("cancel_operations", "turns", "goal_fences"):
        op.drop_table(table)

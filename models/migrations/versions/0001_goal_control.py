"""Sessions, goal states, goal operations, session events and leases.

Revision ID: 0001
"""

import sqlalchemy as sa
from alembic import op

from agent_radar.models.base import UTCDateTime

revision = "0001"
down_revision = None
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
        "agent_sessions",
        sa.Column("workspace_id", ID, nullable=False),
        sa.Column("session_id", ID, nullable=False),
        sa.Column("provider", ID),
        sa.Column("provider_session_id", ID),
        sa.Column("live", sa.Boolean()),
        sa.Column("runtime_epoch", sa.Integer(), nullable=False),
        sa.Column("admission", SHORT, nullable=False),
        sa.Column("active_turn_id", ID),
        sa.Column("last_report_at", UTCDateTime()),
        sa.Column("event_sequence", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("workspace_id", "session_id", name="pk_agent_sessions"),
    )
    op.create_table(
        "goal_states",
        sa.Column("workspace_id", ID, nullable=False),
        sa.Column("session_id", ID, nullable=False),
        sa.Column("revision", sa.Integer(), nullable=False),
        sa.Column("desired", sa.JSON()),
        sa.Column("observed", sa.JSON()),
        sa.Column("tombstoned", sa.Boolean(), nullable=False),
        sa.Column("sync_status", SHORT, nullable=False),
        sa.Column("pending_operation_id", ID),
        sa.Column("last_error", sa.Text()),
        sa.PrimaryKeyConstraint("workspace_id", "session_id", name="pk_goal_states"),
    )
    op.create_table(
        "goal_operations",
        sa.Column("operation_id", sa.String(36), nullable=False),
        sa.Column("workspace_id", ID, nullable=False),
        sa.Column("session_id", ID, nullable=False),
        sa.Column("client_submit_id", ID, nullable=False),
        sa.Column("origin", SHORT, nullable=False),
        sa.Column("action", SHORT, nullable=False),
        sa.Column("objective", sa.Text()),
        sa.Column("goal_revision", sa.Integer(), nullable=False),
        sa.Column("status", SHORT, nullable=False),
        sa.Column("provider_phase", SHORT, nullable=False),
        sa.Column("evidence", sa.JSON()),
        sa.Column("last_error", sa.Text()),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", UTCDateTime()),
        sa.Column("first_dispatched_at", UTCDateTime()),
        sa.Column("accepted_at", UTCDateTime()),
        sa.Column("completed_at", UTCDateTime()),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        *_lease_columns(),
        sa.PrimaryKeyConstraint("operation_id", name="pk_goal_operations"),
        sa.UniqueConstraint("workspace_id", "session_id", "client_submit_id",
                            name="uq_goal_operations_submit"),
    )
    op.create_index("ix_goal_operations_due", "goal_operations", ["status", "next_attempt_at"])
    op.create_index("ix_goal_operations_session", "goal_operations",
                    ["workspace_id", "session_id", "goal_revision"])
    op.create_table(
        "session_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("workspace_id", ID, nullable=False),
        sa.Column("session_id", ID, nullable=False),
        sa.Column("sequence", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(64), nullable=False),
        sa.Column("record_id", ID, nullable=False),
        sa.Column("revision", sa.Integer()),
        sa.Column("payload", sa.JSON()),
        sa.Column("optional", sa.Boolean(), nullable=False),
        sa.Column("idempotency_key", sa.String(512), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_session_events"),
        sa.UniqueConstraint("workspace_id", "session_id", "sequence",
                            name="uq_session_events_sequence"),
        sa.UniqueConstraint("idempotency_key", name="uq_session_events_idempotency_key"),
    )
    op.create_table(
        "leases",
        sa.Column("name", sa.String(600), nullable=False),
        sa.Column("owner", ID),
        sa.Column("token", sa.String(64)),
        sa.Column("expires_at", UTCDateTime()),
        sa.PrimaryKeyConstraint("name", name="pk_leases"),
    )


def downgrade() -> None:
    for table in ("leases", "session_events", "goal_operations", "goal_states",
                  "agent_sessions"):
        op.drop_table(table)

"""A prompt's turn, by session and prompt: the sweeper looks for prompts whose turn no report
told of (docs/lifecycles.md: reconcile) without reading the turns' history.

Revision ID: 0019
"""

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

PROMPTED = "prompt_id IS NOT NULL"


def upgrade() -> None:
    op.create_index(
        "ix_turns_prompt",
        "turns",
        ["workspace_id", "session_id", "prompt_id"],
        postgresql_where=sa.text(PROMPTED),
        sqlite_where=sa.text(PROMPTED),
    )


def downgrade() -> None:
    op.drop_index("ix_turns_prompt", table_name="turns")

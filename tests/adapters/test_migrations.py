"""The Alembic migrations create exactly what the models describe, on both databases."""

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from agent_radar.models.base import Base
from agent_radar.models.db import engine_for
from agent_radar.models.migrate import current_revision, head_revision, upgrade


def _diff(url: str) -> list:
    with engine_for(url).connect() as conn:
        return compare_metadata(MigrationContext.configure(conn), Base.metadata)


def test_migrated_schema_matches_the_models(settings):
    assert current_revision(settings.database_url) == head_revision()
    assert _diff(settings.database_url) == []


def test_upgrade_is_idempotent(settings):
    assert upgrade(settings.database_url) == head_revision()
    assert upgrade(settings.database_url) == head_revision()

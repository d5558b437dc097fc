"""`agent-radar db upgrade`: apply pending Alembic migrations to a database URL."""

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from .db import engine_for, normalize_url

MIGRATIONS = Path(__file__).parent / "migrations"


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    # ConfigParser interpolation would eat a literal % in a password.
    cfg.set_main_option("sqlalchemy.url", normalize_url(url).replace("%", "%%"))
    return cfg


def upgrade(url: str) -> str | None:
    """Upgrade to head; returns the revision the database is at afterwards."""
    cfg = alembic_config(url)
    command.upgrade(cfg, "head")
    return current_revision(url)


def current_revision(url: str) -> str | None:
    with engine_for(url).connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()

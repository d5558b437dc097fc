"""Alembic environment: runs migrations on the connection or URL given by models.migrate."""

from alembic import context

from agent_radar.models.base import Base
from agent_radar.models.db import make_engine
from agent_radar.models.dialects import dialect_of

config = context.config


def _run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        render_as_batch=dialect_of(connection).batch_migrations,
    )
    with context.begin_transaction():
        dialect_of(connection).migration_lock(connection)
        context.run_migrations()


engine = make_engine(config.get_main_option("sqlalchemy.url"), create=True)
try:
    with engine.connect() as conn:
        _run(conn)
finally:
    engine.dispose()

"""Alembic environment: runs migrations on the connection or URL given by models.migrate."""

from alembic import context
from sqlalchemy import text

from models.base import Base
from models.db import make_engine

config = context.config


def _run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            # Workers, beat and `up` all upgrade on start; this lock makes them take turns.
            connection.execute(text("SELECT pg_advisory_xact_lock(7242661)"))
        context.run_migrations()


engine = make_engine(config.get_main_option("sqlalchemy.url"))
try:
    with engine.connect() as conn:
        _run(conn)
finally:
    engine.dispose()

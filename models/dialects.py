"""What differs between the two databases the product runs on, one class each: SQLite (the
embedded default) and PostgreSQL (production). Code asks `dialect_of(bind)` for a fact or a
construct instead of testing a dialect's name."""

import os
import sqlite3
from typing import Any, ClassVar

from sqlalchemy import (
    ColumnElement,
    Delete,
    any_,
    create_engine,
    delete,
    event,
    func,
    literal_column,
    select,
    text,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine

# SQLite waits this long for the write lock before reporting "database is locked". Worker
# transactions are a few milliseconds; 30 s only matters while another process is paused.
SQLITE_BUSY_TIMEOUT_MS = 30_000
# The execution option that marks a transaction read-only (models.db.run_read).
READ_ONLY = "agent_radar_read_only"
# Workers, beat and `up` all upgrade the schema on start; on PostgreSQL this advisory lock
# makes them take turns.
MIGRATION_LOCK_KEY = 7242661


class MissingDatabase(sqlite3.OperationalError):
    """The SQLite file a URL names does not exist. Only a migration (`agent-radar db
    upgrade`, which workers, beat and the stack run on start) makes one: a command run
    outside its stack's folder creates nothing (docs/configuration.md: where the CLI looks)."""


class Dialect:
    name: ClassVar[str]
    # Several writes sent as one statement (data-modifying CTEs): one round trip, not one each.
    writes_together: ClassVar[bool]
    # Row locks: a statement can lock the rows it reads (FOR UPDATE) and pass over those
    # another transaction is taking (SKIP LOCKED). SQLite has one write lock for everything.
    locks_rows: ClassVar[bool]
    # Hot-path transactions go through the driver itself (models.direct).
    direct: ClassVar[bool]
    # The database runs functions of its own (PL/pgSQL): a lone message's claim is one call.
    server_functions: ClassVar[bool]
    # Timestamps are stored without their zone (always UTC).
    naive_timestamps: ClassVar[bool]
    # Schema changes rebuild a table rather than alter it in place (Alembic's batch mode).
    batch_migrations: ClassVar[bool]
    # A transaction can notify a listening connection when it commits (LISTEN/NOTIFY): goal
    # submits then wake a pulling worker process instead of publishing (docs/dispatch.md).
    notifies: ClassVar[bool]

    def make_engine(self, url: str, create: bool = False) -> Engine:
        """An engine for `url`; on SQLite, with `create`, one that may make the file."""
        raise NotImplementedError

    def reader(self, engine: Engine) -> Engine:
        """The engine for transactions that only read."""
        raise NotImplementedError

    def insert(self, table: Any) -> Any:
        """An INSERT that can be told what to do on a conflict (`on_conflict_do_nothing`)."""
        raise NotImplementedError

    def migration_lock(self, connection: Connection) -> None:
        """Make concurrent schema upgrades take turns (inside the migration's transaction)."""

    def delete_some(self, table: Any, where: ColumnElement[bool], limit: int) -> Delete:
        """A DELETE of at most `limit` rows of `table` that match `where`, each found once and
        deleted by its address in the table (no lookup in the primary key's index, whose
        pages a long history no longer keeps in memory)."""
        raise NotImplementedError

    def listening_connection(self, engine: Engine, **options: Any) -> Any:
        """A connection of the driver's own, outside the engine's pool, in autocommit, for
        a thread that LISTENs (`notifies` only); `options` are the driver's own."""
        raise NotImplementedError

    def analyze(self, engine: Engine, table: str) -> None:
        """Refresh the planner's statistics of a table after a bulk load (PostgreSQL's
        autovacuum would, soon after; SQLite has none to refresh)."""


class Sqlite(Dialect):
    name = "sqlite"
    writes_together = False
    locks_rows = False
    direct = False
    server_functions = False
    naive_timestamps = True
    batch_migrations = True
    notifies = False

    def make_engine(self, url: str, create: bool = False) -> Engine:
        engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000})
        path = engine.url.database
        if not create and path and path != ":memory:":

            @event.listens_for(engine, "do_connect")
            def _exists(_dialect, _record, _args, _kwargs):
                if not os.path.exists(path):
                    raise MissingDatabase(f"no database at {os.path.abspath(path)}")

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn, _record):
            # Take transaction control away from the sqlite3 module so BEGIN IMMEDIATE below
            # is the only BEGIN issued.
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn):
            # Every transaction takes the write lock up front: a deferred transaction that
            # upgrades to a writer later can fail with SQLITE_BUSY without waiting. A read-only
            # one (run_read) takes a plain snapshot instead, which never waits for a writer.
            if conn.get_execution_options().get(READ_ONLY):
                conn.exec_driver_sql("BEGIN")
            else:
                conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine

    def reader(self, engine: Engine) -> Engine:
        return engine.execution_options(**{READ_ONLY: True})

    def insert(self, table: Any) -> Any:
        return sqlite.insert(table)

    def delete_some(self, table: Any, where: ColumnElement[bool], limit: int) -> Delete:
        rowid: ColumnElement[Any] = literal_column("rowid")
        return delete(table).where(
            rowid.in_(select(rowid).select_from(table).where(where).limit(limit))
        )


class Postgres(Dialect):
    name = "postgresql"
    writes_together = True
    locks_rows = True
    direct = True
    server_functions = True
    naive_timestamps = False
    batch_migrations = False
    notifies = True

    def make_engine(self, url: str, create: bool = False) -> Engine:
        # No pre-ping: it costs a round trip per transaction, and a connection the server
        # dropped surfaces as a transient error that run_transaction retries on a fresh one.
        # LIFO: a process that ran several transactions at once (the client's producer
        # threads) goes on with its most recent connection, whose statements psycopg has
        # prepared (a text on its sixth use on a connection), instead of taking each pooled
        # one in turn.
        engine = create_engine(url, pool_size=5, max_overflow=5, pool_use_lifo=True)

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn, _record):
            # No JIT: it compiles a statement whose estimated cost passes jit_above_cost, and
            # the planner cannot tell how few rows are not yet counted (docs/operations.md:
            # counts), so it estimates the counts' read over a long history at millions of
            # rows and spends far longer compiling a read than the read takes.
            with dbapi_conn.cursor() as cur:
                cur.execute("SET jit = off")
            dbapi_conn.commit()

        return engine

    def reader(self, engine: Engine) -> Engine:
        # Autocommit, without the round trips of BEGIN and COMMIT: under READ COMMITTED each
        # statement reads its own snapshot either way.
        return engine.execution_options(isolation_level="AUTOCOMMIT")

    def insert(self, table: Any) -> Any:
        return postgresql.insert(table)

    def delete_some(self, table: Any, where: ColumnElement[bool], limit: int) -> Delete:
        # Locked as they are found, so a row another transaction is changing (a retry
        # reopening an operation) is passed over, not deleted; a TID scan deletes them.
        ctid: ColumnElement[Any] = literal_column("ctid")
        found = (
            select(ctid)
            .select_from(table)
            .where(where)
            .limit(limit)
            .with_for_update(of=table, skip_locked=True)
        )
        return delete(table).where(ctid == any_(func.array(found.scalar_subquery())))

    def migration_lock(self, connection: Connection) -> None:
        connection.execute(text(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK_KEY})"))

    def listening_connection(self, engine: Engine, **options: Any) -> Any:
        args, kwargs = engine.dialect.create_connect_args(engine.url)
        return engine.dialect.loaded_dbapi.connect(
            *args, **{**kwargs, **options, "autocommit": True}
        )

    def analyze(self, engine: Engine, table: str) -> None:
        # VACUUM too: it brings the partial indexes' sizes up to date (the planner reads
        # them to choose an index of a few open rows over the table) and the visibility map.
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql(f"VACUUM ANALYZE {table}")


SQLITE = Sqlite()
POSTGRES = Postgres()
_BY_NAME: dict[str, Dialect] = {d.name: d for d in (SQLITE, POSTGRES)}


def dialect_of(bind: Any) -> Dialect:
    """The dialect of an engine, a connection, a session, a SQLAlchemy dialect or a URL."""
    if isinstance(bind, str):
        name = bind.split(":", 1)[0].split("+", 1)[0]
        name = "postgresql" if name == "postgres" else name
    else:
        if hasattr(bind, "get_bind"):  # a session (or models.db.Direct)
            bind = bind.get_bind()
        name = getattr(bind, "dialect", bind).name
    dialect = _BY_NAME.get(name)
    if dialect is None:
        raise ValueError(f"unsupported database {name!r}: use SQLite or PostgreSQL")
    return dialect

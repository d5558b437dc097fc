"""Engine and unit-of-work helpers for SQLite (embedded) and PostgreSQL (production).

One engine per process: prefork workers must not share a connection pool, so `engine_for`
keys its cache by process id and a forked child builds its own.
"""

import logging
import os
import random
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar, cast

from sqlalchemy import Insert, bindparam, insert
from sqlalchemy.engine import Connection, CursorResult, Dialect, Engine, Result
from sqlalchemy.exc import (
    DBAPIError,
    IntegrityError,
    MultipleResultsFound,
    NoResultFound,
    OperationalError,
)
from sqlalchemy.orm import Session
from sqlalchemy.sql.compiler import SQLCompiler

from models.dialects import dialect_of

log = logging.getLogger(__name__)
T = TypeVar("T")

# Transient faults (lock waits, serialization failures, a dropped PostgreSQL connection, a
# unique-key race between two first submits) are retried this many times with jitter.
TRANSACTION_ATTEMPTS = 8

_engines: dict[tuple[int, str], Engine] = {}


def normalize_url(url: str) -> str:
    """Accept plain postgresql:// URLs and use psycopg 3 for them."""
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def make_engine(url: str) -> Engine:
    url = normalize_url(url)
    return dialect_of(url).make_engine(url)


def engine_for(url: str) -> Engine:
    key = (os.getpid(), normalize_url(url))
    engine = _engines.get(key)
    if engine is None:
        engine = _engines[key] = make_engine(url)
    return engine


def dispose_engine(url: str) -> None:
    """Close this process's engine for `url` (its pooled connections, and on SQLite the
    database files they hold open) and forget it; the next engine_for makes a new one."""
    engine = _engines.pop((os.getpid(), normalize_url(url)), None)
    if engine is not None:
        engine.dispose()


def forget_engines() -> None:
    """Drop engines inherited through fork without touching the parent's connections."""
    for (pid, _url), engine in list(_engines.items()):
        if pid != os.getpid():
            engine.dispose(close=False)
            del _engines[(pid, _url)]


def _is_transient(exc: Exception) -> bool:
    if isinstance(exc, IntegrityError):
        return True  # a concurrent first insert; the retry takes the replay path
    if isinstance(exc, OperationalError):
        return True  # locked database, serialization failure, lost connection
    return isinstance(exc, DBAPIError) and exc.connection_invalidated


@contextmanager
def session_scope(engine: Engine) -> Iterator[Session]:
    """One unit of work: commits on success, rolls back on any exception."""
    with Session(engine, expire_on_commit=False, autoflush=False) as session:
        with session.begin():
            yield session


def run_transaction(
    engine: Engine,
    work: Callable[[Session], T],
    attempts: int | None = None,
    *,
    direct: bool = False,
) -> T:
    """Run `work` in its own transaction, retrying transient database faults. With
    `direct`, on PostgreSQL, `work` gets a Direct in place of the ORM session: for work on
    a hot path whose statements are prebuilt and go through `session.connection()`."""
    attempts = attempts or TRANSACTION_ATTEMPTS
    scope = direct_scope if direct and dialect_of(engine).direct else session_scope
    for attempt in range(1, attempts + 1):
        try:
            with scope(engine) as session:
                return work(session)
        except Exception as exc:  # noqa: BLE001 - classified below
            if attempt == attempts or not _is_transient(exc):
                raise
            delay_s = min(0.05 * 2 ** (attempt - 1), 2.0) * (0.5 + random.random())
            log.info(
                "transient database fault (attempt %d): %s; retrying",
                attempt,
                exc.__class__.__name__,
            )
            time.sleep(delay_s)
    raise AssertionError("unreachable")


_readers: dict[Engine, Engine] = {}


def run_read(engine: Engine, work: Callable[[Session], T], *, direct: bool = False) -> T:
    """`run_transaction` for work that only reads (see Dialect.reader: no write lock on
    SQLite, autocommit on PostgreSQL)."""
    reader = _readers.get(engine)
    if reader is None:
        reader = _readers[engine] = dialect_of(engine).reader(engine)
    return run_transaction(reader, work, direct=direct)


class Rows:
    """The rows of a statement that a Direct ran, fetched at once, with the part of
    SQLAlchemy's Result that the direct work uses (rows read by attribute or position)."""

    __slots__ = ("_rows", "rowcount")

    def __init__(self, rows: list[Any], count: int) -> None:
        self._rows = rows
        self.rowcount = count

    def __iter__(self) -> Iterator[Any]:
        return iter(self._rows)

    def all(self) -> list[Any]:
        return list(self._rows)

    def first(self) -> Any:
        return self._rows[0] if self._rows else None

    def one_or_none(self) -> Any:
        if len(self._rows) > 1:
            raise MultipleResultsFound("more than one row where at most one was expected")
        return self.first()

    def one(self) -> Any:
        row = self.one_or_none()
        if row is None:
            raise NoResultFound("no row where one was expected")
        return row

    def scalars(self) -> "Rows":
        return Rows([row[0] for row in self._rows], self.rowcount)

    def scalar(self) -> Any:
        row = self.first()
        return None if row is None else row[0]

    def scalar_one(self) -> Any:
        return self.one()[0]

    def scalar_one_or_none(self) -> Any:
        row = self.one_or_none()
        return None if row is None else row[0]


# Per dialect, each statement a Direct ran, compiled; held only as long as the statement
# lives (the prebuilt ones: for good).
_compiled: "weakref.WeakKeyDictionary[Dialect, weakref.WeakKeyDictionary[Any, _Compiled]]" = (
    weakref.WeakKeyDictionary()
)


def _bind(process: Any, value: Any) -> Any:
    """A value as its type's bind processor makes it (a tuple's has one per element)."""
    if callable(process):
        return process(value)
    return tuple(v if p is None else p(v) for p, v in zip(process, value, strict=True))


class _Compiled:
    """A statement compiled for a Direct, and its text and parameters for each set of
    lengths of its expanding lists, as SQLAlchemy's `construct_expanded_state` makes them:
    that spreads every list into numbered parameters and renders the text anew on each
    execution (a tenth of a millisecond of CPU for a claim's read of one operation). The
    text and the names a list spreads into depend only on the lists' lengths, so they are
    made once per set of lengths (up to MAX_EXPANSIONS of them; past that, each time)."""

    MAX_EXPANSIONS = 256

    __slots__ = ("compiled", "_plain", "_lists", "_expansions")

    def __init__(self, compiled: SQLCompiler) -> None:
        self.compiled = compiled
        self._plain = not (compiled.post_compile_params or compiled.literal_execute_params)
        # The expanding parameters (IN lists), by name (as SQLAlchemy's expansion takes
        # them from construct_params); none where a parameter is rendered into the text
        # (literal_execute): such a statement goes the whole way every time.
        self._lists: dict[str, bool] = (
            {}
            if compiled.literal_execute_params
            else {
                compiled.bind_names[bind]: bind.type._is_tuple_type
                for bind in compiled.post_compile_params
            }
        )
        self._expansions: dict[tuple[int, ...], tuple[str, dict[str, list[str]], dict]] = {}

    def bound(self, parameters: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """The text and the bound parameters of one execution."""
        compiled = self.compiled
        if self._plain:
            # Nothing to spread or render: the compiled text as it is.
            params = cast(dict[str, Any], compiled.construct_params(parameters))
            return compiled.string, _processed(params, compiled._bind_processors)
        if not self._lists:
            state = compiled.construct_expanded_state(parameters)
            return state.statement, _processed(
                dict(state.parameters), compiled._bind_processors, state.processors
            )
        params = cast(dict[str, Any], compiled.construct_params(parameters))
        lengths = tuple(len(params[name]) for name in self._lists)
        expansion = self._expansions.get(lengths)
        if expansion is None:
            state = compiled.construct_expanded_state(parameters)
            expansion = (state.statement, dict(state.parameter_expansion), dict(state.processors))
            if len(self._expansions) < self.MAX_EXPANSIONS:
                self._expansions[lengths] = expansion
        sql, spread, processors = expansion
        for name, into in spread.items():
            values = params.pop(name)
            # A list of rows (a tuple IN) spreads row by row, one name per element.
            flat = [v for row in values for v in row] if self._lists[name] else values
            params.update(zip(into, flat, strict=True))
        return sql, _processed(params, compiled._bind_processors, processors)


def _processed(params: dict[str, Any], *by_name: Mapping[str, Any]) -> dict[str, Any]:
    """The parameters with the compiled statement's own processors (JSON, booleans)
    applied, then those of the values an expanding list spread into (SQLAlchemy's
    execution applies both)."""
    for processors in by_name:
        for name, process in processors.items():
            if name in params:
                params[name] = _bind(process, params[name])
    return params


def bound_sql(dialect: Dialect, statement: Any, parameters: dict[str, Any]) -> tuple[str, Any]:
    """A prebuilt statement's text and bound parameters for one execution, as a Direct
    sends them."""
    by_statement = _compiled.get(dialect)
    if by_statement is None:
        by_statement = _compiled[dialect] = weakref.WeakKeyDictionary()
    compiled = by_statement.get(statement)
    if compiled is None:
        compiled = _Compiled(cast(SQLCompiler, statement.compile(dialect=dialect)))
        by_statement[statement] = compiled
    return compiled.bound(parameters)


class DirectConnection:
    """`Connection.execute` for a Direct: the statement compiled once, its parameters bound
    as SQLAlchemy binds them (expanding lists, JSON), and sent through psycopg itself. The
    engine's cursor events still see it; a list of parameter sets (executemany) goes
    through SQLAlchemy."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self.dialect = conn.dialect
        self._driver: Any = conn.connection.driver_connection

    @property
    def driver(self) -> Any:
        """The psycopg connection."""
        return self._driver

    def execute(self, statement: Any, parameters: Any = None) -> Any:
        if isinstance(parameters, list):
            return self._conn.execute(statement, parameters)
        from psycopg import Error as DriverError
        from psycopg.pq import ExecStatus
        from psycopg.rows import namedtuple_row

        sql, params = bound_sql(self.dialect, statement, parameters or {})
        events = self._conn.dispatch
        if events.before_cursor_execute:  # (no cursor or execution context to give them)
            events.before_cursor_execute(self._conn, None, sql, params, None, False)
        cursor = self._driver.cursor(row_factory=namedtuple_row)
        try:
            cursor.execute(sql, params)
            # Whether it returned rows, from the result's status: the cursor's
            # `description` would build a Column object for each of its columns.
            result = cursor.pgresult
            returned = result is not None and result.status == ExecStatus.TUPLES_OK
            rows = Rows(cursor.fetchall() if returned else [], cursor.rowcount)
        except DriverError as exc:
            # Wrapped as SQLAlchemy wraps it, so that run_transaction's retry and every
            # caller see the same errors as through the session. A connection the server
            # dropped is invalidated by the rollback that follows (SQLAlchemy's own check).
            lost = bool(self._driver.broken)
            raise DBAPIError.instance(
                sql, params, exc, DriverError, connection_invalidated=lost, dialect=self.dialect
            ) from exc
        finally:
            cursor.close()
        return rows


class Direct:
    """The stand-in for the ORM session that `run_transaction(direct=True)` hands its work
    on PostgreSQL: `connection()` runs statements through psycopg without SQLAlchemy's
    execution around each one (DirectConnection), which on a lone goal operation's path
    is a good part of its time. Everything else of the session's (ORM reads and writes,
    `execute`, `flush`) goes to a session opened on the same connection and transaction
    when first asked for."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._direct = DirectConnection(conn)
        self._session: Session | None = None

    def connection(self) -> DirectConnection:
        return self._direct

    def get_bind(self) -> Connection:
        return self._conn

    def _orm(self) -> Session:
        if self._session is None:
            self._session = Session(
                bind=self._conn,
                autoflush=False,
                expire_on_commit=False,
                join_transaction_mode="rollback_only",
            )
        return self._session

    def __getattr__(self, name: str) -> Any:
        return getattr(self._orm(), name)

    def flush_orm(self) -> None:
        """Write what the ORM session holds (before the transaction commits)."""
        if self._session is not None:
            self._session.flush()

    def close_orm(self) -> None:
        if self._session is not None:
            self._session.close()


@contextmanager
def direct_scope(engine: Engine) -> Iterator[Session]:
    """`session_scope` for direct work (see Direct): commits on success, rolls back on any
    exception."""
    with engine.connect() as conn:
        with conn.begin():
            direct = Direct(conn)
            try:
                # Direct offers the part of Session's surface that direct work uses.
                yield cast(Session, direct)
                direct.flush_orm()
            finally:
                direct.close_orm()


def rowcount(result: Result[Any]) -> int:
    """How many rows an UPDATE or DELETE changed (its result is a CursorResult)."""
    return cast(CursorResult[Any], result).rowcount


def insert_ignore(session: Session, table, values: dict | list[dict]) -> Any:
    """INSERT … ON CONFLICT DO NOTHING on both SQLite and PostgreSQL. For one row (a dict):
    True if it went in; for several (a list of dicts, one statement): the set of the first
    primary key column's values that went in."""
    # rowcount is not reliable for INSERT; RETURNING says which rows went in.
    key = next(iter(table.primary_key.columns))
    statement = (
        dialect_of(session).insert(table).values(values).on_conflict_do_nothing().returning(key)
    )
    inserted = set(session.execute(statement).scalars())
    return inserted if isinstance(values, list) else bool(inserted)


def insert_bound(table, prefix: str, columns: Iterable[str]) -> Insert:
    """A prebuilt INSERT of these columns, each from the bound parameter `prefix + column`,
    so that it can run beside other writes on one parameter dict (execute_writes)."""
    return insert(table).values(
        {name: bindparam(prefix + name, type_=table.c[name].type) for name in columns}
    )


def bound(prefix: str, values: dict[str, Any]) -> dict[str, Any]:
    """Parameters for an `insert_bound(table, prefix, …)` statement (or any statement whose
    bound parameters are named `prefix + column`)."""
    return {prefix + name: value for name, value in values.items()}


_together: dict[tuple[Any, ...], Any] = {}


def execute_writes(session: Session, statements: Sequence[Any], params: dict[str, Any]) -> None:
    """Run these prebuilt writes, whose results nobody reads, on one dict of bound
    parameters. On PostgreSQL they go as one statement, all but the last in a WITH clause
    (data-modifying CTEs): one round trip instead of one each. Elsewhere they run one after
    another. PostgreSQL runs the parts on one snapshot in no set order, so no two of them
    may touch the same row, and none may depend on another's effect."""
    conn = session.connection()
    if not dialect_of(conn).writes_together or len(statements) == 1:
        for statement in statements:
            conn.execute(statement, params)
        return
    key = tuple(statements)
    combined = _together.get(key)
    if combined is None:
        *firsts, combined = statements
        combined = combined.add_cte(*(part.cte(f"write_{i}") for i, part in enumerate(firsts)))
        _together[key] = combined
    conn.execute(combined, params)

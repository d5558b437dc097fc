"""Direct transactions on PostgreSQL (docs/benchmarks.md, the sixth series): a hot path's
prebuilt statements sent through psycopg itself, with SQLAlchemy's compiled text and bind
processing but without the ORM session and Core execution around each statement."""

import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, cast

from sqlalchemy.engine import Connection, Dialect, Engine
from sqlalchemy.exc import DBAPIError, MultipleResultsFound, NoResultFound
from sqlalchemy.orm import Session
from sqlalchemy.sql.compiler import SQLCompiler

from .error_hooks import translated


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
            raise (
                translated(exc)
                or DBAPIError.instance(
                    sql, params, exc, DriverError, connection_invalidated=lost, dialect=self.dialect
                )
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

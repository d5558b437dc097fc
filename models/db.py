"""Engine and unit-of-work helpers for SQLite (embedded) and PostgreSQL (production).

One engine per process: prefork workers must not share a connection pool, so `engine_for`
keys its cache by process id and a forked child builds its own.
"""

import logging
import os
import random
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar, cast

from sqlalchemy import Insert, bindparam, event, insert
from sqlalchemy.engine import CursorResult, Engine, Result
from sqlalchemy.exc import (
    DBAPIError,
    IntegrityError,
    OperationalError,
)
from sqlalchemy.orm import Session

from . import error_hooks
from .dialects import MissingDatabase, dialect_of
from .direct import direct_scope

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


def make_engine(url: str, create: bool = False) -> Engine:
    """An engine for `url`. Only a migration passes `create`: any other SQLite engine refuses
    a file that does not exist (MissingDatabase) instead of making an empty one."""
    url = normalize_url(url)
    return dialect_of(url).make_engine(url, create)


def engine_for(url: str) -> Engine:
    key = (os.getpid(), normalize_url(url))
    engine = _engines.get(key)
    if engine is None:
        engine = _engines[key] = make_engine(url)
        event.listen(engine, "handle_error", error_hooks.raise_translated)
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
        # A locked database, serialization failure, lost connection; not a missing file.
        return not isinstance(exc.orig, MissingDatabase)
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

"""The idempotent accept of every submit (docs/lifecycles.md: accept): a client submit ID names one
record for good. Submitted again with the same content, the record it made is returned and nothing
is written; with other content, it is a conflict that names that record."""

from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy.orm import Session

T = TypeVar("T")


def replay(
    existing: T | None,
    submitted: tuple[Any, ...],
    recorded: Callable[[T], tuple[Any, ...]],
    conflict: Callable[[T], Exception],
) -> T | None:
    """The record this submit made before (`existing`, read under the session lock), if it
    made one: the same content (`recorded(existing) == submitted`) is its replay, other
    content raises `conflict(existing)`. None if it made none: accept it anew."""
    if existing is None:
        return None
    if recorded(existing) != submitted:
        raise conflict(existing)
    return existing


def find_replay(
    session: Session,
    row_type: type[T],
    key: Any,
    submitted: tuple[Any, ...],
    recorded: Callable[[T], tuple[Any, ...]],
    conflict: Callable[[T], Exception],
) -> T | None:
    """`replay` of the row of `row_type` at `key` (its id, derived from the client submit ID),
    read afresh in the caller's transaction."""
    existing = session.get(row_type, key, populate_existing=True)
    return replay(existing, submitted, recorded, conflict)

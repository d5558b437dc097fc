"""Declarative base and the column types every table shares."""

from datetime import UTC, datetime
from typing import cast

from sqlalchemy import DateTime, MetaData, String, Table, TypeDecorator, text
from sqlalchemy.orm import DeclarativeBase

from .dialects import dialect_of

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


ID = String(255)
SHORT = String(32)


def partial(condition: str) -> dict:
    """A partial index's condition, on both dialects."""
    return {"postgresql_where": text(condition), "sqlite_where": text(condition)}


class UTCDateTime(TypeDecorator):
    """Timestamps are stored and returned as timezone-aware UTC on every backend.

    SQLite has no time zone support, so values are normalised to UTC on the way in and
    tagged as UTC on the way out.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value, dialect):
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given; agent-radar stores UTC only")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect_of(dialect).naive_timestamps else value

    def process_result_value(self, value, dialect):
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


def table_of(model: type[Base]) -> Table:
    """A mapped class's Table, typed as one (DeclarativeBase declares a FromClause), for the
    prebuilt Core statements of the hot paths."""
    return cast(Table, model.__table__)

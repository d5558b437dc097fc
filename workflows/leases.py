"""Named leases (docs/lifecycles.md: leases): claimed by a conditional update, fenced by their
token.

A holder renews and releases only while its token is still the row's token, so a worker
that was paused past its expiry cannot act on a lease somebody else has since claimed.
"""

import uuid
from collections.abc import Collection
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import String, bindparam, delete, func, or_, select, update
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import Session
from sqlalchemy.sql.expression import Executable

from ..models.base import table_of
from ..models.coordination import Heartbeat
from ..models.db import insert_ignore, rowcount
from ..models.dialects import dialect_of
from ..models.tables import Lease
from . import ids

LEASES = table_of(Lease)
# Reservations the sweeper takes before it re-publishes work that has no row lease of its own
# (an unclaimed maintenance run, a prompt queue): one message per reservation interval.
REPUBLISH_PREFIX = "republish:"
_NAMES = LEASES.c.name.in_(bindparam("b_names", expanding=True))
# A lease no one holds (never taken, released, or expired at `b_now`).
_FREE = or_(LEASES.c.expires_at.is_(None), LEASES.c.expires_at <= bindparam("b_now"))
# What a taken lease's row becomes, and a released one's.
_TAKEN_BY = {
    "owner": bindparam("b_owner", type_=LEASES.c.owner.type),
    "token": bindparam("b_token", type_=LEASES.c.token.type),
    "expires_at": bindparam("b_expires", type_=LEASES.c.expires_at.type),
}
_LET_GO = {"owner": None, "token": None, "expires_at": None}
# Built once: every dispatch claims and releases lanes, several at a time.
_CLAIM = update(LEASES).where(_NAMES, _FREE).values(_TAKEN_BY).returning(LEASES.c.name)
# _CLAIM for the names given as `b_skip_names` (PostgreSQL), without waiting for a row
# that another transaction has locked (it is taking or letting go of that lease now): such
# a name is left out, as a held one is.
_FREE_UNLOCKED = (
    select(LEASES.c.name)
    .where(
        LEASES.c.name.in_(bindparam("b_skip_names", expanding=True)),
        _FREE,
    )
    .with_for_update(skip_locked=True)
)
_CLAIM_UNLOCKED = (
    update(LEASES)
    .where(LEASES.c.name.in_(_FREE_UNLOCKED.scalar_subquery()))
    .values(_TAKEN_BY)
    .returning(LEASES.c.name)
)
# _CLAIM (and _CLAIM_UNLOCKED), and a first row for each name that has none, in one
# statement (PostgreSQL): a session's first dispatch costs one round trip, not two. A name
# held by someone else conflicts and is skipped (DO NOTHING takes no lock and waits only for
# an uncommitted insert of the same name, as the two-statement form does).
_TAKEN = (
    select(_CLAIM.cte("waited").c.name)
    .union_all(select(_CLAIM_UNLOCKED.cte("unlocked").c.name))
    .cte("taken")
)
_WANTED = func.unnest(bindparam("b_name_array", type_=postgresql.ARRAY(String))).column_valued(
    "wanted_name"
)


def _created(name: Any, existing: str, cte: str, *conditions: Any) -> Any:
    """A CTE inserting the lease row of `name` (an SQL expression: one name, or a column
    of several), taken, where it has none yet and `conditions` hold; the names created.
    Only names with no row yet: inserting over a row that another transaction is updating
    would wait for it (so the names taken, which have rows, are out too)."""
    row = LEASES.alias(existing)
    return (
        postgresql.insert(LEASES)
        .from_select(
            ["name", "owner", "token", "expires_at"],
            select(name, *_TAKEN_BY.values()).where(
                ~select(row.c.name).where(row.c.name == name).exists(), *conditions
            ),
        )
        .on_conflict_do_nothing()
        .returning(LEASES.c.name)
        .cte(cte)
    )


_CREATED = _created(_WANTED, "existing", "created")
_CLAIM_OR_CREATE = select(_TAKEN.c.name).union_all(select(_CREATED.c.name))
# The names _CLAIM_OR_CREATE takes, as a CTE for a statement that goes on with them in the
# same round trip (claim_many's `and_then`).
CLAIMED = _CLAIM_OR_CREATE.cte("claimed")


_RENEW = (
    update(LEASES)
    .where(
        LEASES.c.name == bindparam("b_name"),
        LEASES.c.token == bindparam("b_token"),
        LEASES.c.expires_at > bindparam("b_now"),
    )
    .values(expires_at=bindparam("b_expires"))
)
RELEASE = update(LEASES).where(_NAMES, LEASES.c.token == bindparam("b_token")).values(_LET_GO)
# RELEASE as a CTE for a statement that does other writes too (PostgreSQL; its names an
# array, `b_release_names`, under `b_release_token`): a holder's release in the round trip
# of its last write.
RELEASE_CTE = (
    update(LEASES)
    .where(
        LEASES.c.name == func.any(bindparam("b_release_names", type_=postgresql.ARRAY(String))),
        LEASES.c.token == bindparam("b_release_token"),
    )
    .values(_LET_GO)
    .cte("released")
)


# The lease columns of a row its holder lets go of.
RELEASED = {"lease_owner": None, "lease_token": None, "lease_expires_at": None}


def new_token() -> str:
    return uuid.uuid4().hex


def claim(session: Session, name: str, owner: str, ttl_s: float, now: datetime) -> str | None:
    """Take the lease if it is free or expired; returns the new token, or None if held."""
    token, taken = claim_many(session, [name], owner, ttl_s, now)
    return token if taken else None


def claim_many(
    session: Session,
    names: list[str],
    owner: str,
    ttl_s: float,
    now: datetime,
    unlocked_only: Collection[str] = (),
    and_then: tuple[Executable, dict[str, Any]] | None = None,
) -> tuple[str, set[str]]:
    """Take each of these leases that is free or expired, all under one new token; returns
    the token and the names taken. A held lease is skipped without waiting for it; one that
    another transaction is taking or releasing right now is waited for, unless it is among
    `unlocked_only` (on PostgreSQL; SQLite runs one writer at a time).

    `and_then` (PostgreSQL; ignored elsewhere): a statement built on CLAIMED that goes on
    with the names taken in the same round trip, and its own parameters. Its rows are
    `(name, lease)`: a name taken where `lease` is true, a row of its own where not."""
    token = new_token()
    expires = now + timedelta(seconds=ttl_s)
    conn = session.connection()
    params = {
        "b_names": list(names),
        "b_now": now,
        "b_owner": owner,
        "b_token": token,
        "b_expires": expires,
    }
    if dialect_of(conn).writes_together:
        skip = set(unlocked_only) & set(names)
        params |= {
            "b_names": [name for name in names if name not in skip],
            "b_skip_names": sorted(skip),
            "b_name_array": list(names),
        }
        if and_then is not None:
            statement, more = and_then
            rows = conn.execute(statement, {**params, **more})
            return token, {row.name for row in rows if row.lease}
        return token, set(conn.execute(_CLAIM_OR_CREATE, params).scalars())
    taken = set(conn.execute(_CLAIM, params).scalars())
    # A name not taken is either held, or has no row yet (its first use).
    missing = [
        {"name": name, "owner": owner, "token": token, "expires_at": expires}
        for name in names
        if name not in taken
    ]
    if missing:
        taken |= insert_ignore(session, LEASES, missing)
    return token, taken


def held(session: Session, name: str, now: datetime) -> bool:
    """Whether a live lease of that name is held now."""
    return (
        session.execute(
            select(LEASES.c.name).where(LEASES.c.name == name, ~_FREE), {"b_now": now}
        ).first()
        is not None
    )


def renew(session: Session, name: str, token: str, ttl_s: float, now: datetime) -> bool:
    result = session.connection().execute(
        _RENEW,
        {
            "b_name": name,
            "b_token": token,
            "b_now": now,
            "b_expires": now + timedelta(seconds=ttl_s),
        },
    )
    return rowcount(result) == 1


def release(session: Session, name: str, token: str) -> bool:
    return release_many(session, [name], token) == 1


def release_many(session: Session, names: list[str], token: str) -> int:
    """Release those of these leases that this token still holds; returns how many."""
    result = session.connection().execute(RELEASE, {"b_names": list(names), "b_token": token})
    return rowcount(result)


def unheld(model, now):
    """SQL condition: no live lease holds the row (never leased, released, or expired).
    `model` is a mapped class or a table's columns; `now` a datetime or a bound parameter."""
    return or_(model.lease_expires_at.is_(None), model.lease_expires_at <= now)


def claim_row(
    session: Session,
    model,
    key_column,
    key: str,
    owner: str,
    ttl_s: float,
    now: datetime,
    *conditions,
    **values,
) -> str | None:
    """Take the lease columns of one row (LeaseColumns) if no live lease holds it and the
    extra conditions hold, setting `values` in the same update; returns the token or None.
    Every later write by the holder is conditional on this token."""
    token = new_token()
    result = session.execute(
        update(model)
        .where(key_column == key, *conditions, unheld(model, now))
        .values(
            lease_owner=owner,
            lease_token=token,
            lease_expires_at=now + timedelta(seconds=ttl_s),
            **values,
        )
    )
    return token if rowcount(result) == 1 else None


def renew_row(
    session: Session, model, key_column, key: str, token: str, ttl_s: float, now: datetime
) -> bool:
    """The holder (`token`) keeps its row's lease for `ttl_s` more; False if it lost it."""
    result = session.execute(
        update(model)
        .where(key_column == key, model.lease_token == token)
        .values(lease_expires_at=now + timedelta(seconds=ttl_s))
    )
    return rowcount(result) == 1


def release_row(session: Session, model, key_column, key: str, token: str) -> bool:
    """The holder (`token`) lets its row's lease go; False if it had lost it."""
    result = session.execute(
        update(model).where(key_column == key, model.lease_token == token).values(**RELEASED)
    )
    return rowcount(result) == 1


def reserve_republish(
    session: Session, kind: str, keys: list[tuple[str, ...]], ttl_s: float, now: datetime
) -> list[tuple[str, ...]]:
    """Of these work items of `kind`, those not re-published in the last `ttl_s` seconds;
    each gets a reservation for that long, so a queue of waiting work is not re-published on
    every sweep while its first message is still on the way."""
    names = {key: REPUBLISH_PREFIX + ids.derive("republish", kind, *key) for key in keys}
    if not names:
        return []
    _, taken = claim_many(session, list(names.values()), "sweeper", ttl_s, now)
    return [key for key, name in names.items() if name in taken]


def prune_republish(session: Session, now: datetime) -> int:
    """Drop expired reservations, so the table holds only those of work still waiting."""
    return rowcount(
        session.execute(
            delete(Lease).where(Lease.name.startswith(REPUBLISH_PREFIX), Lease.expires_at <= now)
        )
    )


def heartbeat(session: Session, name: str, owner: str, now: datetime) -> None:
    """Record that the periodic job `name` just finished (the sweep: docs/operations.md)."""
    if not insert_ignore(
        session, table_of(Heartbeat), {"name": name, "owner": owner, "beat_at": now}
    ):
        session.execute(
            update(Heartbeat).where(Heartbeat.name == name).values(owner=owner, beat_at=now)
        )


def heartbeat_age_s(session: Session, name: str, now: datetime) -> float | None:
    """Seconds since the job `name` last finished; None if it never has."""
    row = session.get(Heartbeat, name, populate_existing=True)
    if row is None:
        return None
    return max((now - row.beat_at).total_seconds(), 0.0)

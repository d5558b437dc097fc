"""Named leases (DESIGN 4.8): claimed by a conditional update, fenced by their token.

A holder renews and releases only while its token is still the row's token, so a worker
that was paused past its expiry cannot act on a lease somebody else has since claimed.
"""

import uuid
from datetime import datetime, timedelta

from sqlalchemy import bindparam, or_, update
from sqlalchemy.orm import Session

from models.db import insert_ignore
from models.tables import Lease

LEASES = Lease.__table__
_NAME = LEASES.c.name == bindparam("b_name")
# Built once: every dispatch claims and releases a lane.
_CLAIM = (update(LEASES)
          .where(_NAME, or_(LEASES.c.expires_at.is_(None),
                            LEASES.c.expires_at <= bindparam("b_now")))
          .values(owner=bindparam("b_owner"), token=bindparam("b_token"),
                  expires_at=bindparam("b_expires")))
_RENEW = (update(LEASES)
          .where(_NAME, LEASES.c.token == bindparam("b_token"),
                 LEASES.c.expires_at > bindparam("b_now"))
          .values(expires_at=bindparam("b_expires")))
_RELEASE = (update(LEASES).where(_NAME, LEASES.c.token == bindparam("b_token"))
            .values(owner=None, token=None, expires_at=None))


def new_token() -> str:
    return uuid.uuid4().hex


def claim(session: Session, name: str, owner: str, ttl_s: float, now: datetime) -> str | None:
    """Take the lease if it is free or expired; returns the new token, or None if held."""
    token = new_token()
    expires = now + timedelta(seconds=ttl_s)
    result = session.connection().execute(_CLAIM, {
        "b_name": name, "b_now": now, "b_owner": owner, "b_token": token, "b_expires": expires})
    if result.rowcount == 1:
        return token
    # No free row: either it is held, or it does not exist yet (first use of this name).
    inserted = insert_ignore(session, LEASES, {"name": name, "owner": owner, "token": token,
                                               "expires_at": expires})
    return token if inserted else None


def renew(session: Session, name: str, token: str, ttl_s: float, now: datetime) -> bool:
    result = session.connection().execute(_RENEW, {
        "b_name": name, "b_token": token, "b_now": now,
        "b_expires": now + timedelta(seconds=ttl_s)})
    return result.rowcount == 1


def release(session: Session, name: str, token: str) -> bool:
    result = session.connection().execute(_RELEASE, {"b_name": name, "b_token": token})
    return result.rowcount == 1


def unheld(model, now):
    """SQL condition: no live lease holds the row (never leased, released, or expired).
    `model` is a mapped class or a table's columns; `now` a datetime or a bound parameter."""
    return or_(model.lease_expires_at.is_(None), model.lease_expires_at <= now)


def row_claim(table, key_column, *conditions, **values):
    """An UPDATE that takes the lease columns of the row whose key is `b_key` if no live lease
    holds it and the extra conditions hold, setting `values` too; built once by hot paths
    and run with `take_row`."""
    return (update(table)
            .where(key_column == bindparam("b_key"), *conditions,
                   unheld(table.c, bindparam("b_now")))
            .values(lease_owner=bindparam("b_owner"), lease_token=bindparam("b_token"),
                    lease_expires_at=bindparam("b_expires"), **values))


def take_row(session: Session, statement, key: str, owner: str, ttl_s: float, now: datetime,
             **params) -> str | None:
    """Run a `row_claim` statement; returns the new token, or None if the row was not taken."""
    token = new_token()
    result = session.connection().execute(statement, {
        "b_key": key, "b_now": now, "b_owner": owner, "b_token": token,
        "b_expires": now + timedelta(seconds=ttl_s), **params})
    return token if result.rowcount == 1 else None


def claim_row(session: Session, model, key_column, key: str, owner: str, ttl_s: float,
              now: datetime, *conditions, **values) -> str | None:
    """Take the lease columns of one row (LeaseColumns) if no live lease holds it and the
    extra conditions hold, setting `values` in the same update; returns the token or None.
    Every later write by the holder is conditional on this token."""
    token = new_token()
    result = session.execute(
        update(model)
        .where(key_column == key, *conditions, unheld(model, now))
        .values(lease_owner=owner, lease_token=token,
                lease_expires_at=now + timedelta(seconds=ttl_s), **values))
    return token if result.rowcount == 1 else None

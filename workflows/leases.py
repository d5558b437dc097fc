"""Named leases (DESIGN 4.8): claimed by a conditional update, fenced by their token.

A holder renews and releases only while its token is still the row's token, so a worker
that was paused past its expiry cannot act on a lease somebody else has since claimed.
"""

import uuid
from datetime import datetime, timedelta

from sqlalchemy import or_, update
from sqlalchemy.orm import Session

from models.db import insert_ignore
from models.tables import Lease


def new_token() -> str:
    return uuid.uuid4().hex


def claim(session: Session, name: str, owner: str, ttl_s: float, now: datetime) -> str | None:
    """Take the lease if it is free or expired; returns the new token, or None if held."""
    token = new_token()
    values = {"owner": owner, "token": token, "expires_at": now + timedelta(seconds=ttl_s)}
    result = session.execute(
        update(Lease)
        .where(Lease.name == name, or_(Lease.expires_at.is_(None), Lease.expires_at <= now))
        .values(**values))
    if result.rowcount == 1:
        return token
    # No free row: either it is held, or it does not exist yet (first use of this name).
    inserted = insert_ignore(session, Lease.__table__, {"name": name, **values})
    return token if inserted else None


def renew(session: Session, name: str, token: str, ttl_s: float, now: datetime) -> bool:
    result = session.execute(
        update(Lease).where(Lease.name == name, Lease.token == token, Lease.expires_at > now)
        .values(expires_at=now + timedelta(seconds=ttl_s)))
    return result.rowcount == 1


def release(session: Session, name: str, token: str) -> bool:
    result = session.execute(
        update(Lease).where(Lease.name == name, Lease.token == token)
        .values(owner=None, token=None, expires_at=None))
    return result.rowcount == 1


def unheld(model, now: datetime):
    """SQL condition: no live lease holds the row (never leased, released, or expired)."""
    return or_(model.lease_expires_at.is_(None), model.lease_expires_at <= now)


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

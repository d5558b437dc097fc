"""Registered agent hosts (docs/lifecycles.md: sessions): where each session's runtime calls go.

The host `default` is AGENT_RADAR_RUNTIME_URL and has no row. Any other host is registered
by an operator (`agent-radar host add ID URL`); a session is bound to one host by its latest
activity report or by `ensure_session(host_id=)`. The control plane calls only registered
addresses: a message can name a host, never supply one.
"""

import logging
import math
import re
import threading
import time
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any

from sqlalchemy import delete, func, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from ...models.base import table_of
from ...models.coordination import HostCircuit, ReportRefusals
from ...models.db import insert_ignore, run_read, run_transaction
from ...models.tables import AgentSession, RuntimeHost
from ..adapters.bulkhead import CircuitChange
from ..errors import Conflict, InvalidArgument, NotFound
from ..records import Host
from ..validation import check_id

HOSTS = table_of(RuntimeHost)
DEFAULT_HOST = "default"


# A host id a new host may take: it names the host in logs, `status` rows and metric labels,
# so letters, digits, dots, dashes and underscores (a DNS name fits).
NEW_HOST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_host_id(value: Any, *, allow_default: bool = True, new: bool = False) -> str:
    host_id = check_id("host_id", value)
    if new and not NEW_HOST_ID.fullmatch(host_id):
        raise InvalidArgument(
            "host_id must be 1-64 letters, digits, dots, dashes or underscores, starting "
            "with a letter or digit",
            field="host_id",
        )
    if host_id == DEFAULT_HOST and not allow_default:
        raise InvalidArgument(
            "the host 'default' is AGENT_RADAR_RUNTIME_URL; it cannot be added or removed",
            field="host_id",
        )
    return host_id


def add_host(
    session: Session,
    host_id: str,
    url: str,
    now: datetime,
    replace: bool,
    token: str | None = None,
) -> Host:
    """Register a host with its own token. The same URL and token again is a no-op;
    another URL or token is a Conflict unless `replace` (the host moved to a new address,
    or its token was rotated: its sessions follow it)."""
    row = session.get(RuntimeHost, host_id, with_for_update=True)
    if row is None:
        row = RuntimeHost(host_id=host_id, url=url, created_at=now, token=token)
        session.add(row)
    elif row.url != url or row.token != token:
        if not replace:
            raise Conflict(
                f"host {host_id!r} is registered at {row.url} with another URL or token;"
                " add it with --replace to change it"
            )
        row.url, row.token = url, token
    session.flush()
    return Host(host_id, url, _bound(session, host_id))


def remove_host(session: Session, host_id: str) -> Host:
    """Unregister a host. Refused while sessions are bound to it: their calls would have
    nowhere to go (bind them elsewhere first, by a report or ensure_session(host_id=))."""
    row = session.get(RuntimeHost, host_id, with_for_update=True)
    if row is None:
        raise NotFound(f"no host {host_id!r}")
    bound = _bound(session, host_id)
    if bound:
        raise Conflict(
            f"host {host_id!r} still has {bound} session(s); bind them to another host first"
        )
    session.delete(row)
    session.flush()
    return Host(host_id, row.url)


def list_hosts(session: Session, default_url: str) -> list[Host]:
    counts = dict(
        session.execute(
            select(AgentSession.host_id, func.count()).group_by(AgentSession.host_id)
        ).all()
    )
    rows = session.execute(select(RuntimeHost).order_by(RuntimeHost.host_id)).scalars()
    return [Host(DEFAULT_HOST, default_url, counts.get(DEFAULT_HOST, 0))] + [
        Host(r.host_id, r.url, counts.get(r.host_id, 0)) for r in rows
    ]


def require_host(session: Session, host_id: str) -> str:
    """A host a message or a caller named: registered, or InvalidArgument (docs/lifecycles.md:
    sessions). Its row stays locked (shared) for the transaction, so a `host remove` waits for a
    session being bound to it here, then sees that session and refuses."""
    if host_id != DEFAULT_HOST and (
        session.get(RuntimeHost, host_id, with_for_update={"read": True}) is None
    ):
        raise InvalidArgument(f"unknown host {host_id!r}: register it first", field="host_id")
    return host_id


def token_of(session: Session, host_id: str, default_token: str | None) -> str | None:
    """The token of a host (`default`'s is AGENT_RADAR_RUNTIME_TOKEN, given): what its calls
    carry and its reports are signed with. None for an unknown host, or one without a token."""
    if host_id == DEFAULT_HOST:
        return default_token
    row = session.get(RuntimeHost, host_id)
    return None if row is None else row.token


def address_of(session: Session, host_id: str) -> tuple[str, str | None, str | None]:
    """(host_id, url, token) of a host, as `locator` gives a session's (url None for the host
    `default`, and for a host that is no longer registered)."""
    if host_id == DEFAULT_HOST:
        return (DEFAULT_HOST, None, None)
    row = session.get(RuntimeHost, host_id)
    return (host_id, None, None) if row is None else (host_id, row.url, row.token)


def session_host(session: Session, workspace_id: Any, session_id: Any) -> str:
    """The host a session is bound to (`default` for a session not known yet)."""
    found = session.execute(
        select(AgentSession.host_id).where(
            AgentSession.workspace_id == workspace_id, AgentSession.session_id == session_id
        )
    ).scalar_one_or_none()
    return DEFAULT_HOST if found is None else found


def session_address(session: Session, workspace_id: str, session_id: str) -> tuple:
    """(host_id, url, token) of the host the session lives on: a call asked by this address
    tells of that host, and what it answers is recorded only while the session is still
    there (a move in between leaves it unrecorded, docs/lifecycles.md: sessions)."""
    return address_of(session, session_host(session, workspace_id, session_id))


# The label of a refused report whose host is none of the registered ones: a forged name must
# not make a metric series of its own.
UNREGISTERED = "unregistered"


def _an_id(value: Any) -> bool:
    try:
        check_id("id", value)
    except InvalidArgument:
        return False
    return True


def named_by_report(session: Session, report: Any) -> str:
    """The registered host a report (any shape: it may be refused) names — `signed_by`, else
    `session.host_id`, else its session's own — or UNREGISTERED. The name is the report's
    word, unchecked: a metric of refusals it labels says which host a report named, not who
    sent it. Only well-formed ids reach the database."""
    named: Any = None
    if isinstance(report, dict):
        block = report.get("session")
        named = report.get("signed_by") or (
            block.get("host_id") if isinstance(block, dict) else None
        )
        key = (report.get("workspace_id"), report.get("session_id"))
        if named is None and all(_an_id(v) for v in key):
            named = session_host(session, *key)
    if named == DEFAULT_HOST:
        return DEFAULT_HOST
    if not _an_id(named):
        return UNREGISTERED
    return named if session.get(RuntimeHost, named) is not None else UNREGISTERED


def _bound(session: Session, host_id: str) -> int:
    return session.execute(
        select(func.count()).select_from(AgentSession).where(AgentSession.host_id == host_id)
    ).scalar_one()


def locator(engine: Engine) -> Callable[[str, str], tuple[str, str | None, str | None]]:
    """`locate(workspace_id, session_id) -> (host_id, url, token)` for the runtime router,
    one short read per call (url None for the host `default`, and for a host that was
    removed; token the host's own)."""

    def locate(workspace_id: str, session_id: str) -> tuple[str, str | None, str | None]:
        def read(s: Session) -> tuple[str, str | None, str | None]:
            found = s.execute(
                select(AgentSession.host_id, RuntimeHost.url, RuntimeHost.token)
                .outerjoin(RuntimeHost, RuntimeHost.host_id == AgentSession.host_id)
                .where(
                    AgentSession.workspace_id == workspace_id,
                    AgentSession.session_id == session_id,
                )
            ).first()
            return (DEFAULT_HOST, None, None) if found is None else (found[0], found[1], found[2])

        return run_read(engine, read)

    return locate


def record_circuits(s: Session, changes: Iterable[CircuitChange], worker_id: str) -> None:
    """Record circuits that opened or closed (for `status` and the metrics)."""
    for t in changes:
        if t.open_until is None:
            # Only this process's opening: another's circuit may still be open.
            s.execute(
                delete(HostCircuit).where(
                    HostCircuit.host_id == t.host_id, HostCircuit.opened_by == worker_id
                )
            )
            continue
        values = {
            "open_until": t.open_until,
            "failures": t.failures,
            "last_error": (t.error or "")[:512],
            "opened_by": worker_id,
        }
        if not insert_ignore(s, table_of(HostCircuit), {"host_id": t.host_id, **values}):
            s.execute(update(HostCircuit).where(HostCircuit.host_id == t.host_id).values(values))


# -- refused reports (docs/protocol.md: reports) --------------------------------------------
log = logging.getLogger(__name__)

# A worker process adds its refusals to the database at most this often: a flood of refused
# reports costs one small write per interval, not one per report. The first refusal after a
# quiet interval is written at once.
REFUSALS_FLUSH_S = 10.0


def add_refusals(s: Session, counts: dict[str, tuple[int, str, datetime]]) -> None:
    """Add refusal counts per host (`named_by_report`: bounded names) to their rows."""
    for host_id, (refused, code, at) in counts.items():
        values = {"last_code": code[:32], "last_at": at}
        row = {"host_id": host_id, "refused": refused, **values}
        if not insert_ignore(s, table_of(ReportRefusals), row):
            s.execute(
                update(ReportRefusals)
                .where(ReportRefusals.host_id == host_id)
                .values(refused=ReportRefusals.refused + refused, **values)
            )


def refusals(s: Session, limit: int) -> list[dict[str, Any]]:
    """Reports refused per host they named, the latest first (for `status`)."""
    rows = s.execute(
        select(ReportRefusals).order_by(ReportRefusals.last_at.desc()).limit(limit)
    ).scalars()
    return [
        {
            "host_id": r.host_id,
            "refused": r.refused,
            "last_code": r.last_code,
            "last_at": r.last_at.isoformat(),
        }
        for r in rows
    ]


class RefusalTally:
    """One process's refused reports, added to the database at most every REFUSALS_FLUSH_S
    (thread-safe). Counts not yet written go with the next refusal after the interval."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, tuple[int, str, datetime]] = {}
        self._flushed_at = -math.inf

    def add(self, engine: Engine, host_id: str, code: str, at: datetime) -> None:
        with self._lock:
            refused = self._pending.get(host_id, (0, code, at))[0] + 1
            self._pending[host_id] = (refused, code, at)
            if time.monotonic() - self._flushed_at < REFUSALS_FLUSH_S:
                return
            taken, self._pending = self._pending, {}
            self._flushed_at = time.monotonic()
        try:
            run_transaction(engine, lambda s: add_refusals(s, taken))
        except Exception as exc:  # noqa: BLE001 - the database is away: kept for the next
            log.debug("refused reports not recorded yet: %s", exc)
            with self._lock:
                for host, (n, c, a) in taken.items():
                    self._pending[host] = (self._pending.get(host, (0, c, a))[0] + n, c, a)

"""A session's restore as a state (docs/lifecycles.md: reconcile): the session row's
`restore_due_at` is its outbox. It is set when a restore is wanted (`request`, or the sweeper's
reconcile of a stale mirror), stamped by the restore that runs (`claim`), and cleared by that
restore only if nobody asked again meanwhile (`finish`); the sweeper publishes what is due,
each reserved first so two sweeps never both publish it (`reserve`). The step that runs it is
workflows/steps/restore.py.
"""

import logging
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from ...models.db import rowcount
from ...models.tables import AgentSession
from .. import budgets
from ..goals.outcomes import unknown_current_goal
from ..sessions.rows import Heard, lock_session, record_liveness
from .reinstall import needs_restore

log = logging.getLogger(__name__)

# A restore that met a runtime fault (not a disconnect) is due again after this long, within
# its budget (workflows/budgets.py).
RESTORE_RETRY_S = 10.0
# An offline session with a fence or a clear still to deliver is asked again this often: it may
# come back without a report.
OFFLINE_RECHECK_S = 30.0


def _where_due_is(workspace_id: str, session_id: str, due_at) -> tuple:
    return (
        AgentSession.workspace_id == workspace_id,
        AgentSession.session_id == session_id,
        AgentSession.restore_due_at == due_at
        if due_at is not None
        else AgentSession.restore_due_at.is_(None),
    )


def request(row: AgentSession, now: datetime) -> bool:
    """Make the session's restore due now (the row is locked). True when the caller should
    publish it; False when one is already due (its message is out, or the sweeper's is)."""
    if row.restore_due_at is not None and row.restore_due_at <= now:
        return False
    row.restore_due_at = now
    return True


def request_after_hold(session: Session, workspace_id: str, session_id: str, now: datetime) -> bool:
    """A run released the session: its restore is due now if the host is owed what a restore
    delivers and holds back while a run holds the session (workflows/steps/restore.py): a
    clear settled locally or the current goal not known to be there (or a fence not
    installed). True when the caller should publish it (see request)."""
    row = lock_session(session, workspace_id, session_id)
    owed = needs_restore(session, row) or unknown_current_goal(session, workspace_id, session_id)
    return bool(owed) and request(row, now)


def request_reconcile(session: Session, keys, due_at: datetime, now: datetime) -> int:
    """The sweeper's reconcile of sessions whose mirror may be stale (activity.reconcile):
    their restore, which asks the host, due at `due_at` unless one is due already."""
    for workspace_id, session_id in keys:
        session.execute(
            update(AgentSession)
            .where(*_where_due_is(workspace_id, session_id, None))
            .values(restore_due_at=due_at, reconciled_at=now)
        )
    return len(keys)


def due(session: Session, cutoff: datetime, limit: int) -> list[Any]:
    """(workspace, session, due at) of restores due by `cutoff`, oldest first."""
    return list(
        session.execute(
            select(AgentSession.workspace_id, AgentSession.session_id, AgentSession.restore_due_at)
            .where(AgentSession.restore_due_at <= cutoff)
            .order_by(AgentSession.restore_due_at)
            .limit(limit)
        ).all()
    )


def reserve(
    session: Session, workspace_id: str, session_id: str, due_at: datetime, until: datetime
) -> bool:
    """The sweeper publishes this due restore: nobody else does until `until`."""
    done = session.execute(
        update(AgentSession)
        .where(*_where_due_is(workspace_id, session_id, due_at))
        .values(restore_due_at=until)
    )
    return rowcount(done) == 1


def claim(session: Session, workspace_id: str, session_id: str, stamp: datetime) -> datetime | None:
    """Stamp the due restore as ours (a lease on it until `stamp`: the sweeper leaves it
    alone until then). None when no restore is due."""
    row = session.get(AgentSession, (workspace_id, session_id), populate_existing=True)
    if row is None or row.restore_due_at is None:
        return None
    return stamp if reserve(session, workspace_id, session_id, row.restore_due_at, stamp) else None


def finish(
    session: Session,
    workspace_id: str,
    session_id: str,
    stamp: datetime,
    outcome: str,
    error: str | None,
    now: datetime,
    offline: Heard | None = None,
) -> None:
    """Clear the due restore, unless someone asked again while this one ran (they set it to
    their now) — or what it was for is still there. A fault uses one attempt of the restore's
    budget (workflows/budgets.py) and is tried again after RESTORE_RETRY_S; past the budget
    it stops, and `status` shows it until the next restore someone asks for succeeds. An
    offline session is a wait: the answer (`offline`) is recorded (background work settles
    locally until it is back) unless a newer one is."""
    row = lock_session(session, workspace_id, session_id)
    if outcome == "offline":
        record_liveness(row, False, offline or Heard(now))
    if outcome == "restored" and needs_restore(session, row):
        # Still due: a fence came meanwhile, or the host's epoch moved on while it ran.
        # Again, as an attempt: a host whose epoch moves every time runs out of budget.
        outcome, error = "retry", "still due after a restore (the host's epoch moved on?)"
    if outcome == "retry":
        row.restore_attempt = (row.restore_attempt or 0) + 1
        row.restore_failing_since = row.restore_failing_since or now
        row.restore_error = error
    elif outcome != "offline":
        row.restore_attempt, row.restore_failing_since, row.restore_error = 0, None, None
    if row.restore_due_at != stamp:
        return
    retry_at: datetime | None = None
    if outcome == "retry":
        why = budgets.spent(row.restore_attempt, row.restore_failing_since, now)
        if why is None:
            retry_at = now + timedelta(seconds=RESTORE_RETRY_S)
        else:
            row.restore_error = budgets.exhausted(why, error)
            log.error("restore of session %s/%s: %s", workspace_id, session_id, row.restore_error)
    elif outcome == "offline" and needs_restore(session, row):
        retry_at = now + timedelta(seconds=OFFLINE_RECHECK_S)
    row.restore_due_at = retry_at

"""A move is a stop at the old host and a start at the new one (docs/lifecycles.md: sessions).

When a session moves from host A to host B, what ran at A does not end because the record says
so: every turn of it that has not settled, and its live maintenance run, get a durable cancel
addressed to A (`CancelOperation.host_id`), delivered by the cancel step, retried while A is
offline and delivered when it is seen again. At B, meanwhile, the session is idle: its turns
at A end `interrupted` in the record (the fences and prompts that waited on them go on), and
the run ends as on a restart (runs.end_for_restart).
"""

from datetime import datetime

from sqlalchemy.orm import Session

from ...models.enums import TurnOutcome
from ...models.tables import CancelOperation
from .. import ids
from ..maintenance import runs
from . import cancels


def stop_at_old_host(
    session: Session, workspace_id: str, session_id: str, old_host: str, now: datetime
) -> tuple[list[str], list[str]]:
    """The stop a move owes `old_host`, in the caller's transaction (the session row is
    locked, the move not yet recorded). Returns (the cancels to publish after commit, the
    fences that waited on the ended turns, now due)."""
    reason = f"session-move:{old_host}"
    turn_ids = cancels.unsettled_turns(session, workspace_id, session_id)
    owed: list[str] = []
    woken: list[str] = []
    for turn_id in turn_ids:
        cancel = cancels.prepare(session, workspace_id, session_id, turn_id, reason, now, join=True)
        if cancel.status in cancels.OPEN_CANCEL_STATUSES:
            cancel.host_id = cancel.host_id or old_host
            owed.append(cancel.operation_id)
        cancels.settle_turn_row(
            session, workspace_id, session_id, turn_id, TurnOutcome.INTERRUPTED, now
        )
        woken += cancels.waiting_fences(session, workspace_id, session_id, turn_id, now)
    run = runs.live_run(session, workspace_id, session_id)
    if run is not None:
        stop_id = ids.run_stop_id(workspace_id, session_id, run.run_id)
        if session.get(CancelOperation, stop_id) is None:
            cancels.add(
                session,
                stop_id,
                workspace_id,
                session_id,
                run.run_id,
                reason,
                now,
                run_id=run.run_id,
                host_id=old_host,
            )
            owed.append(stop_id)
    return owed, woken

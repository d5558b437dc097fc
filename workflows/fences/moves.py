"""A move is a stop at the old host and a start at the new one (docs/lifecycles.md: sessions).

When a session moves from host A to host B, what ran at A does not end because the record says
so: every turn of it that has not settled, and its live maintenance run, get a durable cancel
addressed to A (`CancelOperation.host_id`), delivered by the cancel step, retried while A is
offline and delivered when it is seen again. At B, meanwhile, the session is idle: its turns
at A end `interrupted` in the record (the fences and prompts that waited on them go on), and
the run ends as on a restart (runs.end_for_restart).
"""

from datetime import datetime

from sqlalchemy import Select, or_, select
from sqlalchemy.orm import Session

from ...models.enums import TurnOutcome
from ...models.operations import CancelOperation, MaintenanceRun, Prompt
from .. import ids
from ..kinds.cancel import OPEN_CANCEL_STATUSES
from ..maintenance import runs
from ..prompts import queue as prompts
from ..sessions import turns
from ..sessions.rows import lock_session
from . import cancels


def stop_at_old_host(
    session: Session, workspace_id: str, session_id: str, old_host: str, now: datetime
) -> tuple[list[str], list[str]]:
    """The stop a move owes `old_host`, in the caller's transaction (the session row is
    locked, the move not yet recorded). Returns (the cancels to publish after commit, the
    fences that waited on the ended turns, now due)."""
    reason = f"session-move:{old_host}"
    owed: list[str] = []
    woken: list[str] = []
    # A prompt's turn no report told of yet is on record from now on, to be stopped there too.
    for prompt_id, turn_id in session.execute(
        select(Prompt.prompt_id, Prompt.turn_id).where(
            Prompt.workspace_id == workspace_id,
            Prompt.session_id == session_id,
            *prompts.unrecorded(now),
        )
    ).all():
        turns.record_prompt_turn(
            session, workspace_id, session_id, old_host, str(turn_id), prompt_id, now
        )
    for turn_id in turns.unsettled_turns(session, workspace_id, session_id):
        stopped = _stop_turn(session, workspace_id, session_id, turn_id, old_host, now)
        owed += stopped[0]
        woken += stopped[1]
    run = runs.live_run(session, workspace_id, session_id)
    if run is not None:
        owed += stop_run(session, run, old_host, reason, now)
    return owed, woken


def stop_run(
    session: Session, run: MaintenanceRun, host_id: str, reason: str, now: datetime
) -> list[str]:
    """A durable stop of a run ended here, owed to the host it went to: its start may still be
    on the wire, and a stop of a run the host does not know has it refuse that start
    (docs/protocol.md: a run cancelled before it came). The stop to publish, if new."""
    stop_id = ids.run_stop_id(run.workspace_id, run.session_id, run.run_id)
    if session.get(CancelOperation, stop_id) is not None:
        return []
    cancels.add(
        session,
        stop_id,
        run.workspace_id,
        run.session_id,
        run.run_id,
        reason,
        now,
        run_id=run.run_id,
        host_id=host_id,
    )
    return [stop_id]


def _stops_owed(workspace_id: str, session_id: str, host_id: str, *where) -> Select:
    """The stops a move owes `host_id` that are not delivered yet (their turn or run may still
    run there), narrowed by `where`."""
    return select(CancelOperation.operation_id).where(
        CancelOperation.workspace_id == workspace_id,
        CancelOperation.session_id == session_id,
        CancelOperation.host_id == host_id,
        CancelOperation.status.in_(OPEN_CANCEL_STATUSES),
        *where,
    )


def stops_due_at(
    session: Session, workspace_id: str, session_id: str, host_id: str, now: datetime
) -> list[str]:
    """The stops a move back to `host_id` delivers first (client.ensure_session), or the next
    call would run beside what they stop: every one not in a failure's backoff at `now`, so
    that retrying the move spends no budget (a wait, offline or a run still stopping, costs
    none)."""
    due = or_(CancelOperation.failing_since.is_(None), CancelOperation.next_attempt_at <= now)
    return list(session.execute(_stops_owed(workspace_id, session_id, host_id, due)).scalars())


def stops_barring_return(
    session: Session, workspace_id: str, session_id: str, host_id: str
) -> list[str]:
    """The stops owed to `host_id` that bar a move back there (epochs.bind_host): every one
    but those waiting for the session to come back there, which found it offline just now —
    the move back resumes it, a new epoch where nothing of the old one runs
    (docs/protocol.md: resume)."""
    not_offline = CancelOperation.last_error.is_distinct_from(cancels.WAITING_OFFLINE)
    return list(
        session.execute(_stops_owed(workspace_id, session_id, host_id, not_offline)).scalars()
    )


def _stop_turn(
    session: Session, workspace_id: str, session_id: str, turn_id: str, old_host: str, now
) -> tuple[list[str], list[str]]:
    """One turn of the stop: a cancel owed to `old_host`, its end `interrupted` here."""
    reason = f"session-move:{old_host}"
    cancel = cancels.prepare(session, workspace_id, session_id, turn_id, reason, now, join=True)
    owed: list[str] = []
    if cancel.status in OPEN_CANCEL_STATUSES:
        cancel.host_id = cancel.host_id or old_host
        owed.append(cancel.operation_id)
    cancels.settle_turn_row(
        session, workspace_id, session_id, turn_id, TurnOutcome.INTERRUPTED, now
    )
    return owed, cancels.waiting_fences(session, workspace_id, session_id, turn_id, now)


def prompt_sent(
    session: Session,
    prompt: Prompt,
    host_id: str,
    turn_id: object,
    now: datetime,
) -> list[str]:
    """`host_id` (the session's when the prompt went) took the prompt and answered
    with `turn_id`: the turn is the prompt's; its reports put it on record (the answer tells
    no epoch: a turn recorded from it at the epoch believed would end wrongly at a restart not
    yet seen). If the session moved to another host meanwhile, the move found no turn of it to
    stop: it is put on record at `host_id` and stopped there now, as the move would have
    (turns.record_prompt_turn). Returns the cancels to publish."""
    ws, sid = prompt.workspace_id, prompt.session_id
    row = lock_session(session, ws, sid)
    prompts.sent(session, prompt.prompt_id, turn_id, now)
    if not isinstance(turn_id, str) or row.host_id == host_id:
        return []
    key = turns.record_prompt_turn(session, ws, sid, host_id, turn_id, prompt.prompt_id, now)
    return _stop_turn(session, ws, sid, key, host_id, now)[0]

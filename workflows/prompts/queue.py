"""Queued prompts (docs/lifecycles.md: prompts): one at a time per session, only when the session
has no running turn and no maintenance run holds it; the next goes when the previous turn
settles."""

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import exists, func, or_, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, aliased

from ...models.db import run_transaction
from ...models.enums import TurnOutcome, TurnPhase
from ...models.operations import Prompt
from ...models.tables import AgentSession, Turn
from .. import accept, budgets, ids, leases
from ..adapters.runtime import BUSY
from ..errors import PromptConflict, RuntimeDisconnected, RuntimeFault
from ..kinds.prompt import PromptStatus
from ..maintenance.runs import holds, session_held
from ..sessions.rows import append_event, lock_session, prompt_in_flight, same_session
from ..sessions.turns import unsettled_turns
from ..transitions import Machine
from ..validation import check_id, check_submit_id, check_text

log = logging.getLogger(__name__)

# A prompt's states, one table: queued, dispatched when it goes, back to the queue when its
# send failed (or its worker died before a turn was recorded), and completed, failed or
# cancelled as its turn settles (failed too when its send failed for good).
PROMPT = Machine(
    Prompt,
    Prompt.prompt_id,
    Prompt.status,
    {
        PromptStatus.QUEUED: frozenset({PromptStatus.DISPATCHED}),
        PromptStatus.DISPATCHED: frozenset(
            {
                PromptStatus.QUEUED,
                PromptStatus.COMPLETED,
                PromptStatus.FAILED,
                PromptStatus.CANCELLED,
            }
        ),
    },
)

# Prompt text is user input for the agent; 64 KiB keeps rows and messages small.
MAX_PROMPT_BYTES = 64 * 1024


@dataclass(frozen=True)
class PromptRequest:
    workspace_id: str
    session_id: str
    text: str
    client_submit_id: str

    @classmethod
    def parse(
        cls, workspace_id: Any, session_id: Any, text: Any, *, client_submit_id: Any
    ) -> "PromptRequest":
        return cls(
            check_id("workspace_id", workspace_id),
            check_id("session_id", session_id),
            check_text("text", text, MAX_PROMPT_BYTES),
            check_submit_id("client_submit_id", client_submit_id),
        )

    @property
    def prompt_id(self) -> str:
        return ids.prompt_id(self.workspace_id, self.session_id, self.client_submit_id)


def submit(session: Session, request: PromptRequest, now: datetime) -> tuple[Prompt, bool]:
    lock_session(session, request.workspace_id, request.session_id)
    existing = accept.find_replay(
        session,
        Prompt,
        request.prompt_id,
        (request.text,),
        lambda p: (p.text,),
        lambda p: PromptConflict(
            f"client_submit_id {request.client_submit_id!r} was used for another prompt",
            prompt_id=p.prompt_id,
        ),
    )
    if existing is not None:
        return existing, False
    last = session.execute(
        select(func.max(Prompt.position)).where(
            Prompt.workspace_id == request.workspace_id, Prompt.session_id == request.session_id
        )
    ).scalar_one()
    prompt = Prompt(
        prompt_id=request.prompt_id,
        workspace_id=request.workspace_id,
        session_id=request.session_id,
        client_submit_id=request.client_submit_id,
        text=request.text,
        status=PromptStatus.QUEUED,
        position=(last or 0) + 1,
        created_at=now,
    )
    session.add(prompt)
    session.flush()
    # The session's history shows the prompt (its status now: `history`), not its text.
    append_event(
        session,
        request.workspace_id,
        request.session_id,
        kind="prompt",
        record_id=f"prompt:{prompt.prompt_id}",
        payload={"client_submit_id": request.client_submit_id, "position": prompt.position},
        now=now,
    )
    return prompt, True


def take_next(session: Session, workspace_id: str, session_id: str, now: datetime) -> Prompt | str:
    """Mark the session's next prompt dispatched if it may go now; else say why not."""
    row = lock_session(session, workspace_id, session_id)
    if session_held(session, workspace_id, session_id):
        return "held"
    if prompt_in_flight(session, workspace_id, session_id) or row.active_turn_id is not None:
        return "busy"
    prompt = session.execute(
        select(Prompt)
        .where(
            Prompt.workspace_id == workspace_id,
            Prompt.session_id == session_id,
            Prompt.status == PromptStatus.QUEUED,
        )
        .order_by(Prompt.position)
        .limit(1)
    ).scalar_one_or_none()
    if prompt is None:
        return "idle"
    PROMPT.move(session, prompt.prompt_id, PromptStatus.DISPATCHED, dispatched_at=now)
    return prompt


def sent(session: Session, prompt_id: str, turn_id: Any, now: datetime) -> None:
    """The host took the prompt: the turn it answered with is the prompt's, and it is in
    flight from now (how long it has gone unreported counts from here: `unrecorded`)."""
    session.execute(
        update(Prompt)
        .where(Prompt.prompt_id == prompt_id, Prompt.status == PromptStatus.DISPATCHED)
        .values(turn_id=turn_id, dispatched_at=now)
    )


def not_sent(
    session: Session, prompt: Prompt, exc: RuntimeFault | RuntimeDisconnected, now: datetime
) -> tuple[str, bool]:
    """The call failed: the prompt was not sent, or is not known to have been. It goes back
    to the queue at its place (the runtime dedupes by prompt_id if it did arrive) and the
    sweeper tries again. An offline session is a wait and uses no budget, and so is a host
    that refused it `busy` while the record shows what it waits for (a turn unsettled, a run
    holding the session: the queue waits for its end); any other retryable fault, a `busy`
    the record cannot explain included, uses one attempt of the budget (budgets.py); a final
    fault, or a budget spent, ends the prompt `failed` and the queue moves on. Returns the
    outcome, and whether the prompt waits for what the record shows (whose end wakes the
    queue)."""
    held = exc.code == BUSY and _busy_on_record(session, prompt)
    error = str(exc)
    values: dict[str, Any] = {"dispatched_at": None, "last_error": error}
    to, outcome = PromptStatus.QUEUED, f"retry: {exc.code}"
    if held or isinstance(exc, RuntimeDisconnected):  # a wait: nothing of it reached the host
        values["failing_since"] = None
    else:
        values["attempt"] = Prompt.attempt + 1
        why = budgets.spent(prompt.attempt + 1, prompt.failing_since or now, now)
        if not exc.retryable:
            to, outcome = PromptStatus.FAILED, "failed"
        elif why is not None:
            to, outcome = PromptStatus.FAILED, "failed"
            values["last_error"] = budgets.exhausted(why, error)
        else:
            values["failing_since"] = func.coalesce(Prompt.failing_since, now)
    PROMPT.move(session, prompt.prompt_id, to, Prompt.turn_id.is_(None), **values)
    log.warning(
        "prompt %s: send failed (%s): %s",
        prompt.prompt_id,
        outcome,
        values.get("last_error"),
        extra={
            "workspace_id": prompt.workspace_id,
            "session_id": prompt.session_id,
            "prompt_id": prompt.prompt_id,
            "attempt": prompt.attempt + 1,
        },
    )
    return outcome, held


def _busy_on_record(session: Session, prompt: Prompt) -> bool:
    """A turn unsettled on record (reported `submitted` or `running`), or a run holding it."""
    ws, sid = prompt.workspace_id, prompt.session_id
    return bool(unsettled_turns(session, ws, sid)) or session_held(session, ws, sid)


# A prompt ends as its turn did. A turn that ended unseen (`interrupted`: the host no longer
# lists it, or restarted under it) may have finished its work: its prompt ends `completed`.
_ENDS_AS: dict[str, PromptStatus] = {
    TurnOutcome.FAILED: PromptStatus.FAILED,
    TurnOutcome.CANCELED: PromptStatus.CANCELLED,
}


def on_turn_settled(
    session: Session,
    workspace_id: str,
    session_id: str,
    prompt_id: str | None,
    outcome: str,
    turn_id: str | None = None,
) -> bool:
    """The prompt's turn settled: the prompt is done. True if the queue may move on. Only
    a prompt of the report's own workspace and session is touched (docs/operations.md), and
    with `turn_id` (the host's id of the turn that settled), only one its host did not answer
    with another turn: a report of another turn naming the prompt ends nothing, as its own
    turn may still run there."""
    if prompt_id is None:
        return False
    PROMPT.move(
        session,
        prompt_id,
        _ENDS_AS.get(outcome, PromptStatus.COMPLETED),
        Prompt.workspace_id == workspace_id,
        Prompt.session_id == session_id,
        *(() if turn_id is None else (or_(Prompt.turn_id.is_(None), Prompt.turn_id == turn_id),)),
    )
    return True


def sessions_with_queued_prompts(
    engine: Engine, now: datetime, stale_s: float, limit: int, *, republish_interval_s: float
) -> list[tuple[str, str]]:
    """For the sweeper: sessions whose next prompt could go now but has not (its push was
    lost). A prompt marked dispatched whose call never recorded a turn (the worker died) goes
    back to the queue first. A session that is held, has a prompt in flight or a running
    turn is left alone: the run's release or the turn's settle pushes it, and once that has
    happened it qualifies here if that push was lost. A session is returned once per
    `republish_interval_s` while its push is on the way (see leases.reserve_republish)."""
    in_flight = aliased(Prompt)

    def find(s: Session):
        PROMPT.move_all(
            s,
            PromptStatus.QUEUED,
            Prompt.turn_id.is_(None),
            Prompt.dispatched_at <= now - timedelta(seconds=stale_s),
            dispatched_at=None,
        )
        waiting = [
            tuple(r)
            for r in s.execute(
                select(Prompt.workspace_id, Prompt.session_id)
                .join(AgentSession, same_session(AgentSession, Prompt), isouter=True)
                .where(
                    Prompt.status == PromptStatus.QUEUED,
                    AgentSession.active_turn_id.is_(None),
                    ~holds(Prompt.workspace_id, Prompt.session_id),
                    ~exists().where(
                        same_session(in_flight, Prompt), in_flight.status == PromptStatus.DISPATCHED
                    ),
                )
                .distinct()
                .limit(limit)
            ).all()
        ]
        return leases.reserve_republish(s, "prompts", waiting, republish_interval_s, now)

    return run_transaction(engine, find)


def unrecorded(sent_before: datetime) -> tuple:
    """SQL conditions: a prompt the host took (its turn id known) before `sent_before` with no
    turn of it running on record: no report of its turn came, or only of one that settled
    before (a send that timed out but reached the host, and went again: the host answered
    with that turn, or with another after a restart). Only the host's answer tells which."""
    return (
        Prompt.status == PromptStatus.DISPATCHED,
        Prompt.turn_id.is_not(None),
        Prompt.dispatched_at < sent_before,
        ~exists().where(
            Turn.workspace_id == Prompt.workspace_id,
            Turn.session_id == Prompt.session_id,
            Turn.prompt_id == Prompt.prompt_id,
            Turn.phase != TurnPhase.SETTLED,
        ),
    )

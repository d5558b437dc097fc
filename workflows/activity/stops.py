"""Session stop (docs/lifecycles.md: sessions): one idempotent operation that cancels a session's
running turn (a durable cancel, 4.5) and its active maintenance run (a cancel request, 4.6). Queued
prompts and goal operations stay queued. Its record settles once both have ended."""

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from ...models.operations import SessionStop
from .. import accept, ids
from ..errors import Conflict
from ..fences import cancels
from ..maintenance import runs
from ..sessions.rows import append_event, lock_session
from ..validation import check_id, check_reason, check_submit_id


@dataclass(frozen=True)
class StopRequest:
    workspace_id: str
    session_id: str
    client_submit_id: str
    reason: str

    @classmethod
    def parse(
        cls, workspace_id: Any, session_id: Any, *, client_submit_id: Any, reason: Any = ""
    ) -> "StopRequest":
        return cls(
            check_id("workspace_id", workspace_id),
            check_id("session_id", session_id),
            check_submit_id("client_submit_id", client_submit_id),
            check_reason(reason),
        )

    @property
    def stop_id(self) -> str:
        return ids.session_stop_id(self.workspace_id, self.session_id, self.client_submit_id)


def stop(session: Session, request: StopRequest, now: datetime) -> tuple[SessionStop, bool]:
    """Accept a stop in the caller's transaction (session row locked). Returns (stop,
    created); a replay returns the stop it made, another reason is a Conflict."""
    row = lock_session(session, request.workspace_id, request.session_id)
    existing = accept.find_replay(
        session,
        SessionStop,
        request.stop_id,
        (request.reason,),
        lambda s: (s.reason,),
        lambda s: Conflict(
            f"client_submit_id {request.client_submit_id!r} already stopped this session "
            f"for {s.reason!r}",
            stop_id=s.stop_id,
        ),
    )
    if existing is not None:
        return existing, False
    turn_id, cancel_id = row.active_turn_id, None
    if turn_id is not None:
        cancel_id = cancels.prepare_or_existing(
            session,
            request.workspace_id,
            request.session_id,
            turn_id,
            f"session-stop:{request.stop_id}",
            now,
        )
    run = runs.live_run(session, request.workspace_id, request.session_id)
    if run is not None:
        runs.request_cancel(session, run.run_id, now)  # ignored where a cancel cannot apply
    stop_row = SessionStop(
        stop_id=request.stop_id,
        workspace_id=request.workspace_id,
        session_id=request.session_id,
        client_submit_id=request.client_submit_id,
        reason=request.reason,
        turn_id=turn_id,
        cancel_operation_id=cancel_id,
        run_id=run.run_id if run is not None else None,
        created_at=now,
    )
    session.add(stop_row)
    session.flush()
    append_event(
        session,
        request.workspace_id,
        request.session_id,
        kind="session-stop",
        record_id=f"session-stop:{request.stop_id}",
        payload={"reason": request.reason, "turn_id": turn_id, "run_id": stop_row.run_id},
        now=now,
    )
    return stop_row, True

"""User-triggered session control: `ensure_session` (docs/lifecycles.md: fences) and the session
view."""

from datetime import datetime

from sqlalchemy.orm import Session

from ...models.tables import AgentSession
from ..fences.reinstall import record_installed, session_fences
from ..goals.operations import open_client_operations
from ..sessions.rows import Heard, lock_session, record_liveness
from .epochs import EpochEffects, observe_epoch


def durable_fences(session: Session, workspace_id: str, session_id: str) -> list[tuple[str, dict]]:
    """Every fence the session must carry on resume, all of its goal generation fences, as
    (fence_id, what the runtime protocol carries), oldest first."""
    return [
        (fence_id, {"target_operation_id": op_id, "target_revision": rev})
        for fence_id, op_id, rev in session_fences(session, workspace_id, session_id)
    ]


def record_live(
    session: Session,
    workspace_id: str,
    session_id: str,
    epoch: int,
    now: datetime,
    installed: list[str],
    heard: Heard,
) -> tuple[list[str], EpochEffects]:
    """Mark the session live at `epoch` (a resume or liveness answer, `heard`); returns its
    open goal operations to wake and what a newer epoch set in motion. A resume preloaded and
    reinstalled the fences `installed`: they are installed at that epoch. The answer of a host
    the session has left since (a move meanwhile) is recorded nowhere."""
    row = lock_session(session, workspace_id, session_id)
    if not record_liveness(row, True, heard) and heard.host != row.host_id:
        return [], EpochEffects()
    effects = observe_epoch(session, row, epoch, now)
    record_installed(session, installed, row.host_id, epoch)
    return open_client_operations(session, workspace_id, session_id), effects


def load_session(session: Session, workspace_id: str, session_id: str) -> AgentSession | None:
    return session.get(AgentSession, (workspace_id, session_id))

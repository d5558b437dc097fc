"""Fences restored once per runtime epoch (DESIGN 4.9): an agent host that restarted lost the
fences it held in memory, so before any goal call, prompt or maintenance start reaches the
session again, every durable fence of the session is installed there once."""

from sqlalchemy import update
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from models.db import run_transaction
from models.tables import AgentSession
from workflows.adapters.runtime import RuntimePort
from workflows.fences.submit import session_fences


def record_fences_installed(
    session: Session, workspace_id: str, session_id: str, epoch: int
) -> None:
    session.execute(
        update(AgentSession)
        .where(
            AgentSession.workspace_id == workspace_id,
            AgentSession.session_id == session_id,
            AgentSession.fences_epoch < epoch,
        )
        .values(fences_epoch=epoch)
    )


def ensure_fences_installed(
    engine: Engine, runtime: RuntimePort, workspace_id: str, session_id: str
) -> bool:
    """Before a goal call, a prompt or a maintenance start reaches the session: if its host
    is at a newer epoch than its fences were installed at, install every durable fence there
    once (require_live: background work never resumes a session). True if it installed.
    Runtime faults propagate to the caller, which treats them as its own call's."""

    def due(s: Session) -> tuple[int, list[dict]] | None:
        row = s.get(AgentSession, (workspace_id, session_id))
        if row is None or (row.fences_epoch or 0) >= (row.runtime_epoch or 0):
            return None
        return row.runtime_epoch, session_fences(s, workspace_id, session_id)

    todo = run_transaction(engine, due)
    if todo is None:
        return False
    epoch, fences = todo
    for fence in fences:
        runtime.install_fence(workspace_id, session_id, require_live=True, **fence)
    run_transaction(engine, lambda s: record_fences_installed(s, workspace_id, session_id, epoch))
    return True

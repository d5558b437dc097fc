"""Where each durable fence is installed (docs/lifecycles.md: sessions), tracked per fence,
explicitly.

Each fence records the (host, epoch) at which it was last installed, as the installer knew
them before its call. A fence whose (host, epoch) is not the session's — never installed, an
older epoch, the first epoch learnt after an install at an unknown one, another host — is not
known to be there, and is installed before any goal call, prompt or maintenance start reaches
the session, and whenever the session is learnt to be live (a restore).

A record can only be too pessimistic, never too hopeful: the (host, epoch) it names are the
ones known before the call, so a restart or a move during it leaves a record that no longer
matches, and the fence is installed once more.
"""

from sqlalchemy import exists, or_, select, update
from sqlalchemy.orm import Session

from ...models.operations import GoalFence
from ...models.tables import AgentSession
from ..goals.tables import not_installed_at


def session_fences(
    session: Session, workspace_id: str, session_id: str, *conditions
) -> list[tuple[str, str, int]]:
    """The session's fences (those matching `conditions`), oldest first, as (fence_id,
    target_operation_id, target_revision)."""
    rows = session.execute(
        select(GoalFence.fence_id, GoalFence.target_operation_id, GoalFence.target_revision)
        .where(
            GoalFence.workspace_id == workspace_id, GoalFence.session_id == session_id, *conditions
        )
        .order_by(GoalFence.created_at)
    ).all()
    return [(fence_id, op_id, rev) for fence_id, op_id, rev in rows]


def missing_fences(
    session: Session, workspace_id: str, session_id: str
) -> tuple[str, int, list[tuple[str, str, int]]] | None:
    """The session's (host, epoch) and its fences not known to be installed there (as
    session_fences gives them); None if there are none."""
    row = session.get(AgentSession, (workspace_id, session_id), populate_existing=True)
    if row is None:
        return None
    epoch = row.runtime_epoch or 0
    fences = session_fences(
        session, workspace_id, session_id, not_installed_at(GoalFence, row.host_id, epoch)
    )
    return (row.host_id, epoch, fences) if fences else None


def record_installed(session: Session, fence_ids: list[str], host_id: str, epoch: int) -> None:
    """These fences were installed at (host_id, epoch) as known before the call."""
    if fence_ids:
        session.execute(
            update(GoalFence)
            .where(GoalFence.fence_id.in_(fence_ids))
            .values(installed_host=host_id, installed_epoch=epoch)
        )


def needs_restore(session: Session, row: AgentSession) -> bool:
    """The session has a fence not known to be installed at its (host, epoch), or a clear
    that was settled locally without reaching the agent."""
    return bool(
        session.execute(
            select(
                exists().where(
                    GoalFence.workspace_id == row.workspace_id,
                    GoalFence.session_id == row.session_id,
                    or_(
                        not_installed_at(GoalFence, row.host_id, row.runtime_epoch or 0),
                        GoalFence.clear_undelivered.is_(True),
                    ),
                )
            )
        ).scalar_one()
    )

"""A session's durable fences at its host (docs/lifecycles.md: fences, sessions): installed before
any other call there (every step that calls a session's host runs this first), and preloaded when a
user's own call resumes an offline session (background work never resumes one)."""

from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from ...models.db import run_transaction
from ..adapters.runtime import RuntimePort
from ..fences.reinstall import missing_fences, record_installed
from ..sessions import hosts


def ensure_fences_installed(
    engine: Engine,
    runtime: RuntimePort,
    workspace_id: str,
    session_id: str,
    *,
    require_live: bool = True,
) -> bool:
    """Install every durable fence of the session not known to be installed at its (host,
    epoch), once, and record it. Background work passes require_live (it never resumes a
    session); a user's own call (ensure_session) does not. True if it installed any.
    Runtime faults propagate to the caller, which treats them as its own call's. The calls
    go to the host the fences were found missing at, by name: a move meanwhile must not
    send them to the new host and record them installed at the old one."""
    todo = run_transaction(engine, lambda s: _missing_at(s, workspace_id, session_id))
    if todo is None:
        return False
    address, epoch, fences = todo
    there = runtime.on_host(*address)
    for _fence_id, target_operation_id, target_revision in fences:
        there.install_fence(
            workspace_id,
            session_id,
            target_operation_id=target_operation_id,
            target_revision=target_revision,
            require_live=require_live,
        )
    installed = [fence_id for fence_id, _op, _rev in fences]
    run_transaction(engine, lambda s: record_installed(s, installed, address[0], epoch))
    return True


def _missing_at(s: Session, workspace_id: str, session_id: str) -> tuple | None:
    """missing_fences, with the address of its host (hosts.address_of)."""
    todo = missing_fences(s, workspace_id, session_id)
    return todo and (hosts.address_of(s, todo[0]), *todo[1:])


def resume_if_offline(
    runtime: RuntimePort, workspace_id: str, session_id: str, fences: list[dict]
) -> tuple[bool, int]:
    """Resume an offline session with its fences preloaded. Returns (resumed, epoch).
    Only user-triggered paths call this: background work never resumes a session."""
    liveness = runtime.liveness(workspace_id, session_id)
    if liveness.get("live"):
        return False, int(liveness.get("runtime_epoch") or 0)
    answer = runtime.resume(workspace_id, session_id, fences)
    # Reinstall them too before anything else reaches the session: a resume that dropped
    # one must not let a fenced generation run. The user's own call: require_live false.
    for fence in fences:
        runtime.install_fence(workspace_id, session_id, require_live=False, **fence)
    return True, int(answer.get("runtime_epoch") or 0)

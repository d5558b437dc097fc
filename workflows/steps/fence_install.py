"""A session's durable fences at its host (docs/lifecycles.md: fences, sessions): installed before
any other call there (every step that calls a session's host runs this first), and preloaded when a
user's own call resumes an offline session (background work never resumes one)."""

from sqlalchemy.engine import Engine

from ...models.db import run_transaction
from ..adapters.runtime import RuntimePort
from ..fences.reinstall import missing_fences, record_installed


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
    Runtime faults propagate to the caller, which treats them as its own call's."""
    todo = run_transaction(engine, lambda s: missing_fences(s, workspace_id, session_id))
    if todo is None:
        return False
    host_id, epoch, fences = todo
    for _fence_id, target_operation_id, target_revision in fences:
        runtime.install_fence(
            workspace_id,
            session_id,
            target_operation_id=target_operation_id,
            target_revision=target_revision,
            require_live=require_live,
        )
    installed = [fence_id for fence_id, _op, _rev in fences]
    run_transaction(engine, lambda s: record_installed(s, installed, host_id, epoch))
    return True


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

"""Prompt dispatch (docs/lifecycles.md: prompts): the session's next prompt sent to its host when it
may go."""

from collections.abc import Callable
from datetime import datetime

from sqlalchemy.engine import Engine

from ...models.base import utcnow
from ...models.db import run_transaction
from ..adapters.runtime import RuntimePort
from ..errors import RuntimeDisconnected, RuntimeFault
from ..prompts import queue as prompts
from .fence_install import ensure_fences_installed

# What `dispatch_next` answers when it sent nothing: the session is held, busy, or has no
# prompt queued (prompts.take_next).
NOTHING_SENT = frozenset({"held", "busy", "idle"})


def dispatch_next(
    engine: Engine,
    runtime: RuntimePort,
    workspace_id: str,
    session_id: str,
    clock: Callable[[], datetime] = utcnow,
) -> str:
    """`agent_radar.prompt.dispatch`: send the session's next prompt if it may go now."""
    taken = run_transaction(
        engine, lambda s: prompts.take_next(s, workspace_id, session_id, clock())
    )
    if isinstance(taken, str):
        return taken
    try:
        ensure_fences_installed(engine, runtime, workspace_id, session_id)
        answer = runtime.submit_prompt(
            workspace_id, session_id, prompt_id=taken.prompt_id, text=taken.text
        )
    except (RuntimeFault, RuntimeDisconnected) as exc:
        fault = exc
        return run_transaction(engine, lambda s: prompts.not_sent(s, taken, fault, clock()))
    run_transaction(engine, lambda s: prompts.sent(s, taken.prompt_id, answer.get("turn_id")))
    return "dispatched"

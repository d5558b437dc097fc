"""Prompt dispatch (docs/lifecycles.md: prompts): the session's next prompt sent to its host when it
may go."""

from collections.abc import Callable
from datetime import datetime

from sqlalchemy.engine import Engine

from ...models.base import utcnow
from ...models.db import run_transaction
from ...models.operations import Prompt
from ..adapters.runtime import BUSY, RuntimePort
from ..errors import RuntimeDisconnected, RuntimeFault
from ..fences import moves
from ..kinds.cancel import CANCEL_APPLY_TASK
from ..prompts import queue as prompts
from ..task_names import PROMPT_TASK, Publish
from . import pin
from .fence_install import ensure_fences_installed
from .restore import reconcile_session

# What `dispatch_next` answers when it sent nothing: the session is held, busy, or has no
# prompt queued (prompts.take_next).
NOTHING_SENT = frozenset({"held", "busy", "idle"})


def dispatch_next(
    engine: Engine,
    runtime: RuntimePort,
    workspace_id: str,
    session_id: str,
    clock: Callable[[], datetime] = utcnow,
    publish: Publish = lambda _task, _kwargs: False,
) -> str:
    """`agent_radar.prompt.dispatch`: send the session's next prompt if it may go now (a
    cancel owed to a host the session left meanwhile is published, else the sweeper does)."""
    taken = run_transaction(
        engine, lambda s: prompts.take_next(s, workspace_id, session_id, clock())
    )
    if isinstance(taken, str):
        return taken
    # The host is named before the call: the turn it answers with is its own (moves.prompt_sent).
    there = pin(engine, runtime, workspace_id, session_id)
    try:
        ensure_fences_installed(engine, runtime, workspace_id, session_id)
        answer = there.port.submit_prompt(
            workspace_id, session_id, prompt_id=taken.prompt_id, text=taken.text
        )
    except (RuntimeFault, RuntimeDisconnected) as exc:
        fault = exc
        wakes = (
            _learn_what_runs(engine, runtime, publish, taken, clock) if fault.code == BUSY else []
        )
        outcome, held = run_transaction(
            engine, lambda s: prompts.not_sent(s, taken, fault, clock())
        )
        # Held, the prompt waits for a turn or run on record, whose end wakes the queue: a
        # wake now would only send it into `busy` again, at once (a host that lists a new
        # turn at each look would make that a loop).
        for task, kwargs in [] if held else wakes:
            publish(task, kwargs)
        return outcome
    turn_id = answer.get("turn_id")
    owed = run_transaction(
        engine, lambda s: moves.prompt_sent(s, taken, there.host_id, turn_id, clock())
    )
    for cancel_id in owed:
        publish(CANCEL_APPLY_TASK, {"operation_id": cancel_id})
    return "dispatched"


def _learn_what_runs(
    engine: Engine,
    runtime: RuntimePort,
    publish: Publish,
    prompt: Prompt,
    clock: Callable[[], datetime],
) -> list[tuple[str, dict]]:
    """The host refused the prompt `busy` (docs/protocol.md: one thing at a time): asked what
    it runs, the mirror learns a turn no report told of, and the queue waits for its end at
    no cost (prompts.not_sent). The queue's wake-up that the answer sets in motion (a turn
    on record that the host has ended) is returned, to be published once the prompt is back
    in the queue: sent now, it would find the prompt still out, and wake nothing."""
    wakes: list[tuple[str, dict]] = []

    def queue_wakes_later(task: str, kwargs: dict) -> bool:
        if task == PROMPT_TASK:
            wakes.append((task, kwargs))
            return True
        return publish(task, kwargs)

    try:
        reconcile_session(
            engine, runtime, queue_wakes_later, prompt.workspace_id, prompt.session_id, clock
        )
    except (RuntimeFault, RuntimeDisconnected):
        pass  # the send's own fault is recorded all the same
    return wakes

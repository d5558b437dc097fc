"""Steps act, rules decide (docs/architecture.md): the only code that claims work, calls an
agent host and publishes — goal dispatch, fence apply, cancels, the maintenance executor,
prompt dispatch, and the wake-ups after a release."""

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from ...models.base import utcnow
from ...models.db import run_read
from ..adapters.runtime import RuntimePort
from ..sessions import hosts
from ..sessions.rows import lock_session
from ..task_names import Publish

S = TypeVar("S", bound="Step")


@dataclass(frozen=True)
class Pinned:
    """The port of the host a session lived on when it was named (`host_id`): what that host
    answers tells of it alone (docs/lifecycles.md: sessions)."""

    port: RuntimePort
    host_id: str
    workspace_id: str
    session_id: str

    def recorded(self, write: Callable[[Session], Any]) -> Callable[[Session], Any]:
        """`write` of what that host answered, in a transaction that first takes the session's
        lock (as a move does), done only while the session still lives there."""

        def if_still_there(s: Session) -> Any:
            row = lock_session(s, self.workspace_id, self.session_id)
            return write(s) if row.host_id == self.host_id else None

        return if_still_there


def pin(engine: Engine, runtime: RuntimePort, workspace_id: str, session_id: str) -> Pinned:
    """Name the session's host before it is asked: a move in between leaves its answer
    unrecorded (a call through the router would reach whichever host the session has then)."""
    address = run_read(engine, lambda s: hosts.session_address(s, workspace_id, session_id))
    return Pinned(runtime.on_host(*address), address[0], workspace_id, session_id)


class Step:
    """What a step holds: the database, the runtime port, the worker it runs for (the owner of
    the leases it takes), how long those leases last, the publish port and the clock."""

    def __init__(
        self,
        engine: Engine,
        runtime: RuntimePort,
        *,
        worker_id: str,
        lease_s: float,
        publish: Publish,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.engine, self.runtime, self.worker_id = engine, runtime, worker_id
        self.lease_s, self.publish, self.clock = lease_s, publish, clock

    def alongside(self, step: type[S]) -> S:
        """Another step for the same worker, on the same database, runtime, publish port and
        clock."""
        return step(
            self.engine,
            self.runtime,
            worker_id=self.worker_id,
            lease_s=self.lease_s,
            publish=self.publish,
            clock=self.clock,
        )

    def host_state(self, workspace_id: str, session_id: str):
        """What the host runs for the session, with the record made to agree and what that
        set in motion published (restore.reconcile_session): (state answer, reconciled)."""
        from .restore import reconcile_session  # restore's steps are Steps too

        return reconcile_session(
            self.engine, self.runtime, self.publish, workspace_id, session_id, self.clock
        )

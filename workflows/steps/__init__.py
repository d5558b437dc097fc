"""Steps act, rules decide (docs/architecture.md): the only code that claims work, calls an
agent host and publishes — goal dispatch, fence apply, cancels, the maintenance executor,
prompt dispatch, and the wake-ups after a release."""

from collections.abc import Callable
from datetime import datetime
from typing import TypeVar

from sqlalchemy.engine import Engine

from ...models.base import utcnow
from ..adapters.runtime import RuntimePort
from ..task_names import Publish

S = TypeVar("S", bound="Step")


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

"""A worker pool process's drain (docs/dispatch.md): a thread that keeps the process's goal
calls in flight, so the dispatch task that claimed them returns at once and a slow host holds
no pool process; the task waits only while the process has MAX_IN_FLIGHT calls."""

import logging
import os
import threading
import time
from concurrent.futures import Future
from typing import Any

from agent_radar.workflows.goals.claims import Claim, Lane, StepResult
from agent_radar.workflows.steps.goals.flight import Drain, Steps
from agent_radar.workflows.steps.goals.host_gate import MAX_IN_FLIGHT
from agent_radar.workflows.steps.goals.pull import Puller, pulls

log = logging.getLogger(__name__)

# A worker's background drain stops (its thread ends) after this long with nothing to do.
IDLE_EXIT_S = 5.0
_lock = threading.RLock()


class WorkerDrain(Drain):
    """A worker process's drain, in a thread of its own (see the module's note)."""

    def __init__(self, dispatcher: Steps) -> None:
        super().__init__(dispatcher, steal=True)
        self.thread = threading.Thread(target=self._main, name="goal-drain", daemon=True)
        self.alive = True
        self.room = threading.Condition(_lock)
        # Where the database notifies, the drain pulls while it runs (pull.py): submits
        # notify it instead of publishing a message. A notification not yet taken is
        # `_woken`: more of them add nothing to the queue.
        self.puller = Puller(dispatcher.engine, self._wake) if pulls(dispatcher.engine) else None
        self._woken = False

    def _wake(self) -> None:
        if not self._woken:
            self._woken = True
            self.events.put(("due",))

    def _main(self) -> None:
        try:
            if self.puller is not None:
                self.puller.start()
            self.run(idle_exit_s=IDLE_EXIT_S)
        except Exception:  # noqa: BLE001 - the leases and the sweeper finish what is left
            log.exception("goal drain failed; its claims are left to their leases")
        finally:
            if self.puller is not None:
                self.puller.stop()
            with _lock:
                self.alive = False
                if _drains.get(os.getpid()) is self:
                    del _drains[os.getpid()]
                self.room.notify_all()

    def _take(self, event: tuple[Any, ...]) -> None:
        if self.puller is not None:
            if event[0] == "stop":
                self.puller.stop()
            elif event[0] in ("work", "due"):
                if event[0] == "due":
                    self._woken = False
                self.puller.hold()
        super()._take(event)

    def _may_exit(self) -> bool:
        # Idle with a promise: let it go, and listen for one more idle period (a submit that
        # read the promise just before may commit after) before the drain ends.
        if self.puller is not None and self.puller.holding:
            self.puller.let_go()
            return False
        with _lock:
            if not self.events.empty():
                return False
            self.alive = False
            return True

    def _finished(self, future: Future) -> None:
        super()._finished(future)
        with _lock:
            self.room.notify_all()

    def _keep(self, results: list[StepResult]) -> None:
        pass  # nobody waits for them: the database has them


_drains: dict[int, WorkerDrain] = {}


def hand_off(dispatcher: Steps, work: dict[Lane, Claim | StepResult], eager: bool) -> None:
    """Give claimed lanes to this process's drain (started if none runs), starting at once
    the calls whose hosts have a slot (Drain.start_now)."""
    with _lock:
        drain = _drains.get(os.getpid())
        if drain is None or not drain.alive:
            drain = _drains[os.getpid()] = WorkerDrain(dispatcher)
            drain.thread.start()
        drain.events.put(("work", drain.start_now(work), eager))


def wait_for_room(timeout_s: float) -> None:
    """Back-pressure: wait (up to timeout_s) while this process has MAX_IN_FLIGHT calls."""
    end = time.monotonic() + timeout_s
    with _lock:
        drain = _drains.get(os.getpid())
        while drain is not None and drain.alive and drain.gate.in_flight() >= MAX_IN_FLIGHT:
            left = end - time.monotonic()
            if left <= 0:
                return
            drain.room.wait(left)


def stop(timeout_s: float) -> None:
    """A worker process ending: its drain finishes the calls in flight (up to timeout_s),
    records them and gives back what it had not called."""
    with _lock:
        drain = _drains.get(os.getpid())
    if drain is None or not drain.alive:
        return
    drain.events.put(("stop",))
    drain.thread.join(timeout_s)

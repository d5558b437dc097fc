"""A worker pool process's drain (docs/dispatch.md): a thread that keeps the process's goal
calls in flight, so the dispatch task that claimed them returns at once and a slow host holds
no pool process; the task waits only while the process has MAX_IN_FLIGHT calls. The process
holds it (tasks/worker_process.py)."""

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any

from ...adapters.bulkhead import MAX_IN_FLIGHT
from ...goals.claims import StepResult
from ...goals.pullers import Notified, Puller
from .flight import ROOM_AT, Drain, Steps

log = logging.getLogger(__name__)

# A worker's background drain stops (its thread ends) after this long with nothing to do,
# unless it pulls (it then runs as long as its process).
IDLE_EXIT_S = 5.0


class WorkerDrain(Drain):
    """A worker process's drain, in a thread of its own (see the module's note)."""

    def __init__(
        self,
        dispatcher: Steps,
        lock: threading.RLock,
        room: threading.Condition,
        pulls: bool = False,
    ) -> None:
        super().__init__(dispatcher)
        self.thread = threading.Thread(target=self._main, name="goal-drain", daemon=True)
        self.alive = True
        # The process's: it says under `lock` that it ended, and notifies `room` as calls end.
        self.lock, self.room = lock, room
        # Where the database notifies (`pulls`), the drain pulls while it runs and has room
        # (goals/pullers.py): submits notify it instead of publishing a message. What
        # notifications name waits in `_notified` for the drain's thread; `_woken`: a "due"
        # event is on its way.
        self.puller = Puller(dispatcher.engine, self._wake) if pulls else None
        self._notified: deque[Notified] = deque()
        self._woken = False

    def _wake(self, what: Notified) -> None:
        """From the puller's thread: a notification (None: anything may be due)."""
        self._notified.append(what)
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
            with self.lock:
                self.alive = False
                self.room.notify_all()

    def _take(self, event: tuple[Any, ...]) -> None:
        if event[0] == "due":
            self._claim_notified()
        else:
            super()._take(event)
        if self.puller is not None:
            if event[0] == "stop":
                self.puller.stop()
            elif event[0] in ("work", "due", "done"):
                # A full process lets its promise go: submits go to other processes' drains
                # (or publish) until it has room again.
                self.puller.holding = self.load() < ROOM_AT

    def _claim_notified(self) -> None:
        """The operations notifications named, claimed by name as their messages' dispatch
        would (their due time is the submitting client's clock): one alone in one call (the
        named claim), several in one claim that takes other due work along, as a message's
        does. What else was notified ("anything may be due"), or could not be claimed, makes
        the drain `behind`: a flush steals all due work at once if the process has room, else
        once a call ends (or another drain's steal, or the sweeper, takes it). Notified work
        already taken does not: another drain's steal took it, and taking work however young
        would then take what the other processes were just notified of."""
        self._woken = False
        named: dict[str, tuple[str, str]] = {}
        while self._notified:
            what = self._notified.popleft()
            if what is None:
                self.behind = True
            else:
                named.update((op_id, (ws, sid)) for op_id, ws, sid in what)
        if named and self.load() < ROOM_AT:
            # One alone names its session (the named claim).
            session_of = next(iter(named.values())) if len(named) == 1 else None
            try:
                for work, _late in self.d.claim_many(list(named), session_of):
                    self.add(work)
            except Exception as exc:  # noqa: BLE001 - the database is away: steal it later
                log.warning("goal drain: claiming %d notified failed: %s", len(named), exc)
                self.behind = True
        elif named:
            self.behind = True
        if self.behind and self.load() < ROOM_AT:
            self._flush()

    def _may_exit(self) -> bool:
        # A pulling drain runs as long as its process: submits may notify it at any time.
        if self.puller is not None:
            return False
        with self.lock:
            if not self.events.empty():
                return False
            self.alive = False
            return True

    def _finished(self, future: Future) -> None:
        super()._finished(future)
        with self.lock:
            self.room.notify_all()

    def _keep(self, results: list[StepResult]) -> None:
        pass  # nobody waits for them: the database has them

    def wait_for_room(self, timeout_s: float) -> None:
        """Back-pressure (under `lock`): wait up to timeout_s while this drain has
        MAX_IN_FLIGHT calls."""
        end = time.monotonic() + timeout_s
        while self.alive and self.gate.in_flight() >= MAX_IN_FLIGHT:
            left = end - time.monotonic()
            if left <= 0:
                return
            self.room.wait(left)

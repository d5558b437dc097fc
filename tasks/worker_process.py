"""What one worker process holds (docs/dispatch.md): its engine, its runtime port (each host's
bulkhead and circuit breaker), its publisher, its client, its goal dispatcher and the drain
that keeps its goal calls in flight — one object, built when the process starts
(`worker_process_init`), or at its first task where nothing forked (a solo pool, a test's
in-process worker). A task's `ctx` is this object.

Keyed by (process id, settings): a forked pool process builds its own, and a test app with
other settings never sees another's.
"""

import os
import threading
from functools import cached_property

from ..models.db import engine_for
from ..models.dialects import dialect_of
from ..workflows.adapters.config import Settings
from ..workflows.adapters.http_runtime import HostRouter
from ..workflows.adapters.publisher import TaskPublisher
from ..workflows.client import AgentRadar
from ..workflows.goals.claims import StepResult
from ..workflows.sessions.hosts import locator
from ..workflows.steps.goals.dispatch import Dispatcher
from ..workflows.steps.goals.worker_drain import WorkerDrain
from .worker_id import worker_name

_lock = threading.Lock()


class WorkerProcess:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.engine = engine_for(settings.database_url)
        self.runtime = HostRouter(
            settings.runtime_url,
            locator(self.engine),
            settings.runtime_token,
            settings.runtime_timeout_s,
            settings.host_concurrency,
        )
        self.publisher = TaskPublisher(settings)
        self.dispatcher = Dispatcher(
            self.engine,
            self.runtime,
            worker_id=worker_name(),
            lease_s=settings.lease_s,
            # Client operations may bring an offline session back (the rare resume).
            resume_session=lambda ws, sid: self.client.ensure_session(ws, sid),
        )
        # Whether its drain pulls (docs/dispatch.md: pulling; PostgreSQL, AGENT_RADAR_PULL).
        self.pulls = settings.pull and dialect_of(self.engine).notifies
        # The drain's thread ends when it has had nothing to do for a while (unless it
        # pulls); the next hand-off starts another. `room`: its calls ended (see wait_for_room).
        self.drain_lock = threading.RLock()
        self.room = threading.Condition(self.drain_lock)
        self._drain: WorkerDrain | None = None

    @cached_property
    def client(self) -> AgentRadar:
        return AgentRadar(settings=self.settings, runtime=self.runtime, publisher=self.publisher)

    def start(self) -> None:
        """The process's start: where its drain pulls (PostgreSQL, AGENT_RADAR_PULL), the
        drain and its promise start now, so that submits spread over every process from the
        first (docs/dispatch.md: pulling); elsewhere the first dispatch message starts it."""
        if self.pulls:
            with self.drain_lock:
                self._running()

    def _running(self) -> WorkerDrain:
        # (Under drain_lock: a drain that ends says so under it, so work handed to a live
        # drain is never left to one that has just ended.)
        if self._drain is None or not self._drain.alive:
            self._drain = WorkerDrain(self.dispatcher, self.drain_lock, self.room, self.pulls)
            self._drain.thread.start()
        return self._drain

    def dispatch(
        self, operation_ids: list[str], session_of: tuple[str, str] | None
    ) -> list[StepResult]:
        """Claim these operations (Dispatcher.claim_many) and give each step's lanes to the
        drain (started if none runs), starting at once the calls whose hosts have a slot
        (Drain.start_now): the claims are `in_flight`, the rest as the claim found them."""
        results: list[StepResult] = []
        for work, behind in self.dispatcher.claim_many(operation_ids, session_of):
            if work:
                with self.drain_lock:
                    drain = self._running()
                    drain.events.put(("work", drain.start_now(work), behind))
            results += [
                current
                if isinstance(current, StepResult)
                else StepResult(current.op.operation_id, "in_flight")
                for current in work.values()
            ]
        return results

    def wait_for_room(self, timeout_s: float) -> None:
        """Back-pressure: wait (up to timeout_s) while the drain has MAX_IN_FLIGHT calls."""
        with self.drain_lock:
            if self._drain is not None:
                self._drain.wait_for_room(timeout_s)

    def stop(self, timeout_s: float) -> None:
        """The process ending: its drain finishes the calls in flight (up to timeout_s),
        records them and gives back what it had not called."""
        with self.drain_lock:
            drain = self._drain
        if drain is not None and drain.alive:
            drain.events.put(("stop",))
            drain.thread.join(timeout_s)


_processes: dict[tuple[int, Settings], WorkerProcess] = {}


def of(settings: Settings) -> WorkerProcess:
    """This process's WorkerProcess for these settings, built on first use."""
    key = (os.getpid(), settings)
    process = _processes.get(key)
    if process is None:
        with _lock:
            process = _processes.get(key)
            if process is None:
                process = _processes[key] = WorkerProcess(settings)
    return process


def stop_all(timeout_s: float) -> None:
    """The process ending: every drain of it stops (see WorkerProcess.stop)."""
    for (pid, _settings), process in list(_processes.items()):
        if pid == os.getpid():
            process.stop(timeout_s)

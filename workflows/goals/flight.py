"""Goal calls in flight: per-host bulkheads, a circuit breaker per host, and the drain that
records each call's outcome as it finishes (docs/dispatch.md).

A dispatch claims lanes and their operations in short transactions (dispatch.py); the calls
then run here, each host within its own limit (`HostGate`): a slow host fills only its own
slots, so calls to other hosts never wait behind it. A call's outcome is recorded when it
finishes, together with whatever else finished meanwhile, and its lane takes its next due
operation in the same transaction; nothing waits for the slowest call of a batch.

In a worker (`hand_off`) the drain runs in a thread of the pool process, so the Celery task
that claimed the work returns at once and a slow host holds no pool process: the task waits
only when the process already has MAX_IN_FLIGHT calls (back-pressure). A claim that is not
called (its host is full past its queue, or its circuit is open, or the process is stopping)
is given back unattempted and due again later: a lease protects it meanwhile, and a crash
leaves it to the sweeper as before.
"""

import logging
import os
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import delete, update
from sqlalchemy.orm import Session

from models.base import table_of, utcnow
from models.db import insert_ignore, run_transaction
from models.tables import HostCircuit
from workflows.adapters import metrics
from workflows.goals.statements import MAX_LANES_PER_STEP, RESCHEDULE

if TYPE_CHECKING:
    from workflows.goals.dispatch import Attempt, Claim, Dispatcher, Lane, StepResult

log = logging.getLogger(__name__)

# Calls in flight to one host from one worker process, unless the runtime port says otherwise
# (AGENT_RADAR_HOST_CONCURRENCY); past it, claims for that host wait in its own queue (as long
# again), and past that they are given back, due again shortly.
HOST_CONCURRENCY = 32
# Calls in flight from one worker process, all hosts together; a dispatch task that finds the
# process this full waits before claiming more.
MAX_IN_FLIGHT = 256
# A claim given back because its host is full is due again after this long.
FULL_RETRY_S = 1.0
# The circuit breaker: this many calls to a host failing in a row (timeouts, refused or
# dropped connections, 5xx) open its circuit for BREAKER_OPEN_S, doubling on each failed
# trial up to BREAKER_MAX_OPEN_S; while open, its sessions' work is left due, unattempted.
BREAKER_FAILURES = 5
BREAKER_OPEN_S = 2.0
BREAKER_MAX_OPEN_S = 60.0
HOST_FAULTS = frozenset({"timeout", "unreachable", "server_error"})
# A lane takes at most this many operations in a row before it lets go (another worker, or
# the next message, takes the rest); a synchronous drain also stops claiming after
# DRAIN_BUDGET_S.
LANE_MAX_STEPS = 64
DRAIN_BUDGET_S = 60.0
# A worker's background drain stops (its thread ends) after this long with nothing to do.
IDLE_EXIT_S = 5.0
WAIT_POLL_S = 0.05

GO, FULL, OPEN = "go", "full", "open"


@dataclass
class _Host:
    in_flight: int = 0
    failures: int = 0
    open_until: float = 0.0  # time.monotonic()
    open_for: float = 0.0
    trial: bool = False  # a half-open circuit's one call is in flight


@dataclass
class Transition:
    """A circuit that opened (`open_until` set) or closed, to be written for `status`."""

    host_id: str
    open_until: datetime | None
    failures: int = 0
    error: str | None = None


class HostGate:
    """Per-process admission of calls to each host: its concurrency limit and its circuit
    breaker. Thread-safe."""

    def __init__(self, limit: int = HOST_CONCURRENCY) -> None:
        self.limit = limit
        self._hosts: dict[str, _Host] = {}
        self._lock = threading.Lock()
        self._transitions: list[Transition] = []

    def admit(self, host_id: str) -> tuple[str, float]:
        """GO (a slot is taken: call `done` after), FULL, or OPEN with the seconds until
        the circuit lets a trial through."""
        now = time.monotonic()
        with self._lock:
            host = self._hosts.setdefault(host_id, _Host())
            if host.open_until:
                if now < host.open_until or host.trial:
                    return OPEN, max(host.open_until - now, FULL_RETRY_S)
                host.trial = True  # half-open: one call finds out
            elif host.in_flight >= self.limit:
                return FULL, FULL_RETRY_S
            host.in_flight += 1
            return GO, 0.0

    def done(self, host_id: str, fault: Exception | None) -> None:
        """A call to this host ended: `fault` is its failure, if it failed."""
        code = getattr(fault, "code", None)
        failed = code in HOST_FAULTS
        with self._lock:
            host = self._hosts[host_id]
            host.in_flight -= 1
            was_trial, host.trial = host.trial, False
            if not failed:
                if host.open_until:
                    self._transitions.append(Transition(host_id, None))
                    metrics.HOST_CIRCUIT_OPEN.labels(host_id).set(0)
                host.failures, host.open_until, host.open_for = 0, 0.0, 0.0
                return
            host.failures += 1
            if not was_trial and (host.open_until or host.failures < BREAKER_FAILURES):
                return
            host.open_for = min(BREAKER_MAX_OPEN_S, max(BREAKER_OPEN_S, host.open_for * 2))
            host.open_until = time.monotonic() + host.open_for
            until = utcnow() + timedelta(seconds=host.open_for)
            self._transitions.append(Transition(host_id, until, host.failures, str(fault)))
        metrics.HOST_CIRCUIT_OPEN.labels(host_id).set(1)
        metrics.HOST_CIRCUIT_OPENS.labels(host_id).inc()
        log.warning(
            "host %s: %d calls failed in a row (%s); its calls stop for %.0f s",
            host_id,
            host.failures,
            fault,
            host.open_for,
        )

    def in_flight(self) -> int:
        with self._lock:
            return sum(host.in_flight for host in self._hosts.values())

    def take_transitions(self) -> list[Transition]:
        with self._lock:
            taken, self._transitions = self._transitions, []
        return taken


def write_transitions(s: Session, transitions: Iterable[Transition], worker_id: str) -> None:
    """Record circuits that opened or closed (for `status` and the metrics)."""
    for t in transitions:
        if t.open_until is None:
            s.execute(delete(HostCircuit).where(HostCircuit.host_id == t.host_id))
            continue
        values = {
            "open_until": t.open_until,
            "failures": t.failures,
            "last_error": (t.error or "")[:512],
            "opened_by": worker_id,
        }
        if not insert_ignore(s, table_of(HostCircuit), {"host_id": t.host_id, **values}):
            s.execute(update(HostCircuit).where(HostCircuit.host_id == t.host_id).values(values))


# One gate per runtime port (a worker process has one; each test its own), so one port's
# hosts, their slots and circuits, are nobody else's.
_gates: "weakref.WeakKeyDictionary[Any, HostGate]" = weakref.WeakKeyDictionary()
_pools: dict[int, ThreadPoolExecutor] = {}
_lock = threading.RLock()


def gate(runtime: Any) -> HostGate:
    """The host gate of this runtime port."""
    with _lock:
        found = _gates.get(runtime)
        if found is None:
            limit = getattr(runtime, "host_concurrency", HOST_CONCURRENCY)
            found = _gates[runtime] = HostGate(limit)
        return found


def _call_pool() -> ThreadPoolExecutor:
    with _lock:
        pool = _pools.get(os.getpid())
        if pool is None:
            pool = _pools[os.getpid()] = ThreadPoolExecutor(
                MAX_IN_FLIGHT, thread_name_prefix="runtime-call"
            )
        return pool


@dataclass
class _Waiting:
    lane: "Lane"
    claim: "Claim"
    since: float = field(default_factory=time.monotonic)


class Drain:
    """Lanes whose calls are in flight. Everything but the calls runs in the thread that
    runs `run` (its transactions are short and never span a call)."""

    def __init__(self, dispatcher: "Dispatcher", steal: bool = False, eager: bool = False):
        self.d = dispatcher
        self.steal, self.eager = steal, eager
        self.gate = gate(dispatcher.runtime)
        self.events: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self.in_flight: dict[Future, tuple[Lane, Claim]] = {}
        self.waiting: dict[str, deque[_Waiting]] = {}
        self.ready: list[tuple[Lane, Attempt | StepResult]] = []
        self.give_back: list[tuple[Lane, Claim, float | None]] = []
        self.steps: dict[tuple[str, str], int] = {}
        self.results: list[StepResult] = []
        self.deadline: float | None = None
        self.stopping = False
        # A claim may wait in its host's queue this long; past it, its lease is too short.
        self.max_wait_s = dispatcher.lease_s / 3

    # -- what comes in ---------------------------------------------------------------------
    def add(self, work: dict["Lane", "Claim | StepResult"]) -> None:
        from workflows.goals.dispatch import StepResult

        for lane, current in work.items():
            key = (lane.workspace_id, lane.session_id)
            self.steps[key] = self.steps.get(key, 0) + 1
            if isinstance(current, StepResult):
                self.ready.append((lane, current))
            elif self.stopping:
                self.give_back.append((lane, current, None))
            else:
                self._start(_Waiting(lane, current))

    def _start(self, waiting: _Waiting) -> None:
        host_id = waiting.claim.host[0]
        queued = self.waiting.setdefault(host_id, deque())
        verdict, retry_s = (FULL, FULL_RETRY_S) if queued else self.gate.admit(host_id)
        if verdict == GO:
            self._call(waiting)
        elif verdict == FULL and len(queued) < self.gate.limit:
            queued.append(waiting)
        else:
            self.give_back.append((waiting.lane, waiting.claim, retry_s))

    def _finished(self, future: Future) -> None:
        lane, claim = self.in_flight.pop(future)
        attempt = future.result()  # _attempt turns every failure into an Attempt
        self.gate.done(claim.host[0], attempt.fault)
        self.ready.append((lane, attempt))
        self._admit_waiting(claim.host[0])

    def _admit_waiting(self, host_id: str) -> None:
        """Call what waits for this host while it has slots."""
        queued = self.waiting.get(host_id)
        while queued:
            head = queued[0]
            if time.monotonic() - head.since > self.max_wait_s:
                queued.popleft()
                self.give_back.append((head.lane, head.claim, 0.0))
                continue
            verdict, retry_s = self.gate.admit(host_id)
            if verdict == FULL:
                return
            queued.popleft()
            if verdict == GO:
                self._call(head)
            else:  # the circuit opened: the rest waits for it
                self.give_back.append((head.lane, head.claim, retry_s))
                self.give_back += [(w.lane, w.claim, retry_s) for w in queued]
                queued.clear()

    def _call(self, waiting: _Waiting) -> None:
        future = _call_pool().submit(self.d._attempt, waiting.claim)
        self.in_flight[future] = (waiting.lane, waiting.claim)
        future.add_done_callback(lambda f: self.events.put(("done", f)))

    def load(self) -> int:
        return len(self.in_flight) + sum(len(q) for q in self.waiting.values())

    # -- the loop --------------------------------------------------------------------------
    def run(self, idle_exit_s: float | None = None) -> list["StepResult"]:
        """Drive the lanes until none is left (idle_exit_s None), or, as a worker's drain,
        until nothing came for idle_exit_s."""
        if idle_exit_s is None:
            self.deadline = time.monotonic() + DRAIN_BUDGET_S
        while True:
            if self.ready or self.give_back:
                self._flush()
                continue
            waiting = any(self.waiting.values())
            if not self.in_flight and not waiting:
                if idle_exit_s is None or self.stopping:
                    return self.results
            # Claims waiting for slots that other drains of this process hold are looked at
            # again every WAIT_POLL_S (a call of this drain's own wakes it at once).
            timeout = None if self.in_flight else (WAIT_POLL_S if waiting else idle_exit_s)
            try:
                event = self.events.get(timeout=timeout)
            except queue.Empty:
                if waiting:
                    for host_id in list(self.waiting):
                        self._admit_waiting(host_id)
                elif self._may_exit():
                    return self.results
                continue
            self._take(event)
            while True:
                try:
                    self._take(self.events.get_nowait())
                except queue.Empty:
                    break

    def _may_exit(self) -> bool:
        return True

    def _take(self, event: tuple[Any, ...]) -> None:
        if event[0] == "done":
            self._finished(event[1])
        elif event[0] == "work":
            self.eager = self.eager or event[2]
            self.add(event[1])
        elif event[0] == "stop":
            self.stopping = True
            for queued in self.waiting.values():
                self.give_back += [(w.lane, w.claim, None) for w in queued]
                queued.clear()

    def _flush(self) -> None:
        """One transaction: record what finished, give back what will not be called, release
        those lanes, and take back the finished ones that have more due work (with `steal`,
        other due work too, while the process has room)."""
        from workflows.goals.dispatch import Attempt

        ready, self.ready = self.ready, []
        give_back, self.give_back = self.give_back, []
        attempts = [a for _, a in ready if isinstance(a, Attempt)]
        self.results += [r for _, r in ready if not isinstance(r, Attempt)]
        lanes = [lane for lane, _ in ready]
        over = self.stopping or (self.deadline is not None and time.monotonic() > self.deadline)
        # Each lane's steps so far; a lane taken back goes on counting (see add).
        counts = {
            key: self.steps.pop(key, 1)
            for key in ((lane.workspace_id, lane.session_id) for lane in lanes)
        }
        keys = [key for key, n in counts.items() if not over and n < LANE_MAX_STEPS]
        steal = self.steal and not over and self.load() < MAX_IN_FLIGHT - MAX_LANES_PER_STEP
        transitions = self.gate.take_transitions()
        if attempts:
            metrics.DISPATCH_BATCH_SIZE.observe(len(attempts))

        def finish(s: Session):
            now = self.d.clock()
            for _lane, claim, retry_s in give_back:
                self.d._unclaim(s, claim)
                if retry_s:
                    s.connection().execute(
                        RESCHEDULE,
                        {"b_op": claim.op.operation_id, "b_at": now + timedelta(seconds=retry_s)},
                    )
            if give_back:
                self.d._release(s, [lane for lane, _, _ in give_back])
            recorded, released = self.d._record(s, attempts, lanes) if lanes else ([], True)
            if not released:
                self.d._release(s, lanes)
            if transitions:
                write_transitions(s, transitions, self.d.worker_id)
            # Look for more only after the release, in the same transaction (see
            # Dispatcher._next: a worker that found one of these lanes held had committed its
            # operation before, so this statement sees it).
            more = self.d._next(s, keys, steal, self.eager) if keys or steal else {}
            return recorded, more

        recorded, more = run_transaction(self.d.engine, finish, direct=True)
        self.results += recorded
        for lane in more:
            key = (lane.workspace_id, lane.session_id)
            self.steps[key] = counts.get(key, 0)
        self.add(more)


class WorkerDrain(Drain):
    """A worker process's drain, in a thread of its own (see the module's note)."""

    def __init__(self, dispatcher: "Dispatcher") -> None:
        super().__init__(dispatcher, steal=True)
        self.thread = threading.Thread(target=self._main, name="goal-drain", daemon=True)
        self.alive = True
        self.room = threading.Condition(_lock)

    def _main(self) -> None:
        try:
            self.run(idle_exit_s=IDLE_EXIT_S)
        except Exception:  # noqa: BLE001 - the leases and the sweeper finish what is left
            log.exception("goal drain failed; its claims are left to their leases")
        finally:
            with _lock:
                self.alive = False
                if _drains.get(os.getpid()) is self:
                    del _drains[os.getpid()]
                self.room.notify_all()

    def _may_exit(self) -> bool:
        with _lock:
            if not self.events.empty():
                return False
            self.alive = False
            return True

    def _finished(self, future: Future) -> None:
        super()._finished(future)
        with _lock:
            self.room.notify_all()


_drains: dict[int, WorkerDrain] = {}


def hand_off(
    dispatcher: "Dispatcher", work: dict["Lane", "Claim | StepResult"], eager: bool
) -> None:
    """Give claimed lanes to this process's drain (started if none runs)."""
    with _lock:
        drain = _drains.get(os.getpid())
        if drain is None or not drain.alive:
            drain = _drains[os.getpid()] = WorkerDrain(dispatcher)
            drain.thread.start()
        drain.events.put(("work", work, eager))


def wait_for_room(timeout_s: float) -> None:
    """Back-pressure: wait (up to timeout_s) while this process has MAX_IN_FLIGHT calls."""
    end = time.monotonic() + timeout_s
    with _lock:
        drain = _drains.get(os.getpid())
        while drain is not None and drain.alive and gate_load(drain) >= MAX_IN_FLIGHT:
            left = end - time.monotonic()
            if left <= 0:
                return
            drain.room.wait(left)


def gate_load(drain: Drain) -> int:
    return drain.gate.in_flight()


def stop(timeout_s: float) -> None:
    """A worker process ending: its drain finishes the calls in flight (up to timeout_s),
    records them and gives back what it had not called."""
    with _lock:
        drain = _drains.get(os.getpid())
    if drain is None or not drain.alive:
        return
    drain.events.put(("stop",))
    drain.thread.join(timeout_s)

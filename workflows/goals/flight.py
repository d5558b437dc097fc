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
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol

from sqlalchemy import delete, update
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from models.base import table_of, utcnow
from models.db import insert_ignore, run_transaction
from models.tables import HostCircuit
from workflows.adapters import logs, metrics
from workflows.adapters.config import DEFAULT_HOST_CONCURRENCY
from workflows.goals.claims import Attempt, Claim, Lane, StepResult
from workflows.goals.statements import MAX_LANES_PER_STEP

log = logging.getLogger(__name__)


class Steps(Protocol):
    """What a drain needs of its dispatcher (dispatch.Dispatcher): the claim's, the record's
    and the release's steps, each in the caller's transaction."""

    engine: Engine
    runtime: Any
    worker_id: str
    lease_s: float
    clock: Callable[[], datetime]

    def _attempt(self, claim: Claim) -> Attempt: ...

    def _record(
        self, s: Session, attempts: list[Attempt], lanes: list[Lane]
    ) -> tuple[list[StepResult], bool]: ...

    def _release(self, s: Session, lanes: list[Lane]) -> None: ...

    def _next(
        self, s: Session, keys: list[tuple[str, str]], steal: bool = False, eager: bool = False
    ) -> dict[Lane, Claim | StepResult]: ...

    def _unclaim(self, s: Session, claim: Claim, due_at: datetime | None = None) -> None: ...


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

    def __init__(self, limit: int = DEFAULT_HOST_CONCURRENCY) -> None:
        self.limit = limit
        self._hosts: dict[str, _Host] = {}
        self._lock = threading.Lock()
        self._transitions: list[Transition] = []
        self.total = 0  # calls in flight to every host: at most MAX_IN_FLIGHT (the pool)

    def admit(self, host_id: str) -> tuple[str, float, bool]:
        """GO (a slot is taken: call `done` after), FULL, or OPEN with the seconds until
        the circuit lets a trial through; and whether this call is that trial."""
        now = time.monotonic()
        with self._lock:
            host = self._hosts.setdefault(host_id, _Host())
            trial = False
            if host.open_until:
                if now < host.open_until or host.trial:
                    return OPEN, max(host.open_until - now, FULL_RETRY_S), False
                host.trial = trial = True  # half-open: this one call finds out
            elif host.in_flight >= self.limit or self.total >= MAX_IN_FLIGHT:
                return FULL, FULL_RETRY_S, False
            host.in_flight += 1
            self.total += 1
            return GO, 0.0, trial

    def done(self, host_id: str, fault: Exception | None, trial: bool, called: bool) -> None:
        """A call admitted to this host ended (`called`: it reached the host; `fault`: its
        failure, if it failed; `trial`: it was the half-open circuit's trial). Only calls
        that were admitted while the circuit was shut, or its trial, say anything about
        the host: a call that hung from before the circuit opened does not count twice."""
        failed = getattr(fault, "code", None) in HOST_FAULTS
        with self._lock:
            host = self._hosts[host_id]
            host.in_flight -= 1
            self.total -= 1
            if trial:
                host.trial = False
            if not called or (host.open_until and not trial):
                return
            if not failed:
                if host.open_until:
                    self._transitions.append(Transition(host_id, None))
                    metrics.HOST_CIRCUIT_OPEN.labels(host_id).set(0)
                host.failures, host.open_until, host.open_for = 0, 0.0, 0.0
                return
            host.failures += 1
            if not trial and host.failures < BREAKER_FAILURES:
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

    def put_back(self, transitions: list[Transition]) -> None:
        """Transitions whose write failed, to be written with the next."""
        with self._lock:
            self._transitions[:0] = transitions

    def in_flight(self) -> int:
        with self._lock:
            return self.total

    def take_transitions(self) -> list[Transition]:
        with self._lock:
            taken, self._transitions = self._transitions, []
        return taken


def write_transitions(s: Session, transitions: Iterable[Transition], worker_id: str) -> None:
    """Record circuits that opened or closed (for `status` and the metrics)."""
    for t in transitions:
        if t.open_until is None:
            # Only this process's opening: another's circuit may still be open.
            s.execute(
                delete(HostCircuit).where(
                    HostCircuit.host_id == t.host_id, HostCircuit.opened_by == worker_id
                )
            )
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
            # Calls in flight to one host from one worker process (AGENT_RADAR_HOST_CONCURRENCY);
            # past it, claims for that host wait in its own queue (as long again), and past
            # that they are given back, due again shortly.
            limit = getattr(runtime, "host_concurrency", DEFAULT_HOST_CONCURRENCY)
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


# A drain whose record transaction failed (the database is away) tries again after this
# long, doubling up to FLUSH_RETRY_MAX_S; a synchronous drain gives up after its budget.
FLUSH_RETRY_S = 0.2
FLUSH_RETRY_MAX_S = 5.0


class Drain:
    """Lanes whose calls are in flight. Everything but the calls runs in the thread that
    runs `run` (its transactions are short and never span a call); a call's pool thread
    only makes the call and gives its host slot back."""

    def __init__(self, dispatcher: Steps, steal: bool = False, eager: bool = False):
        self.d = dispatcher
        self.steal, self.eager, self.always_eager = steal, eager, eager
        self.gate = gate(dispatcher.runtime)
        self.events: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self.in_flight: dict[Future, tuple[Lane, Claim]] = {}
        self.waiting: dict[str, deque[tuple[Lane, Claim]]] = {}
        self.ready: list[tuple[Lane, Attempt | StepResult]] = []
        self.give_back: list[tuple[Lane, Claim, float | None]] = []
        self.steps: dict[tuple[str, str], int] = {}
        self.results: list[StepResult] = []
        self.deadline: float | None = None
        self.stopping = False
        # A call may take this long (its total deadline), so a claim whose lease ends sooner
        # is not called. The settings make a lease at least a second longer than a call; a
        # dispatcher made by hand with a shorter lease needs a second of it left.
        timeout_s = float(getattr(dispatcher.runtime, "timeout_s", 10.0))
        self.call_s = max(0.0, min(timeout_s, dispatcher.lease_s - 1))

    # -- what comes in ---------------------------------------------------------------------
    def add(self, work: dict[Lane, Claim | StepResult]) -> None:
        for lane, current in work.items():
            key = (lane.workspace_id, lane.session_id)
            self.steps[key] = self.steps.get(key, 0) + 1
            if isinstance(current, StepResult):
                self.ready.append((lane, current))
            elif self.stopping:
                self._give(lane, current, None)
            else:
                self._start(lane, current)

    def _give(self, lane: Lane, claim: Claim, retry_s: float | None) -> None:
        """Give this claim back unattempted (due again after retry_s, or as it was)."""
        self.steps.pop((lane.workspace_id, lane.session_id), None)
        self.give_back.append((lane, claim, retry_s))

    def _lease_ok(self, claim: Claim) -> bool:
        """Whether the claim's lease outlasts a whole call (the claim may have waited)."""
        expires = claim.op.lease_expires_at
        return expires is None or (expires - self.d.clock()).total_seconds() >= self.call_s

    def _start(self, lane: Lane, claim: Claim) -> None:
        host_id = claim.host[0]
        queued = self.waiting.setdefault(host_id, deque())
        if queued:  # behind those already waiting for this host
            verdict, retry_s, trial = FULL, FULL_RETRY_S, False
        else:
            verdict, retry_s, trial = self.gate.admit(host_id)
        if verdict == GO:
            self._call(lane, claim, trial)
        elif verdict == FULL and len(queued) < self.gate.limit:
            queued.append((lane, claim))
        else:
            self._give(lane, claim, retry_s)

    def _admit_waiting(self) -> None:
        """Call what waits for each host while it has slots (given back if its lease no
        longer covers a call)."""
        for host_id, queued in self.waiting.items():
            while queued:
                lane, claim = queued[0]
                if not self._lease_ok(claim):
                    queued.popleft()
                    self._give(lane, claim, None)
                    continue
                verdict, retry_s, trial = self.gate.admit(host_id)
                if verdict == FULL:
                    break
                queued.popleft()
                if verdict == GO:
                    self._call(lane, claim, trial)
                else:  # the circuit opened: the rest waits for it
                    self._give(lane, claim, retry_s)
                    while queued:
                        self._give(*queued.popleft(), retry_s)

    def _call(self, lane: Lane, claim: Claim, trial: bool) -> None:
        future = _call_pool().submit(self._attempt, claim, trial)
        self.in_flight[future] = (lane, claim)
        future.add_done_callback(lambda f: self.events.put(("done", f)))

    def _attempt(self, claim: Claim, trial: bool) -> Attempt | None:
        """In a pool thread: the call (None: not made, the lease would not outlast it). The
        host slot is given back here, whatever happens to the drain."""
        attempt = None
        try:
            if self._lease_ok(claim):
                with logs.task_context(**claim.log_context):
                    attempt = self.d._attempt(claim)
            return attempt
        finally:
            fault = attempt.fault if attempt is not None else None
            self.gate.done(claim.host[0], fault, trial, called=attempt is not None)

    def _finished(self, future: Future) -> None:
        lane, claim = self.in_flight.pop(future)
        attempt = future.result()  # _attempt turns every failure into an Attempt
        if attempt is None:
            log.warning(
                "goal operation %s: not called, its lease would end before the call could "
                "(the process was paused or too busy); given back",
                claim.op.operation_id,
                extra={"operation_id": claim.op.operation_id},
            )
            self._give(lane, claim, None)
        else:
            self.ready.append((lane, attempt))

    def load(self) -> int:
        return len(self.in_flight) + sum(len(q) for q in self.waiting.values())

    # -- the loop --------------------------------------------------------------------------
    def run(self, idle_exit_s: float | None = None) -> list[StepResult]:
        """Drive the lanes until none is left (idle_exit_s None), or, as a worker's drain,
        until nothing came for idle_exit_s."""
        if idle_exit_s is None:
            self.deadline = time.monotonic() + DRAIN_BUDGET_S
        retry_s = FLUSH_RETRY_S
        while True:
            self._admit_waiting()
            if self.ready or self.give_back:
                if self._flush():
                    retry_s = FLUSH_RETRY_S
                    continue
                if idle_exit_s is None and time.monotonic() > (self.deadline or 0):
                    raise RuntimeError("goal drain: its outcomes could not be recorded")
                time.sleep(retry_s)
                retry_s = min(retry_s * 2, FLUSH_RETRY_MAX_S)
                continue
            waiting = any(self.waiting.values())
            if not self.in_flight and not waiting:
                if idle_exit_s is None or self.stopping:
                    return self.results
            # Claims waiting for slots that other drains of this process hold are looked at
            # again every WAIT_POLL_S (a call of this drain's own ending wakes it at once).
            timeout = WAIT_POLL_S if waiting else (None if self.in_flight else idle_exit_s)
            try:
                event = self.events.get(timeout=timeout)
            except queue.Empty:
                if not waiting and not self.in_flight and self._may_exit():
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
                while queued:
                    self._give(*queued.popleft(), None)

    def _keep(self, results: list[StepResult]) -> None:
        self.results += results

    def _flush(self) -> bool:
        """One transaction: record what finished, give back what will not be called, release
        those lanes, and take back the finished ones that have more due work (with `steal`,
        other due work too, while the process has room). False if it failed (everything is
        kept for the next try)."""
        ready, give_back = self.ready, self.give_back
        attempts = [a for _, a in ready if isinstance(a, Attempt)]
        lanes = [lane for lane, _ in ready]
        over = self.stopping or (self.deadline is not None and time.monotonic() > self.deadline)
        # Each lane's steps so far; a lane taken back goes on counting (see add).
        counts = {
            (lane.workspace_id, lane.session_id): self.steps.get(
                (lane.workspace_id, lane.session_id), 1
            )
            for lane in lanes
        }
        keys = [key for key, n in counts.items() if not over and n < LANE_MAX_STEPS]
        steal = self.steal and not over and self.load() < MAX_IN_FLIGHT - MAX_LANES_PER_STEP
        eager = self.eager
        transitions = self.gate.take_transitions()

        def finish(s: Session):
            now = self.d.clock()
            for _lane, claim, retry_s in give_back:
                due = now + timedelta(seconds=retry_s) if retry_s else None
                self.d._unclaim(s, claim, due)
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
            more = self.d._next(s, keys, steal, eager) if keys or steal else {}
            return recorded, more

        try:
            recorded, more = run_transaction(self.d.engine, finish, direct=True)
        except Exception as exc:  # noqa: BLE001 - the database is away: keep it, try again
            log.warning(
                "goal drain: recording %d outcomes failed, trying again: %s",
                len(ready),
                f"{exc.__class__.__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
            )
            self.gate.put_back(transitions)
            return False
        self.ready, self.give_back = [], []
        self.eager = self.always_eager
        if attempts:
            metrics.DISPATCH_BATCH_SIZE.observe(len(attempts))
        for result in recorded:
            if result.outcome == "skipped":
                # Its lease was taken over while it called (a paused or slow process): the
                # new holder's outcome stands (DESIGN 4.8).
                log.warning(
                    "goal operation %s: its call ended after its lease was taken over; "
                    "its outcome is not recorded",
                    result.operation_id,
                    extra={"operation_id": result.operation_id},
                )
        self._keep([r for _, r in ready if not isinstance(r, Attempt)] + recorded)
        for key in counts:
            self.steps.pop(key, None)
        for lane in more:
            key = (lane.workspace_id, lane.session_id)
            self.steps[key] = counts.get(key, 0)
        self.add(more)
        return True


class WorkerDrain(Drain):
    """A worker process's drain, in a thread of its own (see the module's note)."""

    def __init__(self, dispatcher: Steps) -> None:
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

    def _keep(self, results: list[StepResult]) -> None:
        pass  # nobody waits for them: the database has them


_drains: dict[int, WorkerDrain] = {}


def hand_off(dispatcher: Steps, work: dict[Lane, Claim | StepResult], eager: bool) -> None:
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

"""Goal calls in flight: per-host bulkheads, a circuit breaker per host, and the drain that
records each call's outcome as it finishes (docs/dispatch.md).

A dispatch claims lanes and their operations in short transactions (dispatch.py); the calls
then run here, each host within its own limit (`HostGate`): a slow host fills only its own
slots, so calls to other hosts never wait behind it. A call's outcome is recorded when it
finishes, together with whatever else finished meanwhile, and its lane takes its next due
operation in the same transaction; nothing waits for the slowest call of a batch.

In a worker the drain runs in a thread of the pool process (worker_drain.py), and the Celery task
that claimed the work starts the calls whose hosts have a slot itself (`start_now`: the
drain's thread may be busy recording) and returns at once, so a slow host holds no pool
process: the task waits only when the process already has MAX_IN_FLIGHT calls
(back-pressure). A claim that is not called (its host is full past its queue, or its circuit
is open, or the process is stopping) is given back unattempted and due again later: a lease
protects it meanwhile, and a crash leaves it to the sweeper as before. A worker's drain
looks at the sessions it gave back once their work is due again (`recheck`) and takes it if
its lane is free, so a burst past a host's limit settles at the host's pace without waiting
for a sweep.
"""

import logging
import queue
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from datetime import datetime, timedelta
from typing import Any, Protocol

from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from ....models.db import run_transaction
from ...adapters import logs, metrics
from ...adapters.bulkhead import FULL, GO, MAX_IN_FLIGHT
from ...adapters.runtime import RuntimePort
from ...goals.claims import Attempt, Claim, Lane, StepResult
from ...goals.statements import MAX_LANES_PER_STEP
from ...sessions.hosts import record_circuits

log = logging.getLogger(__name__)


class Steps(Protocol):
    """What a drain needs of its dispatcher (dispatch.Dispatcher, which imports this
    module): the claim's, the record's and the release's steps, each in the caller's
    transaction."""

    engine: Engine
    runtime: RuntimePort
    worker_id: str
    lease_s: float
    clock: Callable[[], datetime]

    def claim_many(
        self, operation_ids: list[str], session_of: Any = None
    ) -> Iterator[tuple[dict[Lane, Claim | StepResult], bool]]: ...

    def attempt(self, claim: Claim) -> Attempt: ...

    def record(
        self, s: Session, attempts: list[Attempt], lanes: list[Lane]
    ) -> tuple[list[StepResult], bool]: ...

    def release(self, s: Session, lanes: list[Lane]) -> None: ...

    def next_work(
        self, s: Session, keys: list[tuple[str, str]], anywhere: bool, young: bool = False
    ) -> dict[Lane, Claim | StepResult]: ...

    def unclaim(self, s: Session, claim: Claim, due_at: datetime | None = None) -> None: ...


# A lane takes at most this many operations in a row before it lets go (others take the
# rest); a synchronous drain also stops claiming after DRAIN_BUDGET_S.
LANE_MAX_STEPS = 64
DRAIN_BUDGET_S = 60.0
# A drain takes more work (a steal, what notifications name) while it has fewer calls.
ROOM_AT = MAX_IN_FLIGHT - MAX_LANES_PER_STEP
WAIT_POLL_S = 0.05


# A drain whose record transaction failed (the database is away) tries again after this
# long, doubling up to FLUSH_RETRY_MAX_S; a synchronous drain gives up after its budget.
FLUSH_RETRY_S = 0.2
FLUSH_RETRY_MAX_S = 5.0


class Drain:
    """Lanes whose calls are in flight. Everything but the calls runs in the thread that
    runs `run` (its transactions are short and never span a call); a call's pool thread
    only makes the call and gives its host slot back."""

    def __init__(self, dispatcher: Steps, behind: bool = False):
        self.d = dispatcher
        # The messages are behind their work (one came after its work was taken, or a
        # notification could not be served): the next flush with room takes all due work,
        # however young (goals/lanes.py: STEAL_AFTER).
        self.behind = behind
        self.gate = dispatcher.runtime.bulkhead  # the port's (adapters/bulkhead.py)
        self.events: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self.in_flight: dict[Future, tuple[Lane, Claim]] = {}
        self.waiting: dict[str, deque[tuple[Lane, Claim]]] = {}
        self.ready: list[tuple[Lane, Attempt | StepResult]] = []
        self.give_back: list[tuple[Lane, Claim, float | None]] = []
        self.steps: dict[tuple[str, str], int] = {}
        # Sessions whose claims went back due later, and when (monotonic) to look again.
        self.recheck: dict[tuple[str, str], float] = {}
        self.results: list[StepResult] = []
        self.deadline: float | None = None
        self.stopping = False
        # A call may take this long (its total deadline): a claim whose lease ends sooner is
        # not called (the settings make a lease a second longer; one made by hand needs it).
        timeout_s = float(getattr(dispatcher.runtime, "timeout_s", 10.0))
        self.call_s = max(0.0, min(timeout_s, dispatcher.lease_s - 1))

    # -- what comes in ---------------------------------------------------------------------
    def add(self, work: dict[Lane, Claim | StepResult]) -> None:
        for lane, current in work.items():
            self._count_step(lane)
            if isinstance(current, StepResult):
                self.ready.append((lane, current))
            elif self.stopping:
                self._give(lane, current, None)
            else:
                self._start(lane, current)

    def _count_step(self, lane: Lane) -> None:
        key = (lane.workspace_id, lane.session_id)
        self.steps[key] = self.steps.get(key, 0) + 1

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
            verdict, retry_s, trial = FULL, self.gate.full_retry_s(host_id), False
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
        future = self.gate.pool().submit(self._attempt, claim, trial)
        self.in_flight[future] = (lane, claim)
        future.add_done_callback(lambda f: self.events.put(("done", f)))

    def start_now(self, work: dict[Lane, Claim | StepResult]) -> dict[Lane, Claim | StepResult]:
        """From another thread (the dispatch task's): start at once the calls whose hosts
        have a free slot and nothing waiting, without waiting for this drain's thread, which
        may be recording other outcomes; the drain learns of each before it can end. The
        rest, to be `add`ed by the drain's thread."""
        rest: dict[Lane, Claim | StepResult] = {}
        for lane, current in work.items():
            if isinstance(current, Claim) and not self.stopping:
                host_id = current.host[0]
                if not self.waiting.get(host_id):
                    verdict, _retry_s, trial = self.gate.admit(host_id)
                    if verdict == GO:
                        future = self.gate.pool().submit(self._attempt, current, trial)
                        self.events.put(("started", lane, current, future))
                        future.add_done_callback(lambda f: self.events.put(("done", f)))
                        continue
            rest[lane] = current
        return rest

    def _attempt(self, claim: Claim, trial: bool) -> Attempt | None:
        """In a pool thread: the call (None: not made, the lease would not outlast it). The
        host slot is given back here, whatever happens to the drain."""
        attempt, began = None, time.monotonic()
        try:
            if self._lease_ok(claim):
                with logs.task_context(**claim.log_context), self.gate.held(claim.host[0]):
                    attempt = self.d.attempt(claim)
            return attempt
        finally:
            fault = attempt.fault if attempt is not None else None
            took_s = time.monotonic() - began
            self.gate.done(claim.host[0], fault, trial, attempt is not None, took_s)

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
            rechecks = idle_exit_s is not None and self._rechecks_due()
            if self.ready or self.give_back or rechecks:
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
            if self.recheck and idle_exit_s is not None:
                left = max(0.0, min(self.recheck.values()) - time.monotonic())
                timeout = left if timeout is None else min(timeout, left)
            try:
                event = self.events.get(timeout=timeout)
            except queue.Empty:
                if not (waiting or self.in_flight or self.recheck) and self._may_exit():
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
        elif event[0] == "started":  # before its "done" (start_now)
            _, lane, claim, future = event
            self._count_step(lane)
            self.in_flight[future] = (lane, claim)
        elif event[0] == "work":
            self.behind = self.behind or event[2]
            self.add(event[1])
        elif event[0] == "stop":
            self.stopping = True
            self.recheck.clear()  # other workers, or the sweeper, take what is due
            for queued in self.waiting.values():
                while queued:
                    self._give(*queued.popleft(), None)

    def _keep(self, results: list[StepResult]) -> None:
        self.results += results

    def _rechecks_due(self) -> list[tuple[str, str]]:
        now = time.monotonic()
        return [key for key, at in self.recheck.items() if at <= now]

    def _flush(self) -> bool:
        """One transaction: record what finished, give back what will not be called, release
        those lanes, and take back the finished ones that have more due work (and other due
        work too, while the process has room). False if it failed (everything is
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
        rechecked = self._rechecks_due()
        keys += [key for key in rechecked if key not in counts and not over]
        steal = not over and self.load() < ROOM_AT
        young = self.behind
        transitions = self.gate.take_transitions()

        def finish(s: Session):
            now = self.d.clock()
            for _lane, claim, retry_s in give_back:
                due = now + timedelta(seconds=retry_s) if retry_s else None
                self.d.unclaim(s, claim, due)
            if give_back:
                self.d.release(s, [lane for lane, _, _ in give_back])
            recorded, released = self.d.record(s, attempts, lanes) if lanes else ([], True)
            if not released:
                self.d.release(s, lanes)
            if transitions:
                record_circuits(s, transitions, self.d.worker_id)
            # Look for more only after the release, in the same transaction (see
            # Dispatcher._next: a worker that found one of these lanes held had committed its
            # operation before, so this statement sees it).
            more = self.d.next_work(s, keys, steal, young) if keys or steal else {}
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
        for key in rechecked:
            self.recheck.pop(key, None)
        for lane, _claim, retry_s in give_back:
            if retry_s and not self.stopping:  # due from `now` on: look once it is
                self.recheck[(lane.workspace_id, lane.session_id)] = time.monotonic() + retry_s
        if steal:  # what was due is taken (or taken by others); a full process waits
            self.behind = False
        if attempts:
            metrics.DISPATCH_BATCH_SIZE.observe(len(attempts))
        for result in recorded:
            if result.outcome == "skipped":
                # Its lease was taken over while it called (a paused or slow process): the
                # new holder's outcome stands (docs/lifecycles.md: leases).
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

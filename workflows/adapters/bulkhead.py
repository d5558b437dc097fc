"""Per-host bulkheads (docs/dispatch.md): each host's concurrency limit and circuit breaker
in one process, and the circuits that open and close (recorded for `status`).

Every call to a host passes its bulkhead. The goal drain admits its calls itself, without
waiting (workflows/steps/goals/flight.py: a claim whose host is full waits in the drain's own
queue, or is given back), and makes each call inside `held`; any other call (a fence, a
cancel, a restore, a prompt, a maintenance run) is admitted by the runtime adapter itself
(`call`): it waits a while for a slot, and fails retryably, without reaching the host, while
the host's circuit is open or no slot came.
"""

import contextvars
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta

from ...models.base import utcnow
from ..errors import RuntimeFault
from . import metrics
from .config import DEFAULT_HOST_CONCURRENCY

log = logging.getLogger(__name__)

# Calls in flight from one worker process, all hosts together; a dispatch task that finds the
# process this full waits before claiming more.
MAX_IN_FLIGHT = 256
# A claim given back because its host is full (its slots and its queue) is due again after
# about one of the host's calls (their duration smoothed over the last few): by then a call
# has ended and the queue has moved. Within these bounds; a host with no call yet, or a
# process full of other hosts' calls (whose end says nothing of this host's), the most.
FULL_RETRY_S = 1.0
FULL_RETRY_MIN_S = 0.05
CALL_S_WEIGHT = 0.2
# The circuit breaker: this many calls to a host failing in a row (timeouts, refused or
# dropped connections, 5xx) open its circuit for BREAKER_OPEN_S, doubling on each failed
# trial up to BREAKER_MAX_OPEN_S; while open, its sessions' work is left due, unattempted.
BREAKER_FAILURES = 5
BREAKER_OPEN_S = 2.0
BREAKER_MAX_OPEN_S = 60.0
HOST_FAULTS = frozenset({"timeout", "unreachable", "server_error"})
GO, FULL, OPEN = "go", "full", "open"


@dataclass
class CircuitChange:
    """A host's circuit that this process opened (`open_until` set) or closed, to be recorded
    for `status` (workflows/sessions/hosts.py: record_circuits)."""

    host_id: str
    open_until: datetime | None
    failures: int = 0
    error: str | None = None


# The (gate, host) whose slot this thread's call holds already (see `held`).
_HELD: contextvars.ContextVar[tuple[int, str] | None] = contextvars.ContextVar(
    "agent_radar_bulkhead_held", default=None
)
# How often a call waiting for a slot looks again (a call's end also wakes it).
SLOT_POLL_S = 0.05


@dataclass
class _Host:
    in_flight: int = 0
    failures: int = 0
    open_until: float = 0.0  # time.monotonic()
    open_for: float = 0.0
    trial: bool = False  # a half-open circuit's one call is in flight
    call_s: float = FULL_RETRY_S  # its calls' duration, smoothed


class HostGate:
    """Per-process admission of calls to each host: its concurrency limit and its circuit
    breaker. Thread-safe."""

    def __init__(self, limit: int = DEFAULT_HOST_CONCURRENCY) -> None:
        self.limit = limit
        self._hosts: dict[str, _Host] = {}
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)  # a slot was given back
        self._transitions: list[CircuitChange] = []
        self.total = 0  # calls in flight to every host: at most MAX_IN_FLIGHT (the pool)
        self._pool: ThreadPoolExecutor | None = None

    def pool(self) -> ThreadPoolExecutor:
        """The threads the drain's calls run on (flight.py), MAX_IN_FLIGHT at most, made on
        first use: in a worker, by the pool process that uses it (its runtime port, and so
        this gate, is built after the fork)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(MAX_IN_FLIGHT, thread_name_prefix="runtime-call")
            return self._pool

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
                return FULL, self._full_retry_s(host), False
            host.in_flight += 1
            self.total += 1
            return GO, 0.0, trial

    def full_retry_s(self, host_id: str) -> float:
        """When a claim given back because this host is full is due again."""
        with self._lock:
            return self._full_retry_s(self._hosts.get(host_id) or _Host())

    def _full_retry_s(self, host: _Host) -> float:
        if self.total >= MAX_IN_FLIGHT:
            return FULL_RETRY_S
        return min(FULL_RETRY_S, max(FULL_RETRY_MIN_S, host.call_s))

    def done(
        self, host_id: str, fault: Exception | None, trial: bool, called: bool, took_s: float = 0
    ) -> None:
        """A call admitted to this host ended after `took_s` (`called`: it reached the host;
        `fault`: its failure, if it failed; `trial`: it was the half-open circuit's trial).
        Only calls that were admitted while the circuit was shut, or its trial, say anything
        about the host: a call that hung from before the circuit opened does not count
        twice."""
        failed = getattr(fault, "code", None) in HOST_FAULTS
        with self._lock:
            host = self._hosts[host_id]
            host.in_flight -= 1
            self.total -= 1
            self._freed.notify_all()
            if called:
                host.call_s += (took_s - host.call_s) * CALL_S_WEIGHT
            if trial:
                host.trial = False
            if not called or (host.open_until and not trial):
                return
            if not failed:
                if host.open_until:
                    self._transitions.append(CircuitChange(host_id, None))
                    metrics.HOST_CIRCUIT_OPEN.labels(host_id).set(0)
                host.failures, host.open_until, host.open_for = 0, 0.0, 0.0
                return
            host.failures += 1
            if not trial and host.failures < BREAKER_FAILURES:
                return
            host.open_for = min(BREAKER_MAX_OPEN_S, max(BREAKER_OPEN_S, host.open_for * 2))
            host.open_until = time.monotonic() + host.open_for
            until = utcnow() + timedelta(seconds=host.open_for)
            self._transitions.append(CircuitChange(host_id, until, host.failures, str(fault)))
        metrics.HOST_CIRCUIT_OPEN.labels(host_id).set(1)
        metrics.HOST_CIRCUIT_OPENS.labels(host_id).inc()
        log.warning(
            "host %s: %d calls failed in a row (%s); its calls stop for %.0f s",
            host_id,
            host.failures,
            fault,
            host.open_for,
        )

    @contextmanager
    def held(self, host_id: str) -> Iterator[None]:
        """The caller admitted this call (`admit`) and gives its slot back (`done`): calls to
        this host made inside pass the adapter's `call` without taking another slot."""
        token = _HELD.set((id(self), host_id))
        try:
            yield
        finally:
            _HELD.reset(token)

    @contextmanager
    def call(self, host_id: str, wait_s: float) -> Iterator[None]:
        """One synchronous call to this host inside its bulkhead: a slot, waited for up to
        `wait_s` while the host (or this process) is full, given back when the call ends,
        its fault counted by the circuit breaker. A RuntimeFault (retryable, nothing sent)
        while the host's circuit is open, or if no slot came in time."""
        if _HELD.get() == (id(self), host_id):
            yield
            return
        deadline = time.monotonic() + wait_s
        while True:
            verdict, retry_s, trial = self.admit(host_id)
            if verdict == GO:
                break
            if verdict == OPEN:
                raise RuntimeFault(
                    f"host {host_id}: its calls have stopped for {retry_s:.1f} s more, after "
                    "failing in a row (its circuit is open)",
                    code="circuit_open",
                    retryable=True,
                    http_status=None,
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeFault(
                    f"host {host_id}: every one of its {self.limit} slots stayed busy",
                    code="host_busy",
                    retryable=True,
                    http_status=None,
                )
            with self._freed:
                self._freed.wait(min(left, SLOT_POLL_S))
        fault: Exception | None = None
        began = time.monotonic()
        try:
            with self.held(host_id):
                yield
        except Exception as exc:
            fault = exc
            raise
        finally:
            self.done(host_id, fault, trial, True, time.monotonic() - began)

    def put_back(self, transitions: list[CircuitChange]) -> None:
        """Transitions whose write failed, to be written with the next."""
        with self._lock:
            self._transitions[:0] = transitions

    def in_flight(self) -> int:
        with self._lock:
            return self.total

    def take_transitions(self) -> list[CircuitChange]:
        with self._lock:
            taken, self._transitions = self._transitions, []
        return taken

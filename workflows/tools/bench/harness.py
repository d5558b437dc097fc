"""The running benchmark: its client, Celery producer and simulator feed, and how it sends
each kind of operation, waits for it, paces it, times a phase and audits the goals."""

import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ...adapters.config import Settings
from ...client import AgentRadar
from ...task_names import BASELINE_TASK
from ..simulator import SimControl
from ..stack import wait_for
from .cpu import (
    IDLE_FOR_S,
    Components,
    Phase,
    machine_busy_s,
    machine_ms_per_op,
)
from .stats import _exactly_once, _from_producers

# Operations of each kind run, and not measured, before the first phase: a fresh worker
# process pays one-time costs on its first ones (each statement's compilation and first
# plan, connections, first code paths), which a long-running worker pays once
# (docs/benchmarks.md: the phases). Both kinds get the same.
WARM_UP = 50
PHASE_TIMEOUT_S = 300
# Both throughput phases wait for completion polling this often (the poll is cheap on both
# sides, and the same for both, so it weighs the same in their CPU figures).
POLL_S = 0.05
PROGRESS_EVERY_S = 2.0


class EffectFeed:
    """The simulator's effects, fetched incrementally (`?since=`), so polling stays cheap."""

    def __init__(self, sim: SimControl) -> None:
        self.sim = sim
        self.seen: list[dict] = []

    def poll(self, wait_s: float = 0.0) -> None:
        self.seen += self.sim.effects(kind=None, since=len(self.seen), wait_s=wait_s)

    def goals(self, workspace_id: str) -> list[dict]:
        return [e for e in self.seen if e["kind"] == "goal" and e["workspace_id"] == workspace_id]


class Bench:
    def __init__(
        self,
        settings: Settings,
        operations: int,
        echo: Callable | None,
        components: Components | None = None,
    ) -> None:
        from ....tasks.app import create_app

        self.settings = settings
        self.n = operations
        self.echo = echo or (lambda *_: None)
        self.run_id = uuid.uuid4().hex[:8]
        self.client = AgentRadar(settings=settings)
        self.sim = SimControl(settings.runtime_url, settings.runtime_token)
        self.feed = EffectFeed(self.sim)
        # The baseline producer is Celery's own, configured as the workers are, but without
        # task events (the standard baseline: no `task-sent` here, and the no-op sends none).
        self.celery = create_app(settings)
        self.celery.conf.task_send_sent_event = False
        self._tallies: list = []
        self.components = components or Components(None, None)

    def close(self) -> None:
        for tally in self._tallies:
            tally.close()
        self.celery.close()
        self.client.close()

    # -- progress --------------------------------------------------------------------------
    def wait(self, label: str, count: Callable[[], int], total: int, poll_s: float = POLL_S):
        """Poll until `count()` reaches `total`, saying how far it got every few seconds."""
        deadline = time.monotonic() + PHASE_TIMEOUT_S
        said = time.monotonic()
        while (done := count()) < total:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{label}: {done}/{total} after {PHASE_TIMEOUT_S} s")
            if time.monotonic() - said >= PROGRESS_EVERY_S:
                self.echo(f"    … {label}: {done}/{total}")
                said = time.monotonic()
            time.sleep(poll_s)

    def warm_up(self, count: int = WARM_UP) -> dict:
        """Run `count` operations of each kind, from the producer threads, and wait until
        the worker is idle again (see WARM_UP); the goal operations' audit."""
        tally = self.tally()
        _from_producers(lambda i: self.send_noop(tally, i), range(count))
        self.wait("warm-up (a)", tally.count, count)
        ws = f"bench-{self.run_id}-warm-up"
        submitted: dict[str, float] = {}
        _from_producers(lambda i: self.set_goal(ws, i, submitted), range(count))
        self.await_effects(ws, count, "warm-up (b)")
        self.components.wait_until_worker_idle(IDLE_FOR_S, PHASE_TIMEOUT_S)
        return self.audit(ws, submitted)

    # -- the two kinds of operation: (a) a Celery no-op, (b) a goal operation -------------
    def tally(self):
        from ....tasks.bench_tasks import Tally

        tally = Tally(self.settings, uuid.uuid4().hex[:12])
        self._tallies.append(tally)
        return tally

    def send_noop(self, tally, index: int) -> None:
        self.celery.send_task(BASELINE_TASK, kwargs={"run_id": tally.run_id, "index": index})

    def set_goal(self, ws: str, i: int, submitted: dict[str, float]) -> None:
        t = time.time()
        op = self.client.set_goal(ws, f"s{i}", f"objective {i}", client_submit_id="1")
        submitted[op.operation_id] = t

    def applied(self, workspace_id: str, wait_s: float = 0.0) -> int:
        self.feed.poll(wait_s)
        return len(self.feed.goals(workspace_id))

    def await_effects(self, workspace_id: str, count: int, label: str) -> list[dict]:
        self.wait(label, lambda: self.applied(workspace_id), count)
        return self.feed.goals(workspace_id)

    # -- timing ------------------------------------------------------------------------------
    @contextmanager
    def counted(self) -> Iterator[Phase]:
        """The CPU of the block's `n` operations: the whole machine's and each component's
        per operation, filled into the Phase yielded (its rate is the caller's). It counts
        from an idle worker until the worker is idle again, not only until the last
        operation is done: what the worker does after it (acks and events, the last record,
        messages whose work a dispatch already took along) is spent on these operations."""
        self.components.wait_until_worker_idle(IDLE_FOR_S, PHASE_TIMEOUT_S)
        parts0, cpu0 = self.components.snapshot(), machine_busy_s()
        phase = Phase(0.0, None)
        yield phase
        self.components.wait_until_worker_idle(IDLE_FOR_S, PHASE_TIMEOUT_S)
        cpu1, parts1 = machine_busy_s(), self.components.snapshot()
        phase.cpu_ms_per_op = machine_ms_per_op(cpu0, cpu1, self.n)
        phase.components_ms_per_op = Components.per_op_ms(parts0, parts1, self.n)

    def throughput(self, submit: Callable[[int], object], wait: Callable[[], float]) -> Phase:
        """submit(0 … n-1) from the producer threads, then `wait()` until all are done (it
        returns when the last one finished): the rate, and the CPU spent meanwhile."""
        with self.counted() as phase:
            started = time.time()
            _from_producers(submit, range(self.n))
            phase.per_s = self.n / (wait() - started)
        return phase

    def paced(self, send: Callable[[int], object], rate_per_s: float) -> dict[int, float]:
        """Call send(0 … n-1) at `rate_per_s` from the producer threads; when each was sent.
        It starts once the worker is idle: a phase before it may leave messages queued (a
        goal phase's dispatch messages whose work was taken along), and this one's would
        wait behind them."""
        self.components.wait_until_worker_idle(IDLE_FOR_S, PHASE_TIMEOUT_S)
        sent: dict[int, float] = {}
        interval_s = 1.0 / rate_per_s
        start = time.time()
        lock = threading.Lock()

        def one(i: int) -> None:
            delay = start + i * interval_s - time.time()
            if delay > 0:
                time.sleep(delay)
            t = time.time()
            send(i)
            with lock:
                sent[i] = t

        _from_producers(one, range(self.n))
        return sent

    # -- the audit ---------------------------------------------------------------------------
    def settled_states(self, submitted: dict[str, float]) -> dict[str, str]:
        """Each operation's status once it has settled. The agent's effect is seen before
        the worker records the completion, so an operation read right after its effect
        may still be dispatched: read it again until it settles."""
        states: dict[str, str] = {}

        def all_settled() -> bool:
            for op_id in submitted.keys() - states.keys():
                op = self.client.get_goal_operation(op_id)
                if op.settled:
                    states[op_id] = op.status
            return len(states) == len(submitted)

        wait_for(all_settled, PHASE_TIMEOUT_S, "every operation to settle", poll_s=0.05)
        return states

    def audit(self, ws: str, submitted: dict[str, float], allow_superseded: bool = False) -> dict:
        """Once every operation has settled: each completed one reached the agent exactly
        once, and nothing else did."""
        states = self.settled_states(submitted)
        self.feed.poll()
        per_op = Counter(e["operation_id"] for e in self.feed.goals(ws))
        return {"operations": len(submitted), **_exactly_once(states, per_op, allow_superseded)}

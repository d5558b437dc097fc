"""`agent-radar bench` (DESIGN 8): a standard Celery baseline beside goal operations end to
end — throughput, round-trip latency unloaded and at half the goal operations' maximum rate,
and the whole machine's CPU per operation — then a duplicate storm, all on the configured
database and broker with the same worker settings, every figure a ratio within one run."""

import random
import statistics
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

from workflows.adapters.config import Settings
from workflows.client import AgentRadar
from workflows.task_names import BASELINE_TASK
from workflows.tools.bench.cpu import (
    IDLE_FOR_S,
    Components,
    Phase,
    machine_busy_s,
    machine_ms_per_op,
)
from workflows.tools.bench.stats import (
    SUBMIT_THREADS,
    _exactly_once,
    _from_producers,
    _percentile,
    _summary,
)
from workflows.tools.bench.sweep import settled_sweep
from workflows.tools.simulator import SimControl
from workflows.tools.stack import Stack, free_port, wait_for

# Operations of each kind run, and not measured, before the first phase: a fresh worker
# process pays one-time costs on its first ones (each statement's compilation and first
# plan, connections, first code paths: the first goal dispatch took 7.6 ms to claim against
# 2.3 ms for the next), which a long-running worker pays once. Both kinds get the same.
WARM_UP = 50
STORM_COPIES = 5
PHASE_TIMEOUT_S = 300
# Both throughput phases wait for completion polling this often (the poll is cheap on both
# sides, and the same for both, so it weighs the same in their CPU figures).
POLL_S = 0.05
# Unloaded latency: one operation at a time, polling for its completion this often (a
# no-op's count on the broker: one cheap command); a goal operation's effect is awaited at
# the simulator, which answers as soon as it has it (or after this long).
UNLOADED_POLL_S = 0.0005
EFFECT_WAIT_S = 0.5
PROGRESS_EVERY_S = 2.0
# DESIGN 8 targets on PostgreSQL + Redis: (b)/(a) throughput at least; latency and CPU
# multiples at most. The embedded backend's throughput target is half, its multiples double.
TARGETS = {"throughput": 0.8, "unloaded_p50": 3.0, "paced_p99": 5.0, "cpu": 1.0}


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
        from tasks.app import create_app

        self.settings = settings
        self.n = operations
        self.echo = echo or (lambda *_: None)
        self.run_id = uuid.uuid4().hex[:8]
        self.client = AgentRadar(settings=settings)
        self.sim = SimControl(settings.runtime_url, settings.runtime_token)
        self.feed = EffectFeed(self.sim)
        # The baseline producer is Celery's own, configured as the workers are.
        self.celery = create_app(settings)
        self._tallies: list = []
        self.components = components or Components(None, None)

    def close(self) -> None:
        for tally in self._tallies:
            tally.close()
        self.celery.close()
        self.client.close()

    # -- progress --------------------------------------------------------------------------
    def _wait(self, label: str, count: Callable[[], int], total: int, poll_s: float = POLL_S):
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
        tally = self._tally()
        _from_producers(lambda i: self._send_noop(tally, i), range(count))
        self._wait("warm-up (a)", tally.count, count)
        ws = f"bench-{self.run_id}-warm-up"
        submitted: dict[str, float] = {}
        _from_producers(lambda i: self._set_goal(ws, i, submitted), range(count))
        self._await_effects(ws, count, "warm-up (b)")
        self.components.wait_until_worker_idle(IDLE_FOR_S, PHASE_TIMEOUT_S)
        return self._audit(ws, submitted)

    # -- (a) the standard Celery baseline ------------------------------------------------
    def _tally(self):
        from tasks.bench_tasks import Tally

        tally = Tally(self.settings, uuid.uuid4().hex[:12])
        self._tallies.append(tally)
        return tally

    def _send_noop(self, tally, index: int) -> None:
        self.celery.send_task(BASELINE_TASK, kwargs={"run_id": tally.run_id, "index": index})

    def _throughput(self, submit: Callable[[int], object], wait: Callable[[], float]) -> Phase:
        """submit(0 … n-1) from the producer threads, then `wait()` until all are done (it
        returns when the last one finished): the rate, and the CPU spent meanwhile."""
        parts0, cpu0, started = self.components.snapshot(), machine_busy_s(), time.time()
        _from_producers(submit, range(self.n))
        finished = wait()
        # The CPU counts until the worker is idle again, not only until the last operation
        # is done: what the worker does after it (acks and events, the last record, messages
        # whose work a dispatch already took along) is spent on this phase's operations.
        self.components.wait_until_worker_idle(IDLE_FOR_S, PHASE_TIMEOUT_S)
        cpu1, parts1 = machine_busy_s(), self.components.snapshot()
        return Phase(
            self.n / (finished - started),
            machine_ms_per_op(cpu0, cpu1, self.n),
            Components.per_op_ms(parts0, parts1, self.n),
        )

    def baseline_throughput(self) -> Phase:
        tally = self._tally()

        def done() -> float:
            self._wait("(a) no-ops done", tally.count, self.n)
            return max(tally.times().values())

        return self._throughput(lambda i: self._send_noop(tally, i), done)

    def baseline_unloaded(self, samples: int) -> list[float]:
        tally = self._tally()
        sent: dict[int, float] = {}
        for i in range(samples):
            sent[i] = time.time()
            self._send_noop(tally, i)
            self._wait("(a) unloaded", tally.count, i + 1, UNLOADED_POLL_S)
        done = tally.times()
        return [(done[i] - sent[i]) * 1000 for i in sent]

    def baseline_at_rate(self, rate_per_s: float) -> list[float]:
        tally = self._tally()
        sent = self._paced(lambda i: self._send_noop(tally, i), rate_per_s)
        self._wait("(a) paced", tally.count, self.n)
        done = tally.times()
        return [(done[i] - sent[i]) * 1000 for i in sent]

    def _paced(self, send: Callable[[int], object], rate_per_s: float) -> dict[int, float]:
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

    # -- (b) goal operations ---------------------------------------------------------------
    def _applied(self, workspace_id: str, wait_s: float = 0.0) -> int:
        self.feed.poll(wait_s)
        return len(self.feed.goals(workspace_id))

    def _await_effects(self, workspace_id: str, count: int, label: str) -> list[dict]:
        self._wait(label, lambda: self._applied(workspace_id), count)
        return self.feed.goals(workspace_id)

    def _set_goal(self, ws: str, i: int, submitted: dict[str, float]) -> None:
        t = time.time()
        op = self.client.set_goal(ws, f"s{i}", f"objective {i}", client_submit_id="1")
        submitted[op.operation_id] = t

    def goals_at_full_rate(self) -> tuple[Phase, dict]:
        ws = f"bench-{self.run_id}-max"
        submitted: dict[str, float] = {}

        def done() -> float:
            effects = self._await_effects(ws, self.n, "(b) goals applied")
            return max(e["at"] for e in effects)

        phase = self._throughput(lambda i: self._set_goal(ws, i, submitted), done)
        return phase, self._audit(ws, submitted)

    def goals_unloaded(self, samples: int) -> tuple[list[float], dict]:
        ws = f"bench-{self.run_id}-unloaded"
        submitted: dict[str, float] = {}
        for i in range(samples):
            self._set_goal(ws, i, submitted)
            # The simulator answers when the effect is in: asking it every UNLOADED_POLL_S
            # would take its time (and a core) from the very call being timed.
            self._wait("(b) unloaded", lambda: self._applied(ws, EFFECT_WAIT_S), i + 1, poll_s=0)
        effects = self.feed.goals(ws)
        latencies = [(e["at"] - submitted[e["operation_id"]]) * 1000 for e in effects]
        return latencies, self._audit(ws, submitted)

    def goals_at_rate(self, rate_per_s: float, label: str = "paced") -> tuple[list[float], dict]:
        ws = f"bench-{self.run_id}-{label}"
        ids: dict[int, str] = {}
        lock = threading.Lock()

        def send(i: int) -> None:
            op = self.client.set_goal(ws, f"s{i}", f"objective {i}", client_submit_id="1")
            with lock:
                ids[i] = op.operation_id

        sent = self._paced(send, rate_per_s)
        submitted = {ids[i]: t for i, t in sent.items()}
        effects = self._await_effects(ws, self.n, "(b) paced")
        latencies = [(e["at"] - submitted[e["operation_id"]]) * 1000 for e in effects]
        return latencies, self._audit(ws, submitted)

    def duplicate_storm(self) -> tuple[float, dict]:
        ws = f"bench-{self.run_id}-storm"
        distinct = max(self.n // STORM_COPIES, 1)
        calls = [i for i in range(distinct) for _ in range(STORM_COPIES)]
        random.Random(7).shuffle(calls)
        submitted: dict[str, float] = {}

        def submit(i: int) -> None:
            op = self.client.set_goal(ws, f"s{i % 8}", f"objective {i}", client_submit_id=str(i))
            submitted.setdefault(op.operation_id, time.time())

        started = time.time()
        _from_producers(submit, calls)
        rate = len(calls) / (time.time() - started)
        # Per session only the newest revision is sure to reach the agent (newer submits
        # supersede older pending ones); the audit waits for every operation to settle.
        return rate, self._audit(ws, submitted, allow_superseded=True)

    def fleet(self, stack: Stack, nodes: int, hosts: int) -> tuple[float, dict]:
        """(e) More worker nodes (2 processes each, beside the bench's worker) and more agent
        hosts (each a simulator of its own, registered and given an equal share of the
        sessions): the operations from the producer threads over a quarter as many
        sessions, until every one has settled; every effect must reach its session's host,
        each completed operation exactly once."""
        ws = f"bench-{self.run_id}-fleet"
        controls = {"default": self.sim}
        for i in range(1, hosts):
            host_id, url = f"bench-host-{i}", f"http://127.0.0.1:{free_port()}"
            stack.start_sim(host_id, url)
            # Its simulator was started with this process's settings: the same token.
            self.client.add_host(host_id, url, token=self.client.settings.runtime_token)
            controls[host_id] = SimControl(url, self.settings.runtime_token)
            controls[host_id].defaults(continuation_turns=False)
        for i in range(1, nodes):
            stack.start_worker(concurrency=2, name=f"bench-node-{i + 1}")
        host_ids = list(controls)
        sessions = max(self.n // 4, 1)
        for i in range(sessions):
            self.client.ensure_session(ws, f"s{i}", host_id=host_ids[i % len(host_ids)])
        host_of: dict[str, str] = {}
        submitted: dict[str, float] = {}
        lock = threading.Lock()

        def submit(i: int) -> None:
            t = time.time()
            op = self.client.set_goal(
                ws, f"s{i % sessions}", f"objective {i}", client_submit_id=str(i)
            )
            with lock:
                submitted[op.operation_id] = t
                host_of[op.operation_id] = host_ids[(i % sessions) % len(host_ids)]

        started = time.time()
        _from_producers(submit, range(self.n))
        states = self._settled_states(submitted)
        rate = self.n / (time.time() - started)
        effects = {
            host_id: Counter(
                e["operation_id"] for e in control.effects() if e["operation_id"] in submitted
            )
            for host_id, control in controls.items()
        }
        at_another_host = sum(
            n for h, c in effects.items() for op_id, n in c.items() if host_of[op_id] != h
        )
        audit = {
            "nodes": nodes,
            "hosts": hosts,
            "operations": len(submitted),
            **_exactly_once(states, sum(effects.values(), Counter()), allow_superseded=True),
            "effects_by_host": {h: sum(c.values()) for h, c in effects.items()},
            "at_another_host": at_another_host,
        }
        audit["exactly_once"] = audit["exactly_once"] and at_another_host == 0
        return rate, audit

    def _settled_states(self, submitted: dict[str, float]) -> dict[str, str]:
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

    def _audit(self, ws: str, submitted: dict[str, float], allow_superseded: bool = False) -> dict:
        """Once every operation has settled: each completed one reached the agent exactly
        once, and nothing else did."""
        states = self._settled_states(submitted)
        self.feed.poll()
        per_op = Counter(e["operation_id"] for e in self.feed.goals(ws))
        return {"operations": len(submitted), **_exactly_once(states, per_op, allow_superseded)}


def targets(settings: Settings, ratios: dict[str, float | None]) -> dict[str, dict]:
    """Each DESIGN 8 target with this run's ratio and whether it was met."""
    embedded = settings.is_embedded_broker or settings.database_url.startswith("sqlite")
    out = {}
    for name, limit in TARGETS.items():
        if embedded:
            limit = limit / 2 if name == "throughput" else limit * 2
        ratio = ratios.get(name)
        met = None
        if ratio is not None:
            met = ratio >= limit if name == "throughput" else ratio <= limit
        out[name] = {"ratio": ratio, "limit": limit, "met": met}
    return out


def run_bench(
    settings: Settings,
    *,
    operations: int = 400,
    concurrency: int = 2,
    settled: int = 0,
    nodes: int = 1,
    hosts: int = 1,
    slow_hosts: bool = False,
    echo: Callable | None = print,
) -> dict:
    settings = replace(settings, runtime_url=f"http://127.0.0.1:{free_port()}")
    stack = Stack(settings)
    say = echo or (lambda *_: None)
    bench = None
    try:
        stack.prepare()
        sim = stack.start_sim()
        # Only the benchmark's own worker registers the baseline no-op task.
        worker = stack.start_worker(
            concurrency=concurrency, name="bench-worker", extra_env={"AGENT_RADAR_BENCH_TASKS": "1"}
        )
        bench = Bench(settings, operations, echo, Components(worker.pid, sim.pid))
        # (b) measures the goal operation path; continuation turns (and their reports) are
        # agent activity that would only add unrelated load.
        bench.sim.defaults(continuation_turns=False)
        samples = max(10, min(100, operations // 10))
        say(
            f"backend: {settings.database_url.split(':', 1)[0]} + "
            f"{settings.broker_url.split(':', 1)[0]}; worker processes: {concurrency}; "
            f"producer threads: {SUBMIT_THREADS}; operations per phase: {operations}; "
            f"unloaded samples: {samples}"
        )
        warm_up_audit = bench.warm_up()
        say(f"warm-up: {WARM_UP} operations of each kind, not measured")
        # Throughput first, each kind on a quiet machine.
        base = bench.baseline_throughput()
        say(f"(a) Celery no-op tasks:          {base.per_s:8.1f} tasks/s  {_cpu(base)}")
        goals, full_audit = bench.goals_at_full_rate()
        say(f"(b) goal operations to applied:  {goals.per_s:8.1f} ops/s    {_cpu(goals)}")
        if base.components_ms_per_op and goals.components_ms_per_op:
            say("    CPU ms per operation by component, (a) / (b):")
            for name, a_ms in base.components_ms_per_op.items():
                say(f"      {name:<12} {a_ms:6.2f} / {goals.components_ms_per_op[name]:6.2f}")
        base_unloaded = bench.baseline_unloaded(samples)
        goal_unloaded, unloaded_audit = bench.goals_unloaded(samples)
        say(
            f"    unloaded round trip p50: (a) {statistics.median(base_unloaded):.2f} ms, "
            f"(b) {statistics.median(goal_unloaded):.2f} ms"
        )
        rate = goals.per_s / 2
        base_paced = bench.baseline_at_rate(rate)
        latencies, paced_audit = bench.goals_at_rate(rate)
        say(
            f"    at {rate:.1f}/s (half of (b)): (a) p50 {statistics.median(base_paced):.1f} ms "
            f"p99 {_percentile(base_paced, 99):.1f} ms; (b) p50 "
            f"{statistics.median(latencies):.1f} ms p99 {_percentile(latencies, 99):.1f} ms"
        )
        # When goal operations outrun the baseline, half of their maximum rate comes near
        # the baseline's own maximum, where it queues too: the target's ratio then says
        # little. Both are also timed at half of the slower one's maximum, a rate both
        # sustain (reported beside the target, not instead of it).
        common = None
        common_audit = None
        common_rate = min(base.per_s, goals.per_s) / 2
        if common_rate < rate:
            base_common = bench.baseline_at_rate(common_rate)
            goals_common, common_audit = bench.goals_at_rate(common_rate, "paced-common")
            common = {
                "rate_per_s": round(common_rate, 1),
                "baseline_ms": _summary(base_common),
                "goals_ms": _summary(goals_common),
                "p99_ratio": round(_percentile(goals_common, 99) / _percentile(base_common, 99), 2),
            }
            say(
                f"    at {common_rate:.1f}/s (half of the slower): (a) p99 "
                f"{common['baseline_ms']['p99']:.1f} ms; (b) p50 "
                f"{common['goals_ms']['p50']:.1f} ms p99 {common['goals_ms']['p99']:.1f} ms; "
                f"p99 (b)/(a) {common['p99_ratio']}"
            )
        storm_rate, storm_audit = bench.duplicate_storm()
        say(
            f"(c) duplicate storm ({STORM_COPIES} copies of each id): {storm_rate:8.1f} "
            f"submissions/s"
        )
        fleet_rate, fleet_audit = None, None
        if nodes > 1 or hosts > 1:
            fleet_rate, fleet_audit = bench.fleet(stack, nodes, hosts)
            say(
                f"(e) {nodes} worker nodes, {hosts} agent hosts: {fleet_rate:8.1f} ops/s to all "
                f"settled; effects by host {fleet_audit['effects_by_host']}, at another host "
                f"{fleet_audit['at_another_host']}, applied twice {fleet_audit['applied_twice']}"
            )
        slow = None
        if slow_hosts:
            from workflows.tools.bench.hosts import slow_hosts as slow_hosts_phase

            slow = slow_hosts_phase(bench, stack, say)
        audits = [warm_up_audit, full_audit, unloaded_audit, paced_audit, storm_audit]
        if slow is not None:
            audits += slow["audits"]
        if common_audit is not None:
            audits.append(common_audit)
        if fleet_audit is not None:
            audits.append(fleet_audit)
        exactly_once = all(a["exactly_once"] for a in audits)
        say(f"exactly once: {'yes' if exactly_once else 'NO'}")
        ratios = {
            "throughput": round(goals.per_s / base.per_s, 3),
            "unloaded_p50": round(
                statistics.median(goal_unloaded) / statistics.median(base_unloaded), 2
            ),
            "paced_p99": round(_percentile(latencies, 99) / _percentile(base_paced, 99), 2),
            "cpu": (
                round(goals.cpu_ms_per_op / base.cpu_ms_per_op, 2)
                if goals.cpu_ms_per_op and base.cpu_ms_per_op
                else None
            ),
        }
        checked = targets(settings, ratios)
        for name, t in checked.items():
            relation = ">=" if name == "throughput" else "<="
            verdict = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
            limit = f"{relation} {t['limit']:g}"
            say(f"    (b)/(a) {name:<13} {t['ratio']!s:>6}  target {limit}: {verdict}")
        sweep = None
        if settled:
            say(f"(d) sweep cost with {settled:,} more settled operations in history:")
            sweep = settled_sweep(settings, settled, bench.run_id, say)
            say(
                f"    {sweep['before']['sweep_ms']:.2f} ms over {sweep['before']['settled']:,} "
                f"settled, {sweep['after']['sweep_ms']:.2f} ms over "
                f"{sweep['after']['settled']:,} settled: ratio {sweep['ratio']:.2f}"
            )
        return {
            "backend": {
                "database": settings.database_url.split(":", 1)[0],
                "broker": settings.broker_url.split(":", 1)[0],
                "worker_processes": concurrency,
                "producer_threads": SUBMIT_THREADS,
            },
            "operations": operations,
            "unloaded_samples": samples,
            "warm_up_operations": WARM_UP,
            "baseline": {
                "per_s": round(base.per_s, 1),
                "cpu_ms_per_op": base.cpu_ms_per_op,
                "cpu_ms_per_op_by_component": base.components_ms_per_op,
                "unloaded_ms": _summary(base_unloaded),
                "paced_ms": _summary(base_paced),
            },
            "goals": {
                "per_s": round(goals.per_s, 1),
                "cpu_ms_per_op": goals.cpu_ms_per_op,
                "cpu_ms_per_op_by_component": goals.components_ms_per_op,
                "unloaded_ms": _summary(goal_unloaded),
                "paced_ms": _summary(latencies),
            },
            "ratios": ratios,
            "targets": checked,
            "raw_noop_per_s": round(base.per_s, 1),
            "goal_ops_per_s": round(goals.per_s, 1),
            "ratio": ratios["throughput"],
            "paced_rate_per_s": round(rate, 1),
            "paced_at_common_rate": common,
            "latency_ms": _summary(latencies),
            "storm_submissions_per_s": round(storm_rate, 1),
            "audit": {
                "warm_up": warm_up_audit,
                "full_rate": full_audit,
                "unloaded": unloaded_audit,
                "paced": paced_audit,
                "paced_common": common_audit,
                "storm": storm_audit,
                "fleet": fleet_audit,
            },
            "fleet_ops_per_s": None if fleet_rate is None else round(fleet_rate, 1),
            "slow_hosts": slow,
            "exactly_once": exactly_once,
            "settled_sweep": sweep,
        }
    finally:
        if bench is not None:
            bench.close()
        stack.stop()


def _cpu(phase: Phase) -> str:
    if phase.cpu_ms_per_op is None:
        return ""
    return f"CPU {phase.cpu_ms_per_op:.2f} ms/op (whole machine)"

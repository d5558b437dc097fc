"""`agent-radar bench` (DESIGN 8): raw Celery no-ops vs goal operations end to end, latency
at half the maximum rate, and a duplicate storm — on the configured database and broker,
with the same worker settings for every phase."""

import random
import statistics
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from sqlalchemy import func, insert, select

from models.base import utcnow
from models.db import engine_for, run_transaction
from models.enums import TERMINAL_OPERATION_STATUSES
from models.tables import GoalOperation as GoalOperationRow
from workflows.adapters.broker import TaskPublisher
from workflows.adapters.config import Settings
from workflows.client import AgentRadar
from workflows.tools.simulator import SimControl
from workflows.tools.stack import Stack, free_port, wait_for

SUBMIT_THREADS = 4
STORM_COPIES = 5
PHASE_TIMEOUT_S = 300


def _percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(pct / 100 * len(ordered)) - 1))
    return ordered[index]


class Bench:
    def __init__(self, settings: Settings, operations: int, echo: Callable | None) -> None:
        self.settings = settings
        self.n = operations
        self.echo = echo or (lambda *_: None)
        self.run_id = uuid.uuid4().hex[:8]
        self.client = AgentRadar(settings=settings)
        self.sim = SimControl(settings.runtime_url, settings.runtime_token)
        self.publisher = TaskPublisher(settings)

    def raw_noops(self) -> float:
        from tasks.bench_tasks import completions

        (self.settings.home / "bench").mkdir(parents=True, exist_ok=True)
        started = time.time()
        for i in range(self.n):
            self.publisher.publish("agent_radar.bench.noop", {"run_id": self.run_id, "index": i})
        done = wait_for(
            lambda: (lambda t: len(t) >= self.n and t)(
                completions(self.settings.home, self.run_id)
            ),
            PHASE_TIMEOUT_S,
            "the no-op tasks",
        )
        return self.n / (max(done) - started)

    def _effects(self, workspace_id: str) -> list[dict]:
        return [e for e in self.sim.effects() if e["workspace_id"] == workspace_id]

    def _await_effects(self, workspace_id: str, count: int) -> list[dict]:
        return wait_for(
            lambda: (lambda e: len(e) >= count and e)(self._effects(workspace_id)),
            PHASE_TIMEOUT_S,
            f"{count} effects in {workspace_id}",
            poll_s=0.1,
        )

    def goals_at_full_rate(self) -> tuple[float, dict]:
        ws = f"bench-{self.run_id}-max"
        submitted: dict[str, float] = {}

        def submit(i: int) -> None:
            t = time.time()
            op = self.client.set_goal(ws, f"s{i}", f"objective {i}", client_submit_id="1")
            submitted[op.operation_id] = t

        started = time.time()
        with ThreadPoolExecutor(SUBMIT_THREADS) as pool:
            list(pool.map(submit, range(self.n)))
        effects = self._await_effects(ws, self.n)
        finished = max(e["at"] for e in effects)
        return self.n / (finished - started), self._audit(ws, effects, submitted)

    def goals_at_rate(self, rate_per_s: float) -> tuple[list[float], dict]:
        ws = f"bench-{self.run_id}-paced"
        submitted: dict[str, float] = {}
        interval_s = 1.0 / rate_per_s
        start = time.time()
        lock = threading.Lock()

        def submit(i: int) -> None:
            delay = start + i * interval_s - time.time()
            if delay > 0:
                time.sleep(delay)
            t = time.time()
            op = self.client.set_goal(ws, f"s{i}", f"objective {i}", client_submit_id="1")
            with lock:
                submitted[op.operation_id] = t

        with ThreadPoolExecutor(SUBMIT_THREADS) as pool:
            list(pool.map(submit, range(self.n)))
        effects = self._await_effects(ws, self.n)
        latencies = [(e["at"] - submitted[e["operation_id"]]) * 1000 for e in effects]
        return latencies, self._audit(ws, effects, submitted)

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
        with ThreadPoolExecutor(SUBMIT_THREADS) as pool:
            list(pool.map(submit, calls))
        rate = len(calls) / (time.time() - started)
        # Per session only the newest revision is sure to reach the agent (newer submits
        # supersede older pending ones); wait for every operation to settle.
        wait_for(
            lambda: all(self.client.get_goal_operation(op_id).settled for op_id in submitted),
            PHASE_TIMEOUT_S,
            "the storm to settle",
            poll_s=0.2,
        )
        return rate, self._audit(ws, self._effects(ws), submitted, allow_superseded=True)

    def _audit(
        self,
        ws: str,
        effects: list[dict],
        submitted: dict[str, float],
        allow_superseded: bool = False,
    ) -> dict:
        per_op = Counter(e["operation_id"] for e in effects)
        states = {op_id: self.client.get_goal_operation(op_id).status for op_id in submitted}
        statuses = Counter(states.values())
        # In a storm a newer submit may supersede an operation while its call is in flight:
        # that one reached the agent once and ends superseded. Completed ones always did.
        allowed = {"completed", "superseded"} if allow_superseded else {"completed"}
        completed = {op_id for op_id, status in states.items() if status == "completed"}
        return {
            "operations": len(submitted),
            "statuses": dict(statuses),
            "effects": len(effects),
            "applied_twice": sum(1 for n in per_op.values() if n > 1),
            "unknown_effects": sum(1 for op_id in per_op if op_id not in submitted),
            "exactly_once": set(statuses) <= allowed
            and all(n == 1 for n in per_op.values())
            and not set(per_op) - set(submitted)
            and all(per_op.get(op_id) == 1 for op_id in completed),
        }


# -- DESIGN 8: a sweep over a large settled history costs about what a sweep over none does --
SWEEP_REPEATS = 25
SETTLED_CHUNK = 10_000


def _sweep_ms(engine) -> float:
    """Median wall time of one sweep over this database, in ms."""
    from beat.sweeper import sweep_once

    times = []
    for i in range(SWEEP_REPEATS):
        started = time.perf_counter()
        sweep_once(engine, lambda _task, _kwargs: True, utcnow(), owner=f"bench-sweep-{i}")
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def _settled_count(engine) -> int:
    return run_transaction(
        engine,
        lambda s: s.execute(
            select(func.count())
            .select_from(GoalOperationRow)
            .where(GoalOperationRow.status.in_(TERMINAL_OPERATION_STATUSES))
        ).scalar_one(),
    )


def _add_settled(engine, workspace_id: str, count: int, say: Callable) -> None:
    """Add `count` completed goal operations, as a long history leaves behind."""
    now = utcnow()
    for start in range(0, count, SETTLED_CHUNK):
        rows = [
            {
                "operation_id": str(uuid.uuid4()),
                "workspace_id": workspace_id,
                "session_id": f"h{i}",
                "client_submit_id": "1",
                "origin": "client",
                "action": "set",
                "objective": "settled",
                "goal_revision": 1,
                "status": "completed",
                "provider_phase": "applied",
                "attempt": 1,
                "next_attempt_at": now,
                "first_dispatched_at": now,
                "completed_at": now,
                "created_at": now,
            }
            for i in range(start, min(start + SETTLED_CHUNK, count))
        ]
        run_transaction(
            engine,
            lambda s, rows=rows: s.connection().execute(insert(GoalOperationRow.__table__), rows),
        )
        if (start // SETTLED_CHUNK) % 10 == 9:
            say(f"    … {start + SETTLED_CHUNK:,} settled operations added")
    if engine.dialect.name == "postgresql":
        # What autovacuum's automatic analyze does soon after a bulk load.
        with engine.begin() as conn:
            conn.exec_driver_sql("ANALYZE goal_operations")


def settled_sweep(settings: Settings, count: int, run_id: str, say: Callable) -> dict:
    """Sweep time over the database as it is, then with `count` more settled operations."""
    engine = engine_for(settings.database_url)
    before = {"settled": _settled_count(engine), "sweep_ms": _sweep_ms(engine)}
    _add_settled(engine, f"bench-{run_id}-history", count, say)
    after = {"settled": _settled_count(engine), "sweep_ms": _sweep_ms(engine)}
    return {
        "before": {"settled": before["settled"], "sweep_ms": round(before["sweep_ms"], 2)},
        "after": {"settled": after["settled"], "sweep_ms": round(after["sweep_ms"], 2)},
        "ratio": round(after["sweep_ms"] / before["sweep_ms"], 2),
    }


def run_bench(
    settings: Settings,
    *,
    operations: int = 400,
    concurrency: int = 2,
    settled: int = 0,
    echo: Callable | None = print,
) -> dict:
    settings = replace(settings, runtime_url=f"http://127.0.0.1:{free_port()}")
    stack = Stack(settings)
    say = echo or (lambda *_: None)
    try:
        stack.prepare()
        stack.start_sim()
        # Only the benchmark's own worker registers the baseline no-op task.
        stack.start_worker(
            concurrency=concurrency, name="bench-worker", extra_env={"AGENT_RADAR_BENCH_TASKS": "1"}
        )
        bench = Bench(settings, operations, echo)
        # (b) measures the goal operation path; continuation turns (and their reports) are
        # agent activity that would only add unrelated load.
        bench.sim.defaults(continuation_turns=False)
        say(
            f"backend: {settings.database_url.split(':', 1)[0]} + "
            f"{settings.broker_url.split(':', 1)[0]}; worker processes: {concurrency}; "
            f"operations per phase: {operations}"
        )
        raw = bench.raw_noops()
        say(f"(a) raw Celery no-op tasks:     {raw:8.1f} tasks/s")
        goal_rate, full_audit = bench.goals_at_full_rate()
        say(
            f"(b) goal operations to applied: {goal_rate:8.1f} ops/s   ratio (b)/(a) = "
            f"{goal_rate / raw:.2f}"
        )
        latencies, paced_audit = bench.goals_at_rate(goal_rate / 2)
        p50, p99 = statistics.median(latencies), _percentile(latencies, 99)
        say(
            f"    at half that rate ({goal_rate / 2:.1f}/s): submit->applied "
            f"p50 {p50:.1f} ms, p99 {p99:.1f} ms"
        )
        storm_rate, storm_audit = bench.duplicate_storm()
        say(
            f"(c) duplicate storm ({STORM_COPIES} copies of each id): {storm_rate:8.1f} "
            f"submissions/s"
        )
        exactly_once = all(a["exactly_once"] for a in (full_audit, paced_audit, storm_audit))
        say(f"exactly once: {'yes' if exactly_once else 'NO'}")
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
            },
            "operations": operations,
            "raw_noop_per_s": round(raw, 1),
            "goal_ops_per_s": round(goal_rate, 1),
            "ratio": round(goal_rate / raw, 3),
            "paced_rate_per_s": round(goal_rate / 2, 1),
            "latency_ms": {"p50": round(p50, 1), "p99": round(p99, 1)},
            "storm_submissions_per_s": round(storm_rate, 1),
            "audit": {"full_rate": full_audit, "paced": paced_audit, "storm": storm_audit},
            "exactly_once": exactly_once,
            "settled_sweep": sweep,
        }
    finally:
        stack.stop()

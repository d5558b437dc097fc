"""`agent-radar bench`: runs the phases in order on a fresh worker and simulator, prints each
figure as it comes, checks the targets, and returns the whole report."""

import statistics
from collections.abc import Callable
from dataclasses import replace

from ...adapters.config import Settings
from ..stack import Stack, free_port
from .baseline import (
    baseline_at_rate,
    baseline_throughput,
    baseline_unloaded,
)
from .cpu import Components, Phase
from .goals import (
    STORM_COPIES,
    duplicate_storm,
    fleet,
    goals_at_full_rate,
    goals_at_rate,
    goals_unloaded,
)
from .harness import WARM_UP, Bench
from .hosts import slow_hosts as slow_hosts_phase
from .stats import SUBMIT_THREADS, _percentile, _summary
from .sweep import COSTS, settled_costs

# docs/benchmarks.md on PostgreSQL + Redis: (b)/(a) throughput at least; latency and CPU
# multiples at most. The embedded backend's throughput target is half, its multiples double.
TARGETS = {"throughput": 1.2, "unloaded_p50": 2.5, "paced_p99": 5.0, "cpu": 1.0}


def targets(settings: Settings, ratios: dict[str, float | None]) -> dict[str, dict]:
    """Each docs/benchmarks.md with this run's ratio and whether it was met."""
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
        base = baseline_throughput(bench)
        say(f"(a) Celery no-op tasks:          {base.per_s:8.1f} tasks/s  {_cpu(base)}")
        goals, full_audit = goals_at_full_rate(bench)
        say(f"(b) goal operations to applied:  {goals.per_s:8.1f} ops/s    {_cpu(goals)}")
        if base.components_ms_per_op and goals.components_ms_per_op:
            say("    CPU ms per operation by component, (a) / (b):")
            for name, a_ms in base.components_ms_per_op.items():
                say(f"      {name:<12} {a_ms:6.2f} / {goals.components_ms_per_op[name]:6.2f}")
        base_unloaded = baseline_unloaded(bench, samples)
        goal_unloaded, unloaded_audit = goals_unloaded(bench, samples)
        say(
            f"    unloaded round trip p50: (a) {statistics.median(base_unloaded):.2f} ms, "
            f"(b) {statistics.median(goal_unloaded):.2f} ms"
        )
        rate = goals.per_s / 2
        # Each with its CPU: unbatched, an operation costs more than at full rate, and what
        # the machine has left at this rate shapes the tail (docs/benchmarks.md).
        with bench.counted() as base_paced_cost:
            base_paced = baseline_at_rate(bench, rate)
        latencies, paced_audit, paced_cost = goals_at_rate(bench, rate)
        say(
            f"    at {rate:.1f}/s (half of (b)): (a) p50 {statistics.median(base_paced):.1f} ms "
            f"p99 {_percentile(base_paced, 99):.1f} ms; (b) p50 "
            f"{statistics.median(latencies):.1f} ms p99 {_percentile(latencies, 99):.1f} ms"
        )
        if base_paced_cost.cpu_ms_per_op and paced_cost.cpu_ms_per_op:
            say(f"    at that rate: (a) {_cpu(base_paced_cost)}; (b) {_cpu(paced_cost)}")
        # When goal operations outrun the baseline, half of their maximum rate comes near
        # the baseline's own maximum, where it queues too: the target's ratio then says
        # little. Both are also timed at half of the slower one's maximum, a rate both
        # sustain (reported beside the target, not instead of it).
        common = None
        common_audit = None
        common_rate = min(base.per_s, goals.per_s) / 2
        if common_rate < rate:
            base_common = baseline_at_rate(bench, common_rate)
            goals_common, common_audit, _cost = goals_at_rate(bench, common_rate, "paced-common")
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
        storm_rate, storm_audit = duplicate_storm(bench)
        say(
            f"(c) duplicate storm ({STORM_COPIES} copies of each id): {storm_rate:8.1f} "
            f"submissions/s"
        )
        fleet_rate, fleet_audit = None, None
        if nodes > 1 or hosts > 1:
            fleet_rate, fleet_audit = fleet(bench, stack, nodes, hosts)
            say(
                f"(e) {nodes} worker nodes, {hosts} agent hosts: {fleet_rate:8.1f} ops/s to all "
                f"settled; effects by host {fleet_audit['effects_by_host']}, at another host "
                f"{fleet_audit['at_another_host']}, applied twice {fleet_audit['applied_twice']}"
            )
        slow = None
        if slow_hosts:
            slow = slow_hosts_phase(bench, stack, say)
        costs = None
        if settled:
            say(f"(d) costs with {settled:,} more settled operations in history:")
            costs = settled_costs(settings, bench, settled, say)
            say(
                f"    settled before {costs['before']['settled']:,}, "
                f"after {costs['after']['settled']:,}"
            )
            for key, name in COSTS.items():
                say(
                    f"    {name:<24} {costs['before'][key]:9.2f} ms → "
                    f"{costs['after'][key]:9.2f} ms: ratio {costs['ratios'][key]:.2f}"
                )
        audits = [warm_up_audit, full_audit, unloaded_audit, paced_audit, storm_audit]
        if slow is not None:
            audits += slow["audits"]
        if common_audit is not None:
            audits.append(common_audit)
        if fleet_audit is not None:
            audits.append(fleet_audit)
        if costs is not None:
            audits += costs["audits"]
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
                "paced_cpu_ms_per_op": base_paced_cost.cpu_ms_per_op,
                "paced_cpu_ms_per_op_by_component": base_paced_cost.components_ms_per_op,
            },
            "goals": {
                "per_s": round(goals.per_s, 1),
                "cpu_ms_per_op": goals.cpu_ms_per_op,
                "cpu_ms_per_op_by_component": goals.components_ms_per_op,
                "unloaded_ms": _summary(goal_unloaded),
                "paced_ms": _summary(latencies),
                "paced_cpu_ms_per_op": paced_cost.cpu_ms_per_op,
                "paced_cpu_ms_per_op_by_component": paced_cost.components_ms_per_op,
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
            "settled_costs": costs,
        }
    finally:
        if bench is not None:
            bench.close()
        stack.stop()


def _cpu(phase: Phase) -> str:
    if phase.cpu_ms_per_op is None:
        return ""
    return f"CPU {phase.cpu_ms_per_op:.2f} ms/op (whole machine)"

"""The benchmark's slow-hosts phase, (f) (`agent-radar bench --slow-hosts`): agent hosts as
a fleet has them, slow and uneven, and one that hangs or trickles (docs/dispatch.md).

- Throughput with every host answering a goal in 200 ms beside the same with hosts answering
  at once: the operations from the producer threads, one per session, to all applied; the
  rate while the fleet is busy (between the tenth and the ninetieth percentile of the
  effects), so that one call's latency at the run's end is not counted as throughput.
- The healthy hosts' tail with a bad host beside them: goals paced at PACED_RATE, over
  HEALTHY_HOSTS hosts whose goal answers take p50 200 ms, p99 2 s; once alone, then with a
  bad host (hanging: it never answers; or trickling: a byte a second) taking every
  BAD_EVERY-th goal. Each goal's latency is from its submit to its effect at the host.

Every operation, the bad host's included once it recovers, must reach its host exactly once.
"""

import threading
import time
from collections import Counter
from collections.abc import Callable

from ..simulator import SimControl
from ..stack import Stack, free_port
from .harness import Bench
from .stats import (
    _exactly_once,
    _from_producers,
    _percentile,
    _summary,
)

HEALTHY_HOSTS = 3
SLOW_MS, SLOW_P99_MS = 200, 2000
PACED_RATE = 40.0
BAD_EVERY = 4
TARGETS = {"tail_beside_bad_host": 1.5, "throughput_at_200ms": 0.8}


class Hosts:
    """The phase's own agent hosts (simulator processes), registered with the product."""

    def __init__(self, bench: Bench, stack: Stack) -> None:
        self.bench = bench
        self.controls: dict[str, SimControl] = {}
        token = bench.settings.runtime_token
        for name in [f"fast-{i}" for i in range(HEALTHY_HOSTS)] + ["bad"]:
            host_id, url = f"bench-{bench.run_id}-{name}", f"http://127.0.0.1:{free_port()}"
            stack.start_sim(host_id, url)
            bench.client.add_host(host_id, url, token=token)
            self.controls[host_id] = SimControl(url, token)
            self.controls[host_id].defaults(continuation_turns=False)
        self.healthy = list(self.controls)[:HEALTHY_HOSTS]
        self.bad = list(self.controls)[HEALTHY_HOSTS]

    def latency(self, ms: int, p99_ms: int | None = None) -> None:
        # Drawn per session: each tail phase's sessions s0, s1 … draw the same latencies, so
        # that their p99s differ by what the product adds, not by the draws (the p99 of 600
        # independent draws alone varied by a factor of 1.5 between runs).
        for host_id in self.healthy:
            self.controls[host_id].latency("goal", ms, p99_ms, per_session=True)

    def sessions(self, ws: str, count: int, hosts: list[str]) -> list[tuple[str, str]]:
        """`count` sessions of `ws`, bound in turn to these hosts: (session id, host id)."""
        bound = [(f"s{i}", hosts[i % len(hosts)]) for i in range(count)]
        for sid, host_id in bound:
            self.bench.client.ensure_session(ws, sid, host_id=host_id)
        return bound

    def effects(self, ws: str) -> dict[str, tuple[str, float]]:
        """Every goal effect of `ws` at any host: operation id -> (host id, when)."""
        found: dict[str, tuple[str, float]] = {}
        for host_id, control in self.controls.items():
            for e in control.effects():
                if e["workspace_id"] == ws:
                    found[e["operation_id"]] = (host_id, e["at"])
        return found

    def per_op(self, ws: str) -> Counter:
        return Counter(
            e["operation_id"]
            for control in self.controls.values()
            for e in control.effects()
            if e["workspace_id"] == ws
        )


def _throughput(bench: Bench, hosts: Hosts, label: str) -> tuple[float, dict]:
    ws = f"bench-{bench.run_id}-{label}"
    hosts.sessions(ws, bench.n, hosts.healthy)  # s0, s1 … as Bench.set_goal names them
    bench.components.wait_until_worker_idle(0.3, 300)
    submitted: dict[str, float] = {}

    _from_producers(lambda i: bench.set_goal(ws, i, submitted), range(bench.n))
    bench.wait(f"(f) {label}", lambda: len(hosts.effects(ws)), bench.n, poll_s=0.2)
    return _sustained_rate([at for _, at in hosts.effects(ws).values()]), _audit(
        bench, hosts, ws, submitted
    )


def _sustained_rate(effect_times: list[float]) -> float:
    """Operations a second while the fleet is busy: between the tenth and the ninetieth
    percentile of the effects' times. The whole run's rate would also count one call's
    latency at its end (and the fill at its start): on a fast machine 600 operations take
    under a second at full rate, and 200 ms more for the last call is a fifth of that,
    whatever the throughput."""
    times = sorted(effect_times)
    first, last = len(times) // 10, len(times) * 9 // 10
    return (last - first) / max(times[last] - times[first], 1e-6)


def _paced(bench: Bench, hosts: Hosts, label: str, bad: Callable[[], None] | None):
    """Goals paced at PACED_RATE to the healthy hosts' sessions, and with `bad` (which makes
    the bad host misbehave) every BAD_EVERY-th to the bad host's: the healthy goals'
    latencies (ms) and the audit, taken once the bad host is healthy again."""
    ws = f"bench-{bench.run_id}-{label}"
    hosts.sessions(ws, bench.n, hosts.healthy)  # s0, s1 … as Bench.set_goal names them
    bad_sessions = hosts.sessions(f"{ws}-bad", bench.n // BAD_EVERY, [hosts.bad]) if bad else []
    if bad:
        bad()
    submitted: dict[str, float] = {}
    bad_submitted: dict[str, float] = {}
    lock = threading.Lock()

    def send(i: int) -> None:
        bench.set_goal(ws, i, submitted)
        if bad_sessions and i % BAD_EVERY == 0:
            sid = bad_sessions[i // BAD_EVERY][0]
            op = bench.client.set_goal(f"{ws}-bad", sid, f"objective {i}", client_submit_id="1")
            with lock:
                bad_submitted[op.operation_id] = time.time()

    bench.paced(send, PACED_RATE)
    bench.wait(f"(f) {label}", lambda: len(hosts.effects(ws)), bench.n, poll_s=0.2)
    effects = hosts.effects(ws)
    latencies = [(effects[op_id][1] - t) * 1000 for op_id, t in submitted.items()]
    audit = _audit(bench, hosts, ws, submitted)
    if bad:
        for control in (hosts.controls[hosts.bad],):
            control.hold("goal", hold=False)
            control.trickle(0)
        bad_audit = _audit(bench, hosts, f"{ws}-bad", bad_submitted)
        audit = {**audit, "bad_host": bad_audit}
        audit["exactly_once"] = audit["exactly_once"] and bad_audit["exactly_once"]
    return latencies, audit


def _audit(bench: Bench, hosts: Hosts, ws: str, submitted: dict[str, float]) -> dict:
    states = bench.settled_states(submitted)
    return {"operations": len(submitted), **_exactly_once(states, hosts.per_op(ws), False)}


def slow_hosts(bench: Bench, stack: Stack, say: Callable[[str], object]) -> dict:
    """Phase (f); its figures, ratios and audits."""
    hosts = Hosts(bench, stack)
    # The bad host's goals fail and are retried, and its circuit gives work back: what is due
    # again later is published by the sweeper, as in production.
    stack.start_beat()
    fast_rate, fast_audit = _throughput(bench, hosts, "hosts-0ms")
    hosts.latency(SLOW_MS)
    slow_rate, slow_audit = _throughput(bench, hosts, "hosts-200ms")
    say(
        f"(f) throughput, hosts answering at once: {fast_rate:8.1f} ops/s; in {SLOW_MS} ms: "
        f"{slow_rate:8.1f} ops/s ({slow_rate / fast_rate:.2f}×)"
    )
    hosts.latency(SLOW_MS, SLOW_P99_MS)
    alone, alone_audit = _paced(bench, hosts, "tail-alone", None)
    bad_control = hosts.controls[hosts.bad]
    hung, hung_audit = _paced(bench, hosts, "tail-hang", lambda: bad_control.hold("goal"))
    trickled, trickle_audit = _paced(
        bench, hosts, "tail-trickle", lambda: bad_control.trickle(1000)
    )
    hosts.latency(0)
    ratios = {
        "throughput_at_200ms": round(slow_rate / fast_rate, 3),
        "tail_beside_hanging_host": round(_percentile(hung, 99) / _percentile(alone, 99), 2),
        "tail_beside_trickling_host": round(_percentile(trickled, 99) / _percentile(alone, 99), 2),
    }
    for label, figures in (
        ("alone", alone),
        ("beside a hanging host", hung),
        ("beside a trickling host", trickled),
    ):
        say(f"    healthy hosts at {PACED_RATE:.0f}/s, {label}: {_fmt(_summary(figures))}")
    met = {
        "throughput_at_200ms": ratios["throughput_at_200ms"] >= TARGETS["throughput_at_200ms"],
        "tail_beside_bad_host": max(
            ratios["tail_beside_hanging_host"], ratios["tail_beside_trickling_host"]
        )
        <= TARGETS["tail_beside_bad_host"],
    }
    say(
        f"    p99 beside a hanging host {ratios['tail_beside_hanging_host']}×, beside a "
        f"trickling host {ratios['tail_beside_trickling_host']}× (target <= 1.5): "
        f"{'met' if met['tail_beside_bad_host'] else 'MISSED'}; throughput at {SLOW_MS} ms "
        f"{ratios['throughput_at_200ms']}× (target >= 0.8): "
        f"{'met' if met['throughput_at_200ms'] else 'MISSED'}"
    )
    audits = [fast_audit, slow_audit, alone_audit, hung_audit, trickle_audit]
    return {
        "throughput_0ms_per_s": round(fast_rate, 1),
        "throughput_200ms_per_s": round(slow_rate, 1),
        "tail_alone_ms": _summary(alone),
        "tail_beside_hanging_host_ms": _summary(hung),
        "tail_beside_trickling_host_ms": _summary(trickled),
        "ratios": ratios,
        "targets_met": met,
        "audits": audits,
        "exactly_once": all(a["exactly_once"] for a in audits),
    }


def _fmt(summary: dict) -> str:
    return f"p50 {summary['p50']:.0f} ms, p99 {summary['p99']:.0f} ms"

"""The bench's goal-operation phases: (b) goal operations end to end, at full rate, unloaded
and paced; (c) a duplicate storm; (e) more worker nodes and agent hosts."""

import random
import threading
import time
from collections import Counter

from ..simulator import SimControl
from ..stack import Stack, free_port
from .cpu import Phase
from .harness import Bench
from .stats import _exactly_once, _from_producers

STORM_COPIES = 5
# Unloaded latency: one goal operation at a time, its effect awaited at the simulator, which
# answers as soon as it has it (or after this long).
EFFECT_WAIT_S = 0.5


def goals_at_full_rate(bench: Bench) -> tuple[Phase, dict]:
    ws = f"bench-{bench.run_id}-max"
    submitted: dict[str, float] = {}

    def done() -> float:
        effects = bench.await_effects(ws, bench.n, "(b) goals applied")
        return max(e["at"] for e in effects)

    phase = bench.throughput(lambda i: bench.set_goal(ws, i, submitted), done)
    return phase, bench.audit(ws, submitted)


def goals_unloaded(bench: Bench, samples: int, label: str = "unloaded") -> tuple[list[float], dict]:
    ws = f"bench-{bench.run_id}-{label}"
    submitted: dict[str, float] = {}
    for i in range(samples):
        bench.set_goal(ws, i, submitted)
        # The simulator answers when the effect is in: asking it as often as the baseline
        # polls (UNLOADED_POLL_S) would take its time (and a core) from the call being timed.
        bench.wait("(b) unloaded", lambda: bench.applied(ws, EFFECT_WAIT_S), i + 1, poll_s=0)
    effects = bench.feed.goals(ws)
    latencies = [(e["at"] - submitted[e["operation_id"]]) * 1000 for e in effects]
    return latencies, bench.audit(ws, submitted)


def goals_at_rate(
    bench: Bench, rate_per_s: float, label: str = "paced"
) -> tuple[list[float], dict, Phase]:
    """The latencies at `rate_per_s`, the audit, and the CPU the operations cost: counted
    until they are done, not while the audit reads them (the baseline's has no audit)."""
    ws = f"bench-{bench.run_id}-{label}"
    ids: dict[int, str] = {}
    lock = threading.Lock()

    def send(i: int) -> None:
        op = bench.client.set_goal(ws, f"s{i}", f"objective {i}", client_submit_id="1")
        with lock:
            ids[i] = op.operation_id

    with bench.counted() as cost:
        sent = bench.paced(send, rate_per_s)
        effects = bench.await_effects(ws, bench.n, "(b) paced")
    submitted = {ids[i]: t for i, t in sent.items()}
    latencies = [(e["at"] - submitted[e["operation_id"]]) * 1000 for e in effects]
    return latencies, bench.audit(ws, submitted), cost


def duplicate_storm(bench: Bench) -> tuple[float, dict]:
    ws = f"bench-{bench.run_id}-storm"
    distinct = max(bench.n // STORM_COPIES, 1)
    calls = [i for i in range(distinct) for _ in range(STORM_COPIES)]
    random.Random(7).shuffle(calls)
    submitted: dict[str, float] = {}

    def submit(i: int) -> None:
        op = bench.client.set_goal(ws, f"s{i % 8}", f"objective {i}", client_submit_id=str(i))
        submitted.setdefault(op.operation_id, time.time())

    started = time.time()
    _from_producers(submit, calls)
    rate = len(calls) / (time.time() - started)
    # Per session only the newest revision is sure to reach the agent (newer submits
    # supersede older pending ones); the audit waits for every operation to settle.
    return rate, bench.audit(ws, submitted, allow_superseded=True)


def fleet(bench: Bench, stack: Stack, nodes: int, hosts: int) -> tuple[float, dict]:
    """(e) More worker nodes (2 processes each, beside the bench's worker) and more agent
    hosts (each a simulator of its own, registered and given an equal share of the
    sessions): the operations from the producer threads over a quarter as many
    sessions, until every one has settled; every effect must reach its session's host,
    each completed operation exactly once."""
    ws = f"bench-{bench.run_id}-fleet"
    controls = {"default": bench.sim}
    for i in range(1, hosts):
        host_id, url = f"bench-host-{i}", f"http://127.0.0.1:{free_port()}"
        stack.start_sim(host_id, url)
        # Its simulator was started with this process's settings: the same token.
        bench.client.add_host(host_id, url, token=bench.client.settings.runtime_token)
        controls[host_id] = SimControl(url, bench.settings.runtime_token)
        controls[host_id].defaults(continuation_turns=False)
    for i in range(1, nodes):
        stack.start_worker(concurrency=2, name=f"bench-node-{i + 1}")
    host_ids = list(controls)
    sessions = max(bench.n // 4, 1)
    for i in range(sessions):
        bench.client.ensure_session(ws, f"s{i}", host_id=host_ids[i % len(host_ids)])
    host_of: dict[str, str] = {}
    submitted: dict[str, float] = {}
    lock = threading.Lock()

    def submit(i: int) -> None:
        t = time.time()
        op = bench.client.set_goal(
            ws, f"s{i % sessions}", f"objective {i}", client_submit_id=str(i)
        )
        with lock:
            submitted[op.operation_id] = t
            host_of[op.operation_id] = host_ids[(i % sessions) % len(host_ids)]

    started = time.time()
    _from_producers(submit, range(bench.n))
    states = bench.settled_states(submitted)
    rate = bench.n / (time.time() - started)
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

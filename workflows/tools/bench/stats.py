"""What the benchmark's phases share: the producer threads, percentiles, and the exactly-once
audit of settled operations against the agents' effects."""

import statistics
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

# Producers submit from this many threads, as a service's request handlers would.
SUBMIT_THREADS = 4


def _from_producers(send: Callable[[Any], object], items: Iterable[Any]) -> None:
    """Call send(item) for every item from the SUBMIT_THREADS producer threads, as phase (b)
    and the baseline both send; returns when all are sent (a failure is raised)."""
    with ThreadPoolExecutor(SUBMIT_THREADS) as pool:
        list(pool.map(send, items))


def _percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(pct / 100 * len(ordered)) - 1))
    return ordered[index]


def _summary(latencies_ms: list[float]) -> dict:
    return {
        "p50": round(statistics.median(latencies_ms), 2),
        "p99": round(_percentile(latencies_ms, 99), 2),
    }


def _exactly_once(states: dict[str, str], per_op: Counter, allow_superseded: bool) -> dict:
    """The audit of settled operations (`states`: id -> status) against the agent's effects
    (`per_op`: id -> how many reached it). In a storm a newer submit may supersede an
    operation while its call is in flight: that one reached the agent once and ends
    superseded. Completed ones always did."""
    statuses = Counter(states.values())
    allowed = {"completed", "superseded"} if allow_superseded else {"completed"}
    completed = {op_id for op_id, status in states.items() if status == "completed"}
    return {
        "statuses": dict(statuses),
        "effects": sum(per_op.values()),
        "applied_twice": sum(1 for n in per_op.values() if n > 1),
        "unknown_effects": sum(1 for op_id in per_op if op_id not in states),
        "exactly_once": set(statuses) <= allowed
        and all(n == 1 for n in per_op.values())
        and not set(per_op) - set(states)
        and all(per_op.get(op_id) == 1 for op_id in completed),
    }

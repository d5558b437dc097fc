"""The bench's standard Celery baseline, (a): no-op tasks sent from the same producer threads
to the same workers, timed at full rate, unloaded and paced."""

import time

from .cpu import Phase
from .harness import Bench

# Unloaded latency: one no-op at a time, its completion polled this often (its count on the
# broker: one cheap command).
UNLOADED_POLL_S = 0.0005


def baseline_throughput(bench: Bench) -> Phase:
    tally = bench.tally()

    def done() -> float:
        bench.wait("(a) no-ops done", tally.count, bench.n)
        return max(tally.times().values())

    return bench.throughput(lambda i: bench.send_noop(tally, i), done)


def baseline_unloaded(bench: Bench, samples: int) -> list[float]:
    tally = bench.tally()
    sent: dict[int, float] = {}
    for i in range(samples):
        sent[i] = time.time()
        bench.send_noop(tally, i)
        bench.wait("(a) unloaded", tally.count, i + 1, UNLOADED_POLL_S)
    done = tally.times()
    return [(done[i] - sent[i]) * 1000 for i in sent]


def baseline_at_rate(bench: Bench, rate_per_s: float) -> list[float]:
    tally = bench.tally()
    sent = bench.paced(lambda i: bench.send_noop(tally, i), rate_per_s)
    bench.wait("(a) paced", tally.count, bench.n)
    done = tally.times()
    return [(done[i] - sent[i]) * 1000 for i in sent]

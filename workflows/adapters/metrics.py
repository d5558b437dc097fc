"""Worker-side metrics (docs/operations.md): runtime call latency and errors by host, call and code,
and dispatch batch sizes. A worker serves them with `agent-radar worker --metrics-port N`
(prometheus_client's multiprocess mode gathers its pool processes); the fleet gauges come from
`agent-radar metrics`, which reads the database. Labels are bounded: host, call, code."""

try:
    from prometheus_client import Counter, Gauge, Histogram
except ImportError:  # a plain client install (no `[server]` extra): nothing serves metrics

    class _Unserved:
        """A metric that is counted nowhere: the client process serves no metrics."""

        def __init__(self, *_args: object, **_kwargs: object) -> None:
            pass

        def labels(self, *_args: object, **_kwargs: object) -> "_Unserved":
            return self

        def observe(self, *_args: object) -> None:
            pass

        def inc(self, *_args: object) -> None:
            pass

        def set(self, *_args: object) -> None:
            pass

    Counter = Gauge = Histogram = _Unserved  # type: ignore[assignment,misc]

RUNTIME_CALL_SECONDS = Histogram(
    "agent_radar_runtime_call_seconds",
    "Runtime (agent host) call latency",
    ["host", "call"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
# Reports refused before anything was written (docs/protocol.md: reports): by the host the
# report names, as a label only if it is registered (else `unregistered`), and the refusal's
# code, so a host that sends bad reports shows in the worker's metrics.
REPORTS_REFUSED = Counter(
    "agent_radar_reports_refused",
    "Activity reports refused, by the registered host they name and the refusal's code",
    ["host", "code"],
)
RUNTIME_CALL_ERRORS = Counter(
    "agent_radar_runtime_call_errors",
    "Runtime (agent host) calls that failed, by error code",
    ["host", "call", "code"],
)
DISPATCH_BATCH_SIZE = Histogram(
    "agent_radar_dispatch_batch_size",
    "Goal operations claimed together in one dispatch step",
    buckets=(1, 2, 4, 8, 16, 32),
)
HOST_CIRCUIT_OPEN = Gauge(
    "agent_radar_host_circuit_open",
    "1 while a worker process skips calls to this host (its circuit breaker is open)",
    ["host"],
    multiprocess_mode="livemax",
)
HOST_CIRCUIT_OPENS = Counter(
    "agent_radar_host_circuit_opens",
    "Times a worker process opened this host's circuit breaker",
    ["host"],
)
# Every worker-side metric name as Prometheus exposes it (counters gain _total).
WORKER_METRICS = (
    "agent_radar_runtime_call_seconds",
    "agent_radar_runtime_call_errors_total",
    "agent_radar_dispatch_batch_size",
)
# Served once a host's circuit has opened in the process.
WORKER_CIRCUIT_METRICS = ("agent_radar_host_circuit_open", "agent_radar_host_circuit_opens_total")

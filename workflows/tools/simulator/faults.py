"""The faults set on the whole simulated host through `/sim/`: calls failed on purpose, their
latency, calls held until let go (a host that hangs) and answers trickled (one that trickles)."""

import math
import random
import threading
from dataclasses import dataclass

from .sessions import SimError

# How often a held call looks whether it was let go (a reset lets it go without a word).
HOLD_SLICE_S = 0.05


@dataclass
class Fault:
    call: str  # liveness, resume, goal or * for any
    status: int
    code: str
    remaining: int
    workspace_id: str | None = None
    session_id: str | None = None


def _latency(median_ms: int, p99_ms: int | None, draw: random.Random | None = None) -> float:
    """A call's latency: the median, or drawn (by `draw`, else at random) from a lognormal
    with this median and p99."""
    if not p99_ms or p99_ms <= median_ms or median_ms <= 0:
        return median_ms
    sigma = math.log(p99_ms / median_ms) / 2.326  # the 99th percentile's z
    return (draw or random).lognormvariate(math.log(median_ms), sigma)


class HostFaults:
    """The host's faults, read and set under the simulator's lock (`changed` is its
    condition: a held call waits on it)."""

    def __init__(self, changed: threading.Condition) -> None:
        self.changed = changed
        self.reset()

    def reset(self) -> None:
        self.failures: list[Fault] = []
        self.latency_ms: dict[str, int] = {}
        # A call's latency drawn per call (lognormal) for a median and a p99, if given.
        self.latency_p99_ms: dict[str, int] = {}
        # Calls whose latency is drawn per session id rather than per call: the same for a
        # session id whenever asked, so that two runs over the same session ids draw the same
        # latencies (the benchmark compares two such runs' tails).
        self.latency_per_session: set[str] = set()
        # Calls held until released (a host that hangs), and how slowly answers are
        # written (a byte every trickle_ms: a host that trickles).
        self.held: set[str] = set()
        self.holding = 0
        self.trickle_ms = 0

    def inject(self, call: str, ws: str, sid: str) -> None:
        """Fail this call if a fault set for it has calls left to fail."""
        for fault in self.failures:
            if (
                fault.remaining > 0
                and fault.call in (call, "*")
                and (fault.workspace_id in (None, ws))
                and fault.session_id in (None, sid)
            ):
                fault.remaining -= 1
                raise SimError(fault.status, fault.code)

    def delay_ms(self, call: str, sid: str) -> float:
        draw = random.Random(f"{call}/{sid}") if call in self.latency_per_session else None
        return _latency(self.latency_ms.get(call, 0), self.latency_p99_ms.get(call), draw)

    def wait_while_held(self, call: str) -> None:
        while call in self.held or "*" in self.held:
            self.holding += 1
            try:
                self.changed.wait(HOLD_SLICE_S)
            finally:
                self.holding -= 1

    def control(self, path: str, body: dict) -> dict | None:
        """A `/sim/` control call that sets a fault; None if the path is not one."""
        if path == "/sim/faults":
            self.failures.append(
                Fault(
                    call=body.get("call", "*"),
                    status=int(body.get("status", 503)),
                    code=body.get("error", "server_error"),
                    remaining=int(body.get("count", 1)),
                    workspace_id=body.get("workspace_id"),
                    session_id=body.get("session_id"),
                )
            )
            return {}
        if path == "/sim/faults/clear":
            # Every fault set so far stops failing calls (latency, holds and trickle stay).
            self.failures.clear()
            return {}
        if path == "/sim/latency":
            self.latency_ms[body["call"]] = int(body["ms"])
            if body.get("p99_ms"):
                self.latency_p99_ms[body["call"]] = int(body["p99_ms"])
            else:
                self.latency_p99_ms.pop(body["call"], None)
            if body.get("per_session"):
                self.latency_per_session.add(body["call"])
            else:
                self.latency_per_session.discard(body["call"])
            return {}
        if path == "/sim/hold":
            # {"call": name or "*", "hold": true|false}: calls wait until let go.
            (self.held.add if body.get("hold", True) else self.held.discard)(body["call"])
            self.changed.notify_all()
            return {"holding": self.holding}
        if path == "/sim/trickle":
            self.trickle_ms = int(body["ms"])
            return {}
        return None

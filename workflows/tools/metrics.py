"""`agent-radar metrics`: a Prometheus exporter that reads the database on every scrape
(docs/operations.md). It keeps no state, so several can run side by side.

Labels are bounded: kind, status, workspace — never a session, and only the workspaces with
the most operations have series of their own (`--top-workspaces`, 20 by default); the rest
are summed under `workspace="other"`, so 5,000 workspaces make no more series than 20. Every
gauge is read in one short read-only transaction.
"""

import math
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy.engine import Engine

from ...models.base import utcnow
from ...models.db import run_read
from ..kinds.fence import FenceStatus
from ..operators.counts import operation_counts
from .status import OVERDUE_S, fleet_facts

PREFIX = "agent_radar"
# Every metric the exporter serves (the alert rules and the dashboard may use only these).
METRICS = (
    f"{PREFIX}_operations",
    f"{PREFIX}_due_operations",
    f"{PREFIX}_overdue_operations",
    f"{PREFIX}_oldest_due_age_seconds",
    f"{PREFIX}_fences_pending",
    f"{PREFIX}_fences_waiting_on_turn",
    f"{PREFIX}_held_sessions",
    f"{PREFIX}_runs_in_recovery",
    f"{PREFIX}_sweeper_heartbeat_age_seconds",
    f"{PREFIX}_hosts_skipped",
    f"{PREFIX}_goals_diverged",
    f"{PREFIX}_goals_unknown",
    f"{PREFIX}_restores_out_of_budget",
    f"{PREFIX}_sessions_wedged",
    f"{PREFIX}_up",
)


# The workspaces with series of their own, by default; the rest are summed as OTHER.
TOP_WORKSPACES = 20
OTHER = "other"


def fold_workspaces(
    counts: dict[tuple[str, str, str], int], top: int
) -> dict[tuple[str, str, str], int]:
    """Counts by (kind, status, workspace), the workspaces past the `top` with the most
    operations (ties by name) summed under OTHER."""
    totals: dict[str, int] = {}
    for (_kind, _status, workspace), count in counts.items():
        totals[workspace] = totals.get(workspace, 0) + count
    kept = set(sorted(totals, key=lambda w: (-totals[w], w))[:top])
    folded: dict[tuple[str, str, str], int] = {}
    for (kind, status, workspace), count in counts.items():
        key = (kind, status, workspace if workspace in kept else OTHER)
        folded[key] = folded.get(key, 0) + count
    return folded


class FleetCollector(Collector):
    def __init__(self, engine: Engine, top_workspaces: int = TOP_WORKSPACES) -> None:
        self.engine = engine
        self.top_workspaces = top_workspaces

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            facts = run_read(self.engine, self._read)
        except Exception:  # noqa: BLE001 - a scrape must answer: the database is down
            yield GaugeMetricFamily(f"{PREFIX}_up", "1 if the database answered", value=0)
            return
        yield GaugeMetricFamily(f"{PREFIX}_up", "1 if the database answered", value=1)
        operations = GaugeMetricFamily(
            f"{PREFIX}_operations",
            "Operations by kind, status and workspace",
            labels=["kind", "status", "workspace"],
        )
        for (kind, status, workspace), count in sorted(facts["operations"].items()):
            operations.add_metric([kind, status, workspace], count)
        yield operations
        for name, text in (
            ("due_operations", "Goal operations due now that no worker holds"),
            ("overdue_operations", f"Due goal operations waiting over {OVERDUE_S} s"),
            ("oldest_due_age_seconds", "Age of the oldest due goal operation (0: none)"),
            ("fences_pending", "Fences not yet delivered"),
            ("fences_waiting_on_turn", "Fences waiting for the fenced turn to end"),
            ("held_sessions", "Sessions held by a live maintenance run"),
            ("runs_in_recovery", "Maintenance runs in recovery_required"),
            ("sweeper_heartbeat_age_seconds", "Seconds since a sweep finished (+Inf: never)"),
            ("hosts_skipped", "Hosts whose circuit breaker is open (their calls kept failing)"),
            ("goals_diverged", "Sessions whose host holds another goal than desired"),
            ("goals_unknown", "Sessions whose goal at the host is not known"),
            ("restores_out_of_budget", "Sessions whose restore ran out of budget"),
            (
                "sessions_wedged",
                "Sessions with a stale turn on record their host was not asked about",
            ),
        ):
            yield GaugeMetricFamily(f"{PREFIX}_{name}", text, value=facts[name])

    def _read(self, s) -> dict:
        """The gauges `status` shows (status.fleet_facts), and operations per workspace."""
        counts = operation_counts(s)
        fleet = fleet_facts(s, utcnow(), counts)
        heartbeat = fleet["sweeper_heartbeat_age_s"]
        return {
            "operations": fold_workspaces(counts, self.top_workspaces),
            "due_operations": fleet["due"],
            "overdue_operations": fleet["overdue"],
            "oldest_due_age_seconds": fleet["sweeper_lag_s"],
            "fences_pending": fleet["fences"].get(FenceStatus.PENDING, 0),
            "fences_waiting_on_turn": fleet["fences_waiting_on_a_turn"],
            "held_sessions": fleet["held_sessions"],
            "runs_in_recovery": fleet["sessions_in_recovery"],
            "sweeper_heartbeat_age_seconds": math.inf if heartbeat is None else heartbeat,
            "hosts_skipped": len(fleet["hosts_skipped"]),
            "goals_diverged": fleet["goals_diverged"],
            "goals_unknown": fleet["goals_unknown"],
            "restores_out_of_budget": fleet["restores_out_of_budget"],
            "sessions_wedged": fleet["wedged_sessions"],
        }

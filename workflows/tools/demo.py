"""`agent-radar demo` (what `make run` runs): a fresh embedded stack and a scripted scenario.

Every step prints one timeline line; the end checks from the database and the simulator's
effect list that nothing was lost and nothing reached the agent twice.
"""

import json
import tempfile
import time
from collections import Counter
from pathlib import Path

from ..adapters.config import Settings
from ..client import AgentRadar
from ..errors import AgentRadarError
from ..escape import escape
from .demo_steps import (
    WS,
    goals_and_replay,
    host_restart,
    maintenance_and_prompts,
    offline_fence,
    outage_and_crash,
    second_host,
    shared_goal_fences,
)
from .simulator import SimControl
from .stack import Stack, free_port

# Short leases so that recovery after the killed worker shows within seconds.
DEMO_LEASE_S = 4.0
DEMO_RUNTIME_TIMEOUT_S = 3.0
DEMO_SWEEP_INTERVAL_S = 1.0


class Timeline:
    def __init__(self, quiet: bool) -> None:
        self.start = time.monotonic()
        self.quiet = quiet
        self.lines: list[dict] = []

    def __call__(self, what: str, **facts) -> None:
        elapsed = time.monotonic() - self.start
        self.lines.append({"t_s": round(elapsed, 2), "event": what, **facts})
        if not self.quiet:
            detail = "  ".join(f"{k}={v}" for k, v in facts.items())
            # Facts carry ids and errors (an agent host's answer): the line is escaped.
            line = f"[{elapsed:6.2f}s] {what}" + (f"  ({detail})" if detail else "")
            print(escape(line), flush=True)


def run_demo(home: Path | None = None, as_json: bool = False) -> bool:
    home = home or Path(tempfile.mkdtemp(prefix="agent-radar-demo-"))
    settings = Settings(
        home=home.resolve(),
        database_url=f"sqlite:///{home.resolve() / 'demo.db'}",
        broker_url="filesystem://",
        runtime_url=f"http://127.0.0.1:{free_port()}",
        sweep_interval_s=DEMO_SWEEP_INTERVAL_S,
        lease_s=DEMO_LEASE_S,
        runtime_timeout_s=DEMO_RUNTIME_TIMEOUT_S,
    )
    say = Timeline(quiet=as_json)
    stack = Stack(settings)
    ok = False
    try:
        say("starting the embedded stack", home=str(settings.home))
        stack.prepare()
        stack.start_sim()
        worker = stack.start_worker(concurrency=2, name="worker-1")
        stack.start_beat()
        say(
            "stack up: runtime-sim, worker (2 processes), beat",
            database="SQLite (WAL)",
            broker="filesystem",
        )
        ok = _scenario(
            AgentRadar(settings=settings),
            SimControl(settings.runtime_url, settings.runtime_token),
            stack,
            worker,
            say,
        )
    except (AgentRadarError, TimeoutError, RuntimeError, AssertionError) as exc:
        say("demo failed", error=f"{exc.__class__.__name__}: {exc}")
    finally:
        say("stopping everything")
        started = [p.pid for p in stack.procs]
        stack.stop()
    say("done" if ok else "done, with failures", logs=str(stack.log_dir))
    if as_json:
        print(
            json.dumps(
                {"ok": ok, "home": str(home), "timeline": say.lines, "process_groups": started}
            )
        )
    return ok


def _scenario(client: AgentRadar, sim: SimControl, stack: Stack, worker, say) -> bool:
    """Every step runs (each prints its part of the timeline); the demo passes if all did."""
    results = [
        goals_and_replay(client, say),
        outage_and_crash(client, sim, stack, worker, say),
        shared_goal_fences(client, say),
        offline_fence(client, sim, say),
        host_restart(client, sim, say),
        second_host(client, stack, say),
        maintenance_and_prompts(client, sim, say),
        _audit(client, sim, say),
        _tooling(client, say),
    ]
    return all(results)


def _tooling(client: AgentRadar, say) -> bool:
    # 11. what an operator sees: `agent-radar status` and `agent-radar metrics`
    from .metrics import FleetCollector
    from .status import fleet_status, problems

    status = fleet_status(client.engine)
    found = problems(status, client.settings.sweep_interval_s)
    say(
        "agent-radar status",
        goal_operations=status["goal_operations"],
        fences=status["fences"],
        maintenance=status["maintenance_runs"],
        prompts=status["prompts"],
        last_sweep_s_ago=status["sweeper_heartbeat_age_s"],
        problems=found or "none",
    )
    gauges = {
        family.name: sum(sample.value for sample in family.samples)
        for family in FleetCollector(client.engine).collect()
    }
    say(
        "agent-radar metrics (Prometheus)",
        up=gauges["agent_radar_up"],
        operations=gauges["agent_radar_operations"],
        overdue=gauges["agent_radar_overdue_operations"],
        runs_in_recovery=gauges["agent_radar_runs_in_recovery"],
        sweeper_heartbeat_age_s=round(gauges["agent_radar_sweeper_heartbeat_age_seconds"], 2),
    )
    return not found


def _audit(client: AgentRadar, sim: SimControl, say) -> bool:
    # 10. the audit: every operation applied at most once
    effects = sim.effects()
    per_op = Counter(e["operation_id"] for e in effects)
    say(
        "agent effects",
        total=len(effects),
        operations=len(per_op),
        applied_twice=sum(1 for n in per_op.values() if n > 1),
    )
    for sid in ("session-a", "session-b", "session-c", "session-d", "session-e", "session-f"):
        s = client.goal_state(WS, sid)
        say(
            f"goal state {sid}",
            revision=s.revision,
            sync=s.sync_status,
            desired=(s.desired or {}).get("objective"),
        )
    # a (set, clear), b, c, d (shared, owner), e (shared, clear by the fence), f (set, and
    # the fence's clear once it was back), r (shared, owner), m (shared, clear by the fence;
    # its next goal went to host-b)
    return all(n == 1 for n in per_op.values()) and len(per_op) == 14

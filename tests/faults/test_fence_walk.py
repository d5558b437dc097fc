"""A fenced generation never runs again, whatever order the network, the hosts and the messages take
(docs/lifecycles.md: fences, sessions): seeded random walks over a fleet of two agent hosts (real
simulators over HTTP) and the product's own task code, on a real database.

The walk holds the messages the product publishes and the reports the hosts send, and
delivers, delays, reorders or loses them at random, between host faults — a drop, a
reconnect, a restart, a move to the other host — and client calls — set goals, fence
them, stop sessions, ensure them. Two invariants:
- after every step: no goal call of a fenced (operation, revision) reached a host after its
  fence was accepted, and every resume after it carried it;
- once the faults are gone and the work has settled (every host reachable, the messages
  delivered, the sweeper run), no host has a fenced generation applied, a turn of one
  running, or a fence missing.

`make fuzz` runs AGENT_RADAR_WALK_SCHEDULES schedules per backend (default 2000); CI a few.
A failing schedule names its seed (AGENT_RADAR_WALK_SEED replays it; WALK_DEBUG=1 prints the
rows and the calls each host saw).
"""

import os
import random
import time
from datetime import timedelta

from sqlalchemy import select

from agent_radar.beat.sweeper import REPUBLISH_INTERVAL_S, sweep_once
from agent_radar.models.base import utcnow
from agent_radar.models.db import run_transaction
from agent_radar.models.tables import GoalFence, GoalOperation
from agent_radar.workflows.adapters.publisher import TaskPublisher
from agent_radar.workflows.client import AgentRadar
from agent_radar.workflows.errors import AgentRadarError
from agent_radar.workflows.steps.cancel import CancelRunner
from agent_radar.workflows.steps.fence_apply import FenceApplier
from agent_radar.workflows.steps.goals.dispatch import Dispatcher
from agent_radar.workflows.steps.restore import Restorer
from agent_radar.workflows.tools.simulator import SimControl
from tests.conftest import free_port
from tests.helpers import QuickStopSimServer

SCHEDULES = int(os.environ.get("AGENT_RADAR_WALK_SCHEDULES") or 3)
STEPS = int(os.environ.get("AGENT_RADAR_WALK_STEPS") or 30)
WS = "ws-walk"
SESSIONS = ("w1", "w2")
LEASE_S = 0.3
# How far ahead the settling sweeps look: past the schedule's own sweeps (60 s ahead) and
# their reservations, growing each round, and well inside the 10 minutes of the budgets.
SETTLE_AHEAD_S = 90.0
SETTLE_AHEAD_MAX_S = 400.0


class Outbox(TaskPublisher):
    """The product's publisher with the broker replaced by a list the walk delivers from."""

    def __init__(self, settings, messages: list) -> None:
        super().__init__(settings)
        self.messages = messages

    def publish(self, task_name, kwargs=None, queue=None, label=None) -> str:
        self.messages.append((task_name, dict(kwargs or {})))
        return "walk"


class Fleet:
    def __init__(self, settings, rng: random.Random) -> None:
        self.rng = rng
        self.messages: list[tuple[str, dict]] = []

        def report(r):
            self.messages.append(("agent_radar.report_activity", {"report": r}))

        port = int(settings.runtime_url.rsplit(":", 1)[1])
        self.servers = {
            "default": QuickStopSimServer("127.0.0.1", port, reporter=report).start(),
            "host-b": QuickStopSimServer(
                "127.0.0.1", free_port(), reporter=report, host_id="host-b"
            ).start(),
        }
        self.control = {h: SimControl(s.url) for h, s in self.servers.items()}
        for control in self.control.values():
            # Turns run until they are cancelled: nothing settles on a timer.
            control.defaults(turn_duration_ms=0)
        self.publisher = Outbox(settings, self.messages)
        self.client = AgentRadar(settings=settings, publisher=self.publisher)
        self.client.add_host("host-b", self.servers["host-b"].url)
        engine, runtime = self.client.engine, self.client.runtime
        publish = lambda task, kwargs: self.messages.append((task, dict(kwargs))) or True  # noqa: E731
        common = {"worker_id": "walk", "lease_s": LEASE_S, "publish": publish}
        self.fences = FenceApplier(engine, runtime, **common)
        self.cancels = CancelRunner(engine, runtime, **common)
        self.restorer = Restorer(engine, runtime, cancels=self.cancels)
        self.dispatcher = Dispatcher(
            engine,
            runtime,
            worker_id="walk",
            lease_s=LEASE_S,
            resume_session=lambda ws, sid: self.client.ensure_session(ws, sid),
        )
        self.host_of = dict.fromkeys(SESSIONS, "default")
        self.submits = 0

    def close(self) -> None:
        self.client.close()
        for server in self.servers.values():
            server.stop()

    # -- the product's tasks, as a worker runs them -----------------------------------------
    def run(self, task: str, kwargs: dict) -> None:
        try:
            if task == "agent_radar.goal.dispatch":
                wanted = kwargs.get("operation_ids") or [kwargs["operation_id"]]
                self.dispatcher.dispatch_many(wanted, steal=True)
            elif task == "agent_radar.fence.apply":
                self.fences.apply(kwargs["fence_id"])
            elif task == "agent_radar.cancel.apply":
                self.cancels.apply(kwargs["operation_id"])
            elif task == "agent_radar.session.restore":
                self.restorer.restore(kwargs["workspace_id"], kwargs["session_id"])
            elif task == "agent_radar.report_activity":
                self.client.report_activity(kwargs["report"])
            # prompts, maintenance: none in this walk
        except AgentRadarError:
            pass  # a refused message (a report naming a host the session left)

    def deliver(self, index: int) -> None:
        task, kwargs = self.messages.pop(index)
        self.run(task, kwargs)

    def sweep(self, ahead_s: float) -> None:
        publish = lambda task, kwargs: self.messages.append((task, dict(kwargs))) or True  # noqa: E731
        sweep_once(
            self.client.engine,
            publish,
            utcnow() + timedelta(seconds=ahead_s),
            owner="walk",
            lease_s=LEASE_S,
        )

    # -- what hosts and clients do -------------------------------------------------------------
    def host_report(self, sid: str) -> None:
        host = self.host_of[sid]
        self.servers[host].sim.report(
            {"workspace_id": WS, "session_id": sid, "occurred_at_ms": int(time.time() * 1000)}
        )

    def step(self) -> str:
        sid = self.rng.choice(SESSIONS)
        host = self.host_of[sid]
        control = self.control[host]
        kind = self.rng.choices(
            [
                "deliver",
                "lose",
                "set",
                "fence",
                "drop",
                "reconnect",
                "restart",
                "move",
                "stop",
                "ensure",
                "sweep",
            ],
            weights=[40, 3, 8, 8, 5, 5, 3, 2, 2, 2, 6],
        )[0]
        if kind == "deliver" and self.messages:
            # Any message, not the oldest: the broker and the workers reorder.
            self.deliver(self.rng.randrange(len(self.messages)))
        elif kind == "lose" and (ours := self.losable()):
            # A message of the product's is lost (its row is the outbox); a host's report
            # is late at worst: the broker has it once the host's publish was confirmed.
            self.messages.pop(self.rng.choice(ours))
        elif kind == "set":
            self.submits += 1
            self.client.set_goal(
                WS, sid, f"goal {self.submits}", client_submit_id=f"g{self.submits}"
            )
            self.publisher.flush()
        elif kind == "fence":
            targets = self.unfenced_sets(sid)
            if targets:
                self.submits += 1
                self.client.fence_goal_generation(
                    WS, sid, self.rng.choice(targets), client_submit_id=f"f{self.submits}"
                )
        elif kind == "drop":
            control.session(WS, sid, live=False)  # the network drops: same process
        elif kind == "reconnect":
            control.session(WS, sid, live=True)
            self.host_report(sid)
        elif kind == "restart":
            control.session(WS, sid, restart=True, live=True)
            self.host_report(sid)
        elif kind == "move":
            # The session leaves its host for the other one, which an operator names.
            other = "host-b" if host == "default" else "default"
            # It arrives there anew: nothing of an earlier stay at that host.
            self.control[other].session(WS, sid, fresh=True)
            try:
                self.client.ensure_session(WS, sid, host_id=other)
            except AgentRadarError:
                pass  # the move is durable even when the call to the new host failed
            if self.client.session_info(WS, sid).host_id == other:
                control.session(WS, sid, missing=True)
                self.control[other].session(WS, sid, missing=False)
                self.host_of[sid] = other
        elif kind == "stop":
            self.submits += 1
            self.client.stop_session(WS, sid, client_submit_id=f"s{self.submits}")
        elif kind == "ensure":
            try:
                self.client.ensure_session(WS, sid)
            except AgentRadarError:
                pass
        elif kind == "sweep":
            self.sweep(self.rng.choice([0.0, 5.0, 60.0]))
        return kind

    def losable(self) -> list[int]:
        return [
            i
            for i, (task, _kw) in enumerate(self.messages)
            if task != "agent_radar.report_activity"
        ]

    def unfenced_sets(self, sid: str) -> list[str]:
        def read(s):
            fenced = select(GoalFence.target_operation_id)
            return list(
                s.scalars(
                    select(GoalOperation.operation_id).where(
                        GoalOperation.workspace_id == WS,
                        GoalOperation.session_id == sid,
                        GoalOperation.action == "set",
                        GoalOperation.operation_id.not_in(fenced),
                    )
                )
            )

        return run_transaction(self.client.engine, read)

    # -- the invariants -------------------------------------------------------------------------
    def fences_now(self) -> dict[tuple[str, int], tuple[str, float]]:
        """(target operation, revision) -> (session, accepted at, epoch seconds)."""
        rows = run_transaction(
            self.client.engine,
            lambda s: s.execute(
                select(
                    GoalFence.target_operation_id,
                    GoalFence.target_revision,
                    GoalFence.session_id,
                    GoalFence.created_at,
                )
            ).all(),
        )
        return {(op, rev): (sid, at.timestamp()) for op, rev, sid, at in rows}

    def check_no_fenced_call(self, fences) -> None:
        for host, control in self.control.items():
            for effect in control.effects(kind=None):
                if effect["kind"] == "goal":
                    fence = fences.get((effect["operation_id"], effect["revision"]))
                    assert fence is None or effect["at"] < fence[1], (host, effect, fence)
                elif effect["kind"] == "resume":
                    carried = {
                        (f["target_operation_id"], f["target_revision"]) for f in effect["fences"]
                    }
                    for key, (sid, _at) in fences.items():
                        if sid == effect["session_id"] and _at < effect.get("at", float("inf")):
                            assert key in carried, (host, effect, key)

    def settle(self) -> None:
        """The faults are gone: every session reachable at its host, which reports; every
        message delivered and the sweeper run until nothing is left to do."""
        for sid in SESSIONS:
            self.control[self.host_of[sid]].session(WS, sid, live=True, missing=False)
            self.host_report(sid)
        quiet, ahead = 0, SETTLE_AHEAD_S
        deadline = time.monotonic() + 120
        while quiet < 3:
            assert time.monotonic() < deadline, f"the work never settled: {self.messages[:5]}"
            if self.messages:
                quiet = 0
                while self.messages:
                    self.deliver(0)
                continue
            time.sleep(LEASE_S)  # leases and waits run out; timers of the hosts fire
            # Far enough ahead for every retry and wait to be due, and past what an earlier
            # sweep reserved (its own now + REPUBLISH_INTERVAL_S) when that message was lost;
            # not so far that the budgets (10 minutes of failing) run out on a clock that
            # jumped.
            self.sweep(ahead)
            ahead = min(ahead + REPUBLISH_INTERVAL_S + 1, SETTLE_AHEAD_MAX_S)
            quiet = quiet + 1 if not self.messages else 0

    def check_settled(self, fences) -> None:
        for sid in SESSIONS:
            host = self.host_of[sid]
            at_host = self.control[host].session(WS, sid)
            mine = {key for key, (fsid, _at) in fences.items() if fsid == sid}
            installed = {tuple(f) for f in at_host["fences"]}
            assert mine <= installed, (sid, host, mine - installed)
            applied = self.applied_generation(host, sid, at_host)
            assert applied not in mine, (sid, host, "fenced generation applied", applied)
            for turn_id, turn in at_host["turns"].items():
                key = (turn["source_goal_operation_id"], turn["source_goal_revision"])
                assert not (turn["phase"] != "settled" and key in mine), (sid, host, turn_id, turn)

    def applied_generation(self, host: str, sid: str, at_host: dict):
        if at_host["goal"] is None:
            return None
        for effect in reversed(self.control[host].effects()):
            if effect["session_id"] == sid and effect["revision"] == at_host["applied_revision"]:
                return (effect["operation_id"], effect["revision"])
        return None


def test_random_schedules_never_leave_a_fenced_generation_alive(settings, backend):
    from tests.conftest import _empty_pg  # noqa: PLC0415 - each schedule starts empty

    base = int(os.environ.get("AGENT_RADAR_WALK_SEED") or 1)
    for schedule in range(SCHEDULES):
        seed = base + schedule
        if schedule and settings.database_url.startswith("postgresql"):
            _empty_pg(settings.database_url)
        elif schedule:
            _empty_sqlite(settings)
        rng = random.Random(seed)
        fleet = Fleet(settings, rng)
        steps: list[str] = []
        try:
            for _ in range(STEPS):
                steps.append(fleet.step())
                fleet.check_no_fenced_call(fleet.fences_now())
            fleet.settle()
            fences = fleet.fences_now()
            fleet.check_no_fenced_call(fences)
            fleet.check_settled(fences)
        except AssertionError as exc:
            if os.environ.get("WALK_DEBUG"):
                from agent_radar.models.tables import CancelOperation, Turn

                def dump(s):
                    for t in (Turn, CancelOperation, GoalFence):
                        for r in s.scalars(select(t)):
                            print(
                                t.__name__,
                                {k: v for k, v in vars(r).items() if not k.startswith("_")},
                            )

                run_transaction(fleet.client.engine, dump)
                for h, c in fleet.control.items():
                    print(h, [(x["call"], x["session_id"]) for x in c.calls()])
            raise AssertionError(f"schedule seed {seed}, steps {steps}: {exc}") from None
        finally:
            fleet.close()
        if (schedule + 1) % 100 == 0:
            print(f"fence walk [{backend}]: {schedule + 1} schedules, none failed", flush=True)


def _empty_sqlite(settings) -> None:
    from sqlalchemy import delete

    from agent_radar.models.base import Base
    from agent_radar.models.db import engine_for

    engine = engine_for(settings.database_url)
    with engine.begin() as conn:
        for table in reversed(Base.metadata.sorted_tables):
            if table.name != "alembic_version":
                conn.execute(delete(table))

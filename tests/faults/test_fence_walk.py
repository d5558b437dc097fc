"""A fenced generation never runs again, whatever order the network, the hosts and the messages take
(docs/lifecycles.md: fences, sessions): seeded random walks over a fleet of two agent hosts (real
simulators over HTTP) and the product's own task code, on a real database.

The walk holds the messages the product publishes and the reports the hosts send, and
delivers, delays, reorders or loses them at random, between host faults — a drop, a
reconnect (with a report or silent), a restart (the host keeps its durable goal), a move to
the other host and back (the old host losing the session, or running on) — and client calls —
set goals, fence them, start maintenance, stop sessions, ensure them. Reports are signed by
their host; the walk also loses and duplicates them, and forges some (unsigned, signed with a
guessed token, changed after signing). Half the schedules' hosts number their turns from 1 in
each process, so turn ids come again. The invariants:
- after every step: no goal call of a fenced (operation, revision) reached a host after its
  fence was accepted, every resume after it carried it, and no host runs two maintenance
  runs of one session at once;
- once the faults are gone and the work has settled (every host reachable, the messages
  delivered, the sweeper run, also past its reconcile interval), no host has a fenced
  generation applied, a turn of one running, or a fence missing; no host runs two runs of a
  session; and no session is wedged: every turn on record as unsettled runs at its host.

`make fuzz` runs AGENT_RADAR_WALK_SCHEDULES schedules per backend (default 2000); CI a few.
A failing schedule names its seed (AGENT_RADAR_WALK_SEED replays it; WALK_DEBUG=1 prints the
rows and the calls each host saw).
"""

import os
import random
import time
from dataclasses import replace
from datetime import timedelta

from sqlalchemy import select

from agent_radar.beat.sweeper import REPUBLISH_INTERVAL_S, sweep_once
from agent_radar.models.base import utcnow
from agent_radar.models.db import run_transaction
from agent_radar.models.operations import GoalFence, GoalOperation
from agent_radar.models.tables import Turn
from agent_radar.workflows.activity.reconcile import RECONCILE_INTERVAL_S, STALE_TURN_S
from agent_radar.workflows.adapters import report_auth
from agent_radar.workflows.adapters.publisher import TaskPublisher
from agent_radar.workflows.client import AgentRadar
from agent_radar.workflows.errors import AgentRadarError
from agent_radar.workflows.steps.cancel import CancelRunner
from agent_radar.workflows.steps.fence_apply import FenceApplier
from agent_radar.workflows.steps.goals.dispatch import Dispatcher
from agent_radar.workflows.steps.maintenance import MaintenanceExecutor
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
SETTLE_AHEAD_MAX_S = RECONCILE_INTERVAL_S - 10


class Outbox(TaskPublisher):
    """The product's publisher with the broker replaced by a list the walk delivers from."""

    def __init__(self, settings, messages: list) -> None:
        super().__init__(settings)
        self.messages = messages

    def publish(self, task_name, kwargs=None, queue=None, label=None) -> str:
        self.messages.append((task_name, dict(kwargs or {})))
        return "walk"


# Each host signs its reports with its own token (docs/protocol.md: signing a report).
TOKENS = {"default": "walk-default-token", "host-b": "walk-b-token"}


class Fleet:
    def __init__(self, settings, rng: random.Random) -> None:
        self.rng = rng
        self.messages: list[tuple[str, dict]] = []

        def report(r):
            self.messages.append(("agent_radar.report_activity", {"report": r}))

        port = int(settings.runtime_url.rsplit(":", 1)[1])
        self.servers = {
            "default": QuickStopSimServer(
                "127.0.0.1", port, reporter=report, token=TOKENS["default"]
            ).start(),
            "host-b": QuickStopSimServer(
                "127.0.0.1", free_port(), reporter=report, host_id="host-b", token=TOKENS["host-b"]
            ).start(),
        }
        self.control = {h: SimControl(s.url, token=TOKENS[h]) for h, s in self.servers.items()}
        # Some schedules' hosts number their turns from 1 in each process: ids come again.
        numbered = rng.random() < 0.5
        for control in self.control.values():
            # Turns run until they are cancelled: nothing settles on a timer.
            control.defaults(
                turn_duration_ms=0, numbered_turns=numbered, maintenance_duration_ms=150
            )
        self.publisher = Outbox(settings, self.messages)
        settings = replace(settings, runtime_token=TOKENS["default"])
        self.client = AgentRadar(settings=settings, publisher=self.publisher)
        self.client.add_host("host-b", self.servers["host-b"].url, token=TOKENS["host-b"])
        engine, runtime = self.client.engine, self.client.runtime
        publish = lambda task, kwargs: self.messages.append((task, dict(kwargs))) or True  # noqa: E731
        common = {"worker_id": "walk", "lease_s": LEASE_S, "publish": publish}
        self.fences = FenceApplier(engine, runtime, **common)
        self.cancels = CancelRunner(engine, runtime, **common)
        self.restorer = Restorer(engine, runtime, cancels=self.cancels)
        self.executor = MaintenanceExecutor(engine, runtime, **common, poll_s=0.01, max_wait_s=0.03)
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
                self.dispatcher.dispatch_many(wanted)
            elif task == "agent_radar.fence.apply":
                self.fences.apply(kwargs["fence_id"])
            elif task == "agent_radar.cancel.apply":
                self.cancels.apply(kwargs["operation_id"])
            elif task == "agent_radar.session.restore":
                self.restorer.restore(kwargs["workspace_id"], kwargs["session_id"])
            elif task == "agent_radar.report_activity":
                # As the task receives it: signed by the session's host, or refused.
                self.client.receive_report(kwargs["report"])
            elif task == "agent_radar.maintenance.execute":
                self.executor.execute(kwargs["run_id"])
            # prompts: none in this walk
        except AgentRadarError:
            pass  # a refused message (a forged report, one of a host the session left)

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
        self.servers[host].sim.send_report(
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
                "lose report",
                "duplicate",
                "forge",
                "set",
                "fence",
                "maintenance",
                "drop",
                "reconnect",
                "silent reconnect",
                "restart",
                "move",
                "stop",
                "ensure",
                "sweep",
            ],
            weights=[40, 3, 2, 2, 2, 8, 8, 3, 5, 3, 2, 3, 3, 2, 2, 6],
        )[0]
        if kind == "deliver" and self.messages:
            # Any message, not the oldest: the broker and the workers reorder.
            self.deliver(self.rng.randrange(len(self.messages)))
        elif kind == "lose" and (ours := self.losable()):
            # A message of the product's is lost (its row is the outbox); a host's report
            # is late at worst: the broker has it once the host's publish was confirmed.
            self.messages.pop(self.rng.choice(ours))
        elif kind == "lose report" and (reports := self.reports()):
            self.messages.pop(self.rng.choice(reports))  # the broker lost it
        elif kind == "duplicate" and self.messages:
            self.messages.append(self.rng.choice(self.messages))  # delivered twice
        elif kind == "forge":
            self.messages.append(("agent_radar.report_activity", {"report": self.forged(sid)}))
        elif kind == "maintenance":
            self.submits += 1
            try:
                self.client.start_maintenance(WS, sid, client_submit_id=f"m{self.submits}")
            except AgentRadarError:
                pass  # busy, held, draining: refused, nothing written
            self.client.flush()
        elif kind == "set":
            self.submits += 1
            self.client.set_goal(
                WS, sid, f"goal {self.submits}", client_submit_id=f"g{self.submits}"
            )
            self.client.flush()
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
        elif kind == "silent reconnect":
            control.session(WS, sid, live=True)  # back, and it tells nobody
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
                if self.rng.random() < 0.5:
                    # The old host lost the session; else its process runs on there, and
                    # what it ran is stopped by the move's cancels.
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

    def reports(self) -> list[int]:
        return [
            i
            for i, (task, _kw) in enumerate(self.messages)
            if task == "agent_radar.report_activity"
        ]

    def forged(self, sid: str) -> dict:
        """A report no host signed: a turn of a random generation running or settled, a goal
        applied, another host, an epoch, with a signature that is missing, made with a
        guessed token, or the real one's over another body."""
        ops = run_transaction(
            self.client.engine,
            lambda s: list(
                s.scalars(select(GoalOperation.operation_id).where(GoalOperation.session_id == sid))
            ),
        )
        op = self.rng.choice(ops) if ops else "no-such-operation"
        body = {
            "workspace_id": WS,
            "session_id": sid,
            "occurred_at_ms": int(time.time() * 1000),
            "session": {
                "host_id": self.rng.choice(list(TOKENS)),
                "live": self.rng.random() < 0.5,
                "runtime_epoch": self.rng.randrange(1, 10),
            },
        }
        if self.rng.random() < 0.5:
            body["turn"] = {
                "turn_id": f"turn-{self.rng.randrange(1, 4)}",
                "phase": self.rng.choice(["running", "settled"]),
                "outcome": "completed",
                "origin": "goal_continuation",
                "source_goal_operation_id": op,
                "source_goal_revision": self.rng.randrange(1, 4),
            }
        else:
            body["goal_applied"] = {"operation_id": op, "revision": 1, "goal": None}
        how = self.rng.choice(["unsigned", "guessed", "moved"])
        if how == "unsigned":
            return body
        host = body["session"]["host_id"]
        if how == "guessed":
            return report_auth.sign(body, host, "guessed-token")
        signed = report_auth.sign(body, host, TOKENS[host])
        return {**signed, "occurred_at_ms": signed["occurred_at_ms"] + 1}  # changed after

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

    def check_one_run_per_host(self) -> None:
        """Never two maintenance runs of one session at a host."""
        for host, control in self.control.items():
            for sid in SESSIONS:
                runs = control.session(WS, sid)["runs"]
                running = [run_id for run_id, run in runs.items() if run["running"]]
                assert len(running) <= 1, (host, sid, "two runs at once", running)

    def check_not_wedged(self) -> None:
        """Once the faults are gone: every turn on record as unsettled runs at the session's
        host (the mirror holds none the host does not), and so does its active turn."""
        for sid in SESSIONS:
            at_host = self.control[self.host_of[sid]].session(WS, sid)
            running = {t for t, turn in at_host["turns"].items() if turn["phase"] != "settled"}

            def read(s, sid=sid):
                return [
                    (t.host_turn_id or t.turn_id, t.host_id)
                    for t in s.scalars(
                        select(Turn).where(
                            Turn.workspace_id == WS,
                            Turn.session_id == sid,
                            Turn.phase != "settled",
                        )
                    )
                ]

            for turn_id, host in run_transaction(self.client.engine, read):
                assert host == self.host_of[sid] and turn_id in running, (
                    sid,
                    "wedged: a turn on record the host does not run",
                    turn_id,
                    host,
                    running,
                )

    def settle(self) -> None:
        """The faults are gone: every session reachable at its host, which reports; every
        message delivered and the sweeper run until nothing is left to do."""
        for sid in SESSIONS:
            for host, control in self.control.items():
                # Reachable everywhere: a host the session left, and still runs, too.
                control.session(
                    WS, sid, live=True, **({"missing": False} if host == self.host_of[sid] else {})
                )
            self.host_report(sid)
        deadline = time.monotonic() + 120
        self._settle_from(deadline)
        # One sweep past the reconcile interval: the sweeper asks the hosts about what the
        # record may hold wrongly (a lost report), as it does in time; then the rest settles.
        # (Sweeps further ahead would ask again and again: each look is stamped with the
        # real clock.)
        self.sweep(RECONCILE_INTERVAL_S + STALE_TURN_S + 1)
        self._settle_from(deadline)

    def _settle_from(self, deadline: float) -> None:
        quiet, ahead = 0, SETTLE_AHEAD_S
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
                fleet.check_one_run_per_host()
            fleet.settle()
            fences = fleet.fences_now()
            fleet.check_no_fenced_call(fences)
            fleet.check_settled(fences)
            fleet.check_one_run_per_host()
            fleet.check_not_wedged()
        except AssertionError as exc:
            if os.environ.get("WALK_DEBUG"):
                from agent_radar.models.operations import CancelOperation
                from agent_radar.models.tables import Turn

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

"""The load of the failover test (test_pg_failover.py) and its audit: goal submissions from
producer threads, each sent twice with one client submit ID, and what the promoted database
and the agent hold afterwards."""

import threading
import time
from collections import Counter, defaultdict

from sqlalchemy import select, text
from sqlalchemy.exc import DBAPIError

from agent_radar.models.db import run_read
from agent_radar.models.operations import GoalOperation as GoalOperationRow
from agent_radar.workflows.client import AgentRadar
from agent_radar.workflows.kinds.goal import TERMINAL_OPERATION_STATUSES, GoalOperation
from agent_radar.workflows.tools.bench.harness import EffectFeed
from tests.helpers import eventually

# Producer threads, as a service's request handlers would submit (the bench's number).
THREADS = 4
# Each submission is sent again this many submissions later by its thread: the second send
# of those sent just before the primary's loss reaches the promoted database.
RESEND_LAG = 10
# How often the test fetches the simulator's new effects.
EFFECTS_POLL_S = 0.5
# Long past the promise (60 s after the promotion), so that a failure reports what is left.
SETTLE_TIMEOUT_S = 300.0


class Load:
    """`submissions` goal operations over `sessions` sessions from THREADS threads, at most
    `rate_per_s` a second (as clients would send them, and so that the faults of a run fall
    within its load). A send the client could not get accepted (a database error through all
    its retries) is refused; `accepted` holds each submission's first acceptance."""

    def __init__(
        self, client: AgentRadar, ws: str, submissions: int, sessions: int, rate_per_s: float
    ) -> None:
        self.client, self.ws = client, ws
        self.submissions, self.sessions = submissions, sessions
        self.interval_s = 1 / rate_per_s
        self.accepted: dict[int, GoalOperation] = {}
        self.replays_differ: list[int] = []
        self.refused = 0
        self.errors: Counter[str] = Counter()
        self.sent = 0
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.threads = [
            threading.Thread(target=self._produce, args=(t,), daemon=True) for t in range(THREADS)
        ]

    def start(self) -> None:
        self.started_at = time.monotonic()
        for thread in self.threads:
            thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.join()

    def join(self) -> None:
        for thread in self.threads:
            thread.join()

    def wait_for_sent(self, count: int) -> None:
        eventually(
            lambda: self.sent >= count or not any(t.is_alive() for t in self.threads),
            timeout_s=SETTLE_TIMEOUT_S,
            poll_s=0.01,
            what=f"{count} submissions sent",
        )

    def figures(self) -> dict:
        return {
            "refused": self.refused,
            "errors": dict(self.errors),
            "replays_differ": list(self.replays_differ),
        }

    def _produce(self, thread: int) -> None:
        mine = list(range(thread, self.submissions, THREADS))
        for k, i in enumerate(mine):
            if self.stopping.wait(self.started_at + i * self.interval_s - time.monotonic()):
                return
            self._send(i)
            with self.lock:
                self.sent += 1
            if k >= RESEND_LAG:
                self._send(mine[k - RESEND_LAG])
        for i in mine[-RESEND_LAG:]:
            self._send(i)

    def _send(self, i: int) -> None:
        try:
            op = self.client.set_goal(
                self.ws,
                f"s{i % self.sessions}",
                f"objective {i}",
                client_submit_id=str(i),
            )
        except DBAPIError:
            with self.lock:
                self.refused += 1
            return
        except Exception as exc:  # noqa: BLE001 - anything else is a failure of the test
            with self.lock:
                self.errors[f"{type(exc).__name__}: {str(exc)[:200]}"] += 1
            return
        with self.lock:
            first = self.accepted.setdefault(i, op)
            if (first.operation_id, first.goal_revision) != (op.operation_id, op.goal_revision):
                self.replays_differ.append(i)


class Effects:
    """The simulator's goal effects, fetched as they come (`since=`) by a thread of its own:
    one answer with all of a run's would pass the client's 1 MiB cap on an answer."""

    def __init__(self, sim_control, ws: str) -> None:
        self.feed, self.ws = EffectFeed(sim_control), ws
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._follow, daemon=True)
        self.thread.start()

    def _follow(self) -> None:
        while not self.stopping.wait(EFFECTS_POLL_S):
            self.feed.poll()

    def all(self) -> list[dict]:
        """Every goal effect so far (this stops the thread)."""
        self.stop()
        self.feed.poll()
        return self.feed.goals(self.ws)

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join()


def operations_in(client: AgentRadar, ws: str) -> dict[str, tuple]:
    """Every goal operation of the workspace in the database: id -> (session, revision,
    status)."""
    columns = (
        GoalOperationRow.operation_id,
        GoalOperationRow.session_id,
        GoalOperationRow.goal_revision,
        GoalOperationRow.status,
    )
    rows = run_read(
        client.engine,
        lambda s: s.execute(select(*columns).where(GoalOperationRow.workspace_id == ws)).all(),
    )
    return {row[0]: tuple(row[1:]) for row in rows}


def serving_port(client: AgentRadar) -> int:
    """The port of the server the client's database URL leads to now."""
    return run_read(client.engine, lambda s: s.execute(text("SELECT inet_server_port()")).scalar())


def open_operations(client: AgentRadar, ws: str) -> int:
    """How many operations of the workspace have not settled yet."""
    terminal = {str(s) for s in TERMINAL_OPERATION_STATUSES}
    return sum(1 for _, _, s in operations_in(client, ws).values() if s not in terminal)


def settle(client: AgentRadar, ws: str, since: float) -> float:
    """Wait until every operation the database holds has settled; when that was seen
    (time.monotonic())."""
    terminal = {str(s) for s in TERMINAL_OPERATION_STATUSES}

    def open_ones() -> Counter:
        return Counter(s for _, _, s in operations_in(client, ws).values() if s not in terminal)

    left: Counter = Counter()
    while time.monotonic() - since < SETTLE_TIMEOUT_S:
        left = open_ones()
        if not left:
            return time.monotonic()
        time.sleep(0.1)
    raise AssertionError(f"not settled {SETTLE_TIMEOUT_S} s after the load: {dict(left)}")


def audit(accepted: dict[int, GoalOperation], operations: dict, effects: list[dict]) -> dict:
    """What the promoted database and the agent hold, against what clients were told:
    accepted operations lost, operations applied twice, effects of operations the database
    does not know, completed ones the agent never saw, and sessions whose newest operation
    is not the last thing the agent applied."""
    per_op = Counter(e["operation_id"] for e in effects)
    last_applied = {e["session_id"]: e["operation_id"] for e in effects}
    newest: dict[str, tuple[int, str]] = defaultdict(lambda: (-1, ""))
    for op_id, (session, revision, _) in operations.items():
        newest[session] = max(newest[session], (revision, op_id))
    return {
        "lost": sorted(i for i, op in accepted.items() if op.operation_id not in operations),
        "twice": sorted(op_id for op_id, n in per_op.items() if n > 1),
        "unknown_effects": sorted(op_id for op_id in per_op if op_id not in operations),
        "statuses": dict(Counter(status for _, _, status in operations.values())),
        "completed_without_effect": sorted(
            op_id
            for op_id, (_, _, status) in operations.items()
            if status == "completed" and per_op[op_id] != 1
        ),
        "newest_not_applied": sorted(
            session for session, (_, op_id) in newest.items() if last_applied.get(session) != op_id
        ),
    }

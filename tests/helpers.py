"""Small helpers shared by the tests."""

import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta

from celery import Celery
from kombu import Exchange, Queue
from sqlalchemy import event, func, select, text

from agent_radar.models.base import Base, utcnow
from agent_radar.models.db import run_transaction
from agent_radar.workflows.tools.simulator import SimServer

# How often the tests' in-process servers (simulators, hostile hosts) look for a stop
# request: each stop waits up to this. The simulator's own STOP_POLL_S, 50 ms, was paid two
# or three times by every test's teardown.
STOP_POLL_S = 0.01


class QuickStopSimServer(SimServer):
    """The simulator, serving as it always does, that stops within STOP_POLL_S."""

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=STOP_POLL_S)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, start: datetime | None = None) -> None:
        self.now = start or utcnow()

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> datetime:
        self.now += timedelta(seconds=seconds)
        return self.now


@contextmanager
def statements_sent(engine) -> Iterator[list[str]]:
    """The first word of every statement the engine sends to its database in the block
    (BEGIN and COMMIT only where the driver sends them as statements: SQLite here)."""
    sent: list[str] = []

    def record(conn, cursor, statement, *_):
        sent.append(statement.split()[0])

    event.listen(engine, "before_cursor_execute", record)
    try:
        yield sent
    finally:
        event.remove(engine, "before_cursor_execute", record)


def row_counts(engine) -> dict[str, int]:
    def count(s):
        return {
            t.name: s.execute(select(func.count()).select_from(t)).scalar_one()
            for t in Base.metadata.sorted_tables
            # Leases and pullers' promises are coordination (a pulling worker's pool
            # processes write theirs once they are up, after the worker says it is ready);
            # refused reports are counted (docs/protocol.md: reports), which is what a
            # refusal writes instead of its content.
            if t.name not in ("leases", "goal_pullers", "report_refusals")
        }

    return run_transaction(engine, count)


def eventually(predicate, timeout_s: float = 30.0, poll_s: float = 0.05, what: str = ""):
    """Poll until predicate() is truthy; never a fixed sleep."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what or predicate}: {last!r}")


def effects_by_operation(sim_control) -> dict[str, int]:
    """How many times the simulator applied each operation."""
    counts: dict[str, int] = {}
    for effect in sim_control.effects():
        counts[effect["operation_id"]] = counts.get(effect["operation_id"], 0) + 1
    return counts


def dispatching(client, op):
    """The operation's row while a worker holds it mid-dispatch, else False."""
    row = client.get_goal_operation(op.operation_id)
    return row.status == "dispatched" and row.lease_token is not None and row


def queue_depth(settings, name: str = "default") -> int:
    """How many messages wait in a queue of the configured broker."""
    from agent_radar.workflows.adapters.broker import broker_connection, queue_named

    queue = queue_named(settings, name)
    with broker_connection(settings) as conn:
        # (an empty Redis list does not exist, so not passive: declaring it again is harmless)
        return queue.bind(conn.default_channel).queue_declare().message_count


def goal_call(runtime, workspace_id: str, session_id: str) -> dict:
    """One `set` goal call straight to a runtime (no product code in between), its
    operation id named after the session."""
    return runtime.apply_goal(
        workspace_id,
        session_id,
        operation_id=f"op-{session_id}",
        action="set",
        objective="x",
        revision=1,
        client_submit_id="1",
        require_live=True,
    )


def lock_waits(engine) -> int:
    """How many sessions of this PostgreSQL database are waiting for a lock right now."""
    with engine.connect() as probe:
        return probe.execute(
            text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND wait_event_type = 'Lock'"
            )
        ).scalar_one()


def restorer(client, runtime=None, published: list | None = None):
    """What a worker runs for `agent_radar.session.restore`, in this process: the session's
    restore through `runtime` (the client's, which routes to each session's host), its
    publishes kept in `published` if given."""
    from agent_radar.workflows.steps.cancel import CancelRunner
    from agent_radar.workflows.steps.restore import Restorer

    runner = CancelRunner(
        client.engine,
        runtime or client.runtime,
        worker_id="restorer",
        lease_s=5,
        publish=lambda task, kwargs: (
            (published if published is not None else []).append(task) or True
        ),
    )
    return Restorer(client.engine, runner.runtime, cancels=runner)


def fence_applier(client, url: str, **step):
    """What a worker runs for `agent_radar.fence.apply`, in this process, calling the host at
    `url`; `step` overrides the step's publish port or clock."""
    from agent_radar.workflows.adapters.http_runtime import HttpRuntime
    from agent_radar.workflows.steps.fence_apply import FenceApplier

    step = {"publish": lambda *a: True} | step
    return FenceApplier(client.engine, HttpRuntime(url), worker_id="a", lease_s=5, **step)


def cancel_runner(client, **options):
    """What a worker runs for `agent_radar.cancel.apply`, in this process (`options`: clock)."""
    from agent_radar.workflows.steps.cancel import CancelRunner

    return CancelRunner(
        client.engine, client.runtime, worker_id="c", lease_s=5, publish=lambda *a: True, **options
    )


def maintenance_executor(client, published: list | None = None, **options):
    """What a worker runs for `agent_radar.maintenance.execute`, in this process, polling
    every 20 ms: its publishes kept in `published` as (task, kwargs) if given; `options`
    (max_wait_s, clock) as MaintenanceExecutor takes them."""
    from agent_radar.workflows.steps.maintenance import MaintenanceExecutor

    def publish(task, kwargs):
        if published is not None:
            published.append((task, kwargs))
        return True

    return MaintenanceExecutor(
        client.engine,
        client.runtime,
        worker_id="w",
        lease_s=5,
        publish=publish,
        poll_s=0.02,
        **options,
    )


def documented_producer(broker_url: str) -> Celery:
    """A producer as docs/producers.md shows it for RabbitMQ: plain Celery, the replicated
    `default` queue, publisher confirms."""
    app = Celery("producer", broker=broker_url)
    app.conf.task_default_queue = "default"
    app.conf.task_queues = [
        Queue(
            "default",
            Exchange("agent_radar.default", type="topic"),
            routing_key="default",
            queue_arguments={"x-queue-type": "quorum"},
        ),
    ]
    app.conf.broker_transport_options = {"confirm_publish": True}
    return app


def query_plan(engine, statement) -> str:
    """The database's plan of a statement (not run), as text: PostgreSQL's EXPLAIN with
    sequential scans discouraged (test tables are tiny: ask for the indexes), SQLite's
    EXPLAIN QUERY PLAN."""
    sql = str(statement.compile(engine, compile_kwargs={"literal_binds": True}))

    def plan(s):
        if engine.dialect.name == "postgresql":
            s.execute(text("SET LOCAL enable_seqscan = off"))
            return "\n".join(s.execute(text(f"EXPLAIN {sql}")).scalars())
        return "\n".join(str(row[-1]) for row in s.execute(text(f"EXPLAIN QUERY PLAN {sql}")))

    return run_transaction(engine, plan)


def first_of_two_prompts_sent(client, sim_control, workspace_id: str, session_id: str):
    """Two prompts queued in the session, at a host whose turns run until they are ended; the
    first sent: (first, second)."""
    from agent_radar.workflows.steps.prompt_dispatch import dispatch_next

    client.ensure_session(workspace_id, session_id)
    sim_control.session(workspace_id, session_id, turn_duration_ms=0)
    first = client.submit_prompt(workspace_id, session_id, "first", client_submit_id="p1")
    second = client.submit_prompt(workspace_id, session_id, "second", client_submit_id="p2")
    assert dispatch_next(client.engine, client.runtime, workspace_id, session_id) == "dispatched"
    return first, second


def first_send_lands_and_settles_while_queued(client, sim_control, workspace_id, session_id):
    """Two prompts queued; p1's send times out at the worker but the host took it: p1 is
    queued again while its turn runs, is reported (naming p1) and settles. Returns p1, p2,
    that turn's id and the epoch it ran at."""
    import time

    from agent_radar.workflows.steps.prompt_dispatch import dispatch_next

    ws, sid = workspace_id, session_id

    def report(**parts):
        client.report_activity(
            {"workspace_id": ws, "session_id": sid, "occurred_at_ms": int(time.time() * 1000)}
            | parts
        )

    p1 = client.submit_prompt(ws, sid, "first", client_submit_id="p1")
    p2 = client.submit_prompt(ws, sid, "second", client_submit_id="p2")
    sim_control.hold("prompts")
    assert dispatch_next(client.engine, client.runtime, ws, sid).startswith("retry: ")
    sim_control.hold("prompts", hold=False)
    eventually(lambda: sim_control.effects("prompt"), what="the host to take p1")
    t1 = sim_control.effects("prompt")[0]["turn_id"]
    epoch = sim_control.session(ws, sid)["runtime_epoch"]
    turn = {"turn_id": t1, "origin": "user_prompt", "prompt_id": p1.prompt_id}
    report(session={"runtime_epoch": epoch}, turn={**turn, "phase": "running"})
    sim_control.session(ws, sid, settle_turn=t1)
    eventually(lambda: sim_control.session(ws, sid)["turns"][t1]["phase"] == "settled")
    report(turn={**turn, "phase": "settled", "outcome": "completed"})
    return p1, p2, t1, epoch

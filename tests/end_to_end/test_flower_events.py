"""What Flower sees (docs/operations.md): Celery's own event receiver and state — the code Flower
runs — against real workers, beat and client on every broker. A submit shows from the
moment the client publishes it (`task-sent`, under the client's name, with the workspace,
session and client submit ID), through the worker, to a result that says what happened to
each operation; the sweep, which runs every few seconds, does not show at all."""

import threading

import pytest
from sqlalchemy import select

from agent_radar.models.coordination import Heartbeat
from agent_radar.models.db import run_read
from agent_radar.workflows.tools.status import SWEEP_HEARTBEAT
from tests.helpers import eventually

WS = "ws-flower"
DISPATCH = "agent_radar.goal.dispatch"


@pytest.fixture(params=["embedded", "production", "rabbitmq"])
def backend(request):
    return request.param


class Watcher:
    """Celery's event receiver feeding Celery's cluster state, in a thread, as Flower does."""

    def __init__(self, settings) -> None:
        from agent_radar.tasks.app import create_app

        self.app = create_app(settings)
        self.state = self.app.events.State()
        self.types: list[str] = []
        self.connection = self.app.connection_for_read()
        self.receiver = self.app.events.Receiver(self.connection, handlers={"*": self._on})
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _on(self, event) -> None:
        self.types.append(event["type"])
        self.state.event(event)

    def _run(self) -> None:
        self.receiver.capture(limit=None, timeout=None, wakeup=False)

    def start(self) -> "Watcher":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.receiver.should_stop = True
        self.thread.join(10)
        self.connection.release()
        self.app.close()

    def tasks_named(self, name: str) -> list:
        return [t for t in list(self.state.tasks.values()) if t.name == name]


def _last_sweep(client):
    return run_read(
        client.engine,
        lambda s: s.execute(
            select(Heartbeat.beat_at).where(Heartbeat.name == SWEEP_HEARTBEAT)
        ).scalar_one_or_none(),
    )


def test_flower_sees_each_submit_and_not_the_sweep(settings, client, stack, sim_control):
    watcher = Watcher(settings).start()
    try:
        # Each goal by its dispatch message (a worker that pulls sends none: docs/dispatch.md).
        stack.start_worker(concurrency=1, extra_env={"AGENT_RADAR_PULL": "false"})
        # The worker's own announcement proves the watcher is listening.
        eventually(lambda: "worker-online" in watcher.types, timeout_s=60, what="worker-online")
        stack.start_beat()
        first = eventually(lambda: _last_sweep(client), timeout_s=60, what="a first sweep")
        eventually(lambda: _last_sweep(client) > first, timeout_s=60, what="a second sweep")

        op = client.set_goal(WS, "s1", "watched", client_submit_id="req-flower-1")
        assert client.wait(op, timeout=60).status == "completed"
        task = eventually(
            lambda: next((t for t in watcher.tasks_named(DISPATCH) if t.state == "SUCCESS"), None),
            timeout_s=30,
            what="the dispatch to show as succeeded",
        )
        # Sent by the client, before any worker had it: Flower knows it from the start.
        assert task.sent is not None and task.sent <= task.received
        assert task.client.startswith("agent-radar.")
        assert f"{WS}/s1" in task.kwargs and "submit=req-flower-1" in task.kwargs
        # Its call went on in the worker's drain (docs/dispatch.md): the result says so, and
        # the database has the outcome.
        assert f"'in_flight': ['{op.operation_id}']" in task.result
        # Two sweeps ran while the watcher listened; not one of their events reached it.
        assert watcher.tasks_named("agent_radar.sweep") == []
        assert all(t.name for t in watcher.state.tasks.values()), "events of a nameless task"
    finally:
        watcher.stop()

"""Redis restarts under a running fleet (DESIGN 9): this test's own redis-server, which keeps
nothing on disk, is killed with goal work in flight and queued; more goal work, a compaction
and prompts are submitted while it is down. Once it is back, workers and beat reconnect, the
sweeper re-publishes from the database what the restart lost, and every operation takes
effect exactly once."""

import shutil
import signal
import subprocess
from dataclasses import replace

import pytest
import redis

from tests.conftest import skip_or_fail
from tests.helpers import dispatching, effects_by_operation, eventually
from workflows.tools.stack import free_port

WS = "ws-restart"


class OwnRedis:
    """A redis-server started (and ended) by this test only, on a port of its own."""

    def __init__(self, log_path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    "redis-server",
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        probe = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        try:
            eventually(lambda: self._pings(probe), timeout_s=15, what="redis-server to answer")
        finally:
            probe.close()

    def _pings(self, probe) -> bool:
        assert self.proc.poll() is None, self.log_path.read_text()[-2000:]
        try:
            return probe.ping()
        except redis.ConnectionError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)  # a crash: whatever it held is gone
            self.proc.wait(10)

    def queued(self) -> int:
        probe = redis.Redis(port=self.port)
        try:
            return sum(probe.llen(key) for key in probe.scan_iter() if probe.type(key) == b"list")
        finally:
            probe.close()


@pytest.fixture
def backend():
    return "production"  # the filesystem broker has no server to restart


@pytest.fixture
def own_redis(tmp_path):
    if shutil.which("redis-server") is None:
        skip_or_fail("redis-server is not installed")
    server = OwnRedis(tmp_path / "redis.log")
    server.start()
    yield server
    server.kill()


@pytest.fixture
def settings(settings, own_redis):
    return replace(settings, broker_url=own_redis.url)


def test_a_redis_restart_loses_nothing_and_applies_nothing_twice(
    settings, own_redis, client, stack, sim_control
):
    workers = [stack.start_worker(concurrency=2), stack.start_worker(concurrency=1)]
    beat = stack.start_beat()
    before = [
        client.set_goal(WS, f"before-{i}", "settled first", client_submit_id="1") for i in range(3)
    ]
    for op in before:
        assert client.wait(op, timeout=60).status == "completed"

    # In flight when the server dies: every pool process waits on a slow agent call...
    sim_control.latency("goal", 3000)
    in_flight = []
    for i in range(3):
        in_flight.append(client.set_goal(WS, f"flight-{i}", "mid-call", client_submit_id="1"))
        eventually(lambda: dispatching(client, in_flight[-1]), what="a busy pool process")
    # ...so these messages wait in Redis and die with it.
    queued = [
        client.set_goal(WS, f"queued-{i}", "lost with the broker", client_submit_id="1")
        for i in range(6)
    ]
    eventually(lambda: own_redis.queued() > 0, timeout_s=10, what="messages waiting in Redis")
    own_redis.kill()
    sim_control.latency("goal", 0)

    # Submitted while the broker is down: accepted and durable; the publish fails.
    down = [
        client.set_goal(WS, f"down-{i}", "submitted during the outage", client_submit_id="1")
        for i in range(3)
    ]
    assert {op.status for op in down} == {"prepared"}
    compaction = client.start_maintenance(WS, "down-m", client_submit_id="m1")
    prompts = [
        client.submit_prompt(WS, "down-p", f"prompt {i}", client_submit_id=f"p{i}")
        for i in range(2)
    ]
    own_redis.start()  # empty: nothing it held survived

    every = before + in_flight + queued + down
    for op in every:
        assert client.wait(op, timeout=120).status == "completed", op.operation_id
    assert all(w.alive() for w in workers) and beat.alive()
    assert effects_by_operation(sim_control) == {op.operation_id: 1 for op in every}
    assert client.wait(compaction, timeout=60).status == "completed"
    assert len(sim_control.effects("maintenance")) == 1
    for p in prompts:
        eventually(
            lambda p=p: client.get_prompt(p.prompt_id).status == "completed",
            timeout_s=60,
            what=f"prompt {p.prompt_id}",
        )
    assert [e["text"] for e in sim_control.effects("prompt")] == ["prompt 0", "prompt 1"]

    # The fleet and the client work on the restarted server.
    after = client.set_goal(WS, "after", "business as usual", client_submit_id="1")
    assert client.wait(after, timeout=60).status == "completed"
    assert effects_by_operation(sim_control)[after.operation_id] == 1

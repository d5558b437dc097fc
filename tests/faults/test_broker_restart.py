"""The broker restarts under a running fleet (docs/lifecycles.md: leases), for Redis and for
RabbitMQ: the test's own server is killed with goal work in flight and queued; more goal work, a
compaction and prompts are submitted while it is down. Once it is back, workers and beat reconnect,
the sweeper re-publishes from the database whatever the restart lost, and every operation takes
effect exactly once.

Redis here keeps nothing on disk, so a restart loses every queued message. RabbitMQ's quorum
queues keep every message it confirmed: after a crash they are all still there, and workers
apply them with no sweeper running."""

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
import redis

from agent_radar.workflows.adapters.broker import broker_connection, kombu_queues
from agent_radar.workflows.tools.stack import free_port
from tests.conftest import skip_or_fail
from tests.helpers import dispatching, effects_by_operation, eventually, queue_depth

WS = "ws-restart"


class OwnRedis:
    """A redis-server started (and ended) by this test only, on a port of its own."""

    def __init__(self, log_path, *extra_args: str) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.log_path = log_path
        self.extra_args = list(extra_args)  # e.g. --maxmemory 8mb
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
                    *self.extra_args,
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

    def queued(self, settings) -> int:
        probe = redis.Redis(port=self.port)
        try:
            return sum(probe.llen(key) for key in probe.scan_iter() if probe.type(key) == b"list")
        finally:
            probe.close()


class OwnRabbitMQ:
    """A RabbitMQ node started (and ended) by this test only: its own node name, ports and
    data folder, run as the `rabbitmq` user in a process group of its own. The shared
    node is never touched. A restart keeps the data folder, as a real restart does."""

    USER = "rabbitmq"

    def __init__(self) -> None:
        self.port = free_port()
        self.node = f"radar{self.port}@localhost"
        self.url = f"amqp://guest:guest@127.0.0.1:{self.port}//"
        # Not under pytest's tmp_path: the rabbitmq user cannot enter root's 0700 folders.
        self.folder = Path(tempfile.mkdtemp(prefix="radar-rabbitmq-"))
        self.folder.chmod(0o755)
        (self.folder / "rabbitmq.conf").write_text(f"listeners.tcp.local = 127.0.0.1:{self.port}\n")
        (self.folder / "enabled_plugins").write_text("[].\n")
        account = pwd.getpwnam(self.USER)
        self.home = account.pw_dir
        for path in [self.folder, *self.folder.iterdir()]:
            os.chown(path, account.pw_uid, account.pw_gid)
        self.log_path = self.folder / "server.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": self.home,  # the rabbitmq user's Erlang cookie
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(free_port()),
            "RABBITMQ_CONFIG_FILE": str(self.folder / "rabbitmq.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.folder / "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": str(self.folder / "data"),
            "RABBITMQ_LOG_BASE": str(self.folder / "log"),
            "RABBITMQ_PID_FILE": str(self.folder / "node.pid"),
        }
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                ["/usr/lib/rabbitmq/bin/rabbitmq-server"],
                env=env,
                user=self.USER,
                group=self.USER,
                cwd=self.folder,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        eventually(self._accepts, timeout_s=90, poll_s=0.2, what="the RabbitMQ node to answer")

    def _accepts(self) -> bool:
        assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
        try:
            with broker_connection(_on(self.url), connect_timeout=1) as conn:
                conn.ensure_connection(max_retries=1, timeout=1)
            return True
        except Exception:  # noqa: BLE001 - not up yet
            return False

    def settle(self) -> None:
        """Make this node one that has run for a while: the queues a fleet uses exist, and
        a clean restart has put their registration on disk. (RabbitMQ 3.10 may lose a
        quorum queue declared seconds before a crash: it comes back empty and refuses
        publishes. A deployment's queues are older than that.)"""
        from kombu.transport.native_delayed_delivery import (
            declare_native_delayed_delivery_exchanges_and_queues,
        )

        settings = _on(self.url)
        with broker_connection(settings) as conn:
            for queue in kombu_queues(settings):
                queue.bind(conn.default_channel).declare()
            declare_native_delayed_delivery_exchanges_and_queues(conn, "quorum")
        self.stop()
        self.start()

    def stop(self) -> None:
        """A clean shutdown (RabbitMQ stops gracefully on SIGTERM)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(60)

    def kill(self) -> None:
        """A crash: SIGKILL to the whole node, no chance to sync or say goodbye."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(15)

    def queued(self, settings) -> int:
        return queue_depth(settings)

    def remove(self) -> None:
        self.kill()
        shutil.rmtree(self.folder, ignore_errors=True)


def _on(url: str):
    from agent_radar.workflows.adapters.config import Settings

    return Settings(home=Path("."), database_url="sqlite://", broker_url=url)


@pytest.fixture
def backend(request):
    # The filesystem broker has no server to restart; the broker is this test's own.
    return "production"


@contextmanager
def running_redis(tmp_path, *extra_args: str) -> Iterator[OwnRedis]:
    """A redis-server of the test's own (with `extra_args`), killed when the test ends."""
    if shutil.which("redis-server") is None:
        skip_or_fail("redis-server is not installed")
    server = OwnRedis(tmp_path / "redis.log", *extra_args)
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def own_redis(tmp_path):
    with running_redis(tmp_path) as server:
        yield server


@pytest.fixture
def own_rabbitmq():
    if not Path("/usr/lib/rabbitmq/bin/rabbitmq-server").exists():
        skip_or_fail("rabbitmq-server is not installed")
    try:
        pwd.getpwnam(OwnRabbitMQ.USER)
    except KeyError:
        skip_or_fail("there is no rabbitmq user to run a RabbitMQ node as")
    if os.geteuid() != 0:
        skip_or_fail("starting a RabbitMQ node as the rabbitmq user needs root")
    server = OwnRabbitMQ()
    try:
        server.start()
        server.settle()
        yield server
    finally:
        server.remove()


@pytest.fixture(params=["redis", "rabbitmq"])
def broker(request):
    return request.getfixturevalue(f"own_{request.param}")


@pytest.fixture
def settings(settings, broker):
    return replace(settings, broker_url=broker.url, broker_key_prefix="")


def test_a_broker_restart_loses_nothing_and_applies_nothing_twice(
    settings, broker, client, stack, sim_control
):
    workers = [stack.start_worker(concurrency=2), stack.start_worker(concurrency=1)]
    beat = stack.start_beat()
    before = [
        client.set_goal(WS, f"before-{i}", "settled first", client_submit_id="1") for i in range(3)
    ]
    for op in before:
        assert client.wait(op, timeout=60).status == "completed"

    # In flight when the server dies: slow agent calls...
    sim_control.latency("goal", 3000)
    in_flight = []
    for i in range(3):
        in_flight.append(client.set_goal(WS, f"flight-{i}", "mid-call", client_submit_id="1"))
        eventually(lambda: dispatching(client, in_flight[-1]), what="a call in flight")
    # ...and messages waiting in the broker when it dies. A pool process hands its calls to
    # its drain and takes the next message at once, so the workers are paused (SIGSTOP)
    # while these are published and the broker is killed, then let go.
    for worker in workers:
        worker.signal_group(signal.SIGSTOP)
    try:
        queued = [
            client.set_goal(WS, f"queued-{i}", "queued at the crash", client_submit_id="1")
            for i in range(6)
        ]
        eventually(lambda: broker.queued(settings) > 0, timeout_s=10, what="messages waiting")
        broker.kill()
    finally:
        for worker in workers:
            worker.signal_group(signal.SIGCONT)
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
    broker.start()

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


@pytest.mark.parametrize("broker", ["rabbitmq"], indirect=True)
def test_rabbitmq_keeps_confirmed_messages_through_a_crash(
    settings, broker, client, stack, sim_control
):
    """Publisher confirms and quorum queues: once a submit's message is published (`flush`
    returned), it is on disk. Crash the node with the messages waiting (no worker runs),
    restart it, and a worker — with no beat, so no sweeper to re-publish anything — applies
    every one."""
    ops = [
        client.set_goal(WS, f"kept-{i}", "outlive the crash", client_submit_id="1")
        for i in range(5)
    ]
    assert client.flush()
    waiting = broker.queued(settings)
    assert waiting >= 1  # the submits coalesce: a few messages carry the five operations
    broker.kill()
    broker.start()
    # A quorum queue counts its messages once it has replayed its log: until then, moments
    # after the node answers, it may report none.
    eventually(lambda: broker.queued(settings) == waiting, what="the messages back in the queue")
    stack.start_worker(concurrency=2)
    for op in ops:
        assert client.wait(op, timeout=60).status == "completed", op.operation_id
    assert effects_by_operation(sim_control) == {op.operation_id: 1 for op in ops}
    eventually(lambda: broker.queued(settings) == 0, what="every message acknowledged")

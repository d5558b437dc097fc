"""A database outage under a running fleet: every connection of the workers, beat and the
client to PostgreSQL goes through a TCP proxy the test cuts — open connections are reset and
new ones refused, as in a failover — with a dispatch mid-call and public submits arriving
over the broker. Once the database answers again, nothing accepted is lost and nothing
reached the agent twice."""

import re
import socket
import threading
from dataclasses import replace

import pytest
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from agent_radar.workflows.adapters.publisher import TaskPublisher
from agent_radar.workflows.client import AgentRadar
from agent_radar.workflows.tools.stack import Stack
from tests.helpers import dispatching, effects_by_operation, eventually

WS = "ws-outage"


class TcpProxy:
    """Forwards 127.0.0.1:<port> to a server; `cut()` resets every connection and refuses
    new ones until `restore()`."""

    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self.port = self.listener.getsockname()[1]
        self.up = threading.Event()
        self.up.set()
        self.lock = threading.Lock()
        self.pairs: set[tuple[socket.socket, socket.socket]] = set()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            if not self.up.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            pair = (client, upstream)
            with self.lock:
                self.pairs.add(pair)
            for src, dst in (pair, pair[::-1]):
                threading.Thread(target=self._pump, args=(src, dst, pair), daemon=True).start()

    def _pump(self, src, dst, pair) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            self._drop(pair)

    def _drop(self, pair) -> None:
        with self.lock:
            self.pairs.discard(pair)
        for sock in pair:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def cut(self) -> None:
        self.up.clear()
        with self.lock:
            pairs = list(self.pairs)
        for pair in pairs:
            self._drop(pair)

    def restore(self) -> None:
        self.up.set()

    def close(self) -> None:
        self.cut()
        self.listener.close()


@pytest.fixture
def backend():
    return "production"  # the embedded database is a file, not a server


@pytest.fixture
def proxy(settings):
    url = make_url(settings.database_url)
    p = TcpProxy(url.port or 5432, url.host or "127.0.0.1")
    yield p
    p.close()


@pytest.fixture
def proxied(settings, proxy):
    """This test's settings, with the database reached through the proxy."""
    url = make_url(settings.database_url).set(host="127.0.0.1", port=proxy.port)
    return replace(settings, database_url=url.render_as_string(hide_password=False))


def test_a_database_outage_loses_nothing_and_applies_nothing_twice(
    settings, proxied, proxy, sim, sim_control
):
    stack = Stack(proxied)  # workers and beat reach the database through the proxy only
    stack.prepare()
    observer = AgentRadar(settings=settings)  # the test's own view, always up
    through_proxy = AgentRadar(settings=proxied)
    publisher = TaskPublisher(proxied)
    try:
        stack.start_worker(concurrency=2)
        beat = stack.start_beat()
        # Started (beat applies migrations first; one that cannot reach the database at
        # start exits, for its supervisor to restart it).
        eventually(
            lambda: "beat: Starting" in beat.log_path.read_text(),
            timeout_s=60,
            what="beat to start",
        )
        before = through_proxy.set_goal(WS, "before", "settled first", client_submit_id="1")
        assert observer.wait(before, timeout=60).status == "completed"

        # A dispatch is mid-call when the database goes away: its outcome cannot be
        # recorded, and the agent has already applied it.
        sim_control.latency("goal", 1500)
        in_flight = through_proxy.set_goal(WS, "flight", "mid-call", client_submit_id="1")
        eventually(lambda: dispatching(observer, in_flight), what="the dispatch to start")
        proxy.cut()
        sim_control.latency("goal", 0)

        # While it is away a client cannot accept anything (the database is the source of
        # truth), and public submits arriving over the broker wait and retry.
        with pytest.raises(OperationalError):
            through_proxy.set_goal(WS, "refused", "not accepted", client_submit_id="1")
        for i in range(2):
            publisher.publish(
                "agent_radar.goal_control",
                {
                    "workspace_id": WS,
                    "session_id": f"public-{i}",
                    "action": "set",
                    "objective": "sent during the outage",
                    "client_submit_id": "1",
                },
            )
        eventually(
            lambda: len(sim_control.effects()) == 2,
            timeout_s=10,
            what="the in-flight call to reach the agent",
        )

        # The outcome cannot be recorded: the worker keeps it and tries again (if the lease
        # runs out first, the sweeper's new attempt stands and the agent deduplicates); a
        # public submit has found the database away and scheduled a retry.
        def logged(pattern):
            return any(re.search(pattern, p.log_path.read_text()) for p in stack.procs)

        eventually(
            lambda: logged("goal drain: recording 1 outcomes failed, trying again"),
            timeout_s=60,
            poll_s=0.2,
            what="the worker to keep the outcome it could not record",
        )
        eventually(
            lambda: logged(re.compile(r"goal_control\[[-\w]+\] retry: Retry in")),
            timeout_s=60,
            poll_s=0.2,
            what="a public submit to retry",
        )
        assert observer.find_goal_operation(WS, "refused", "1") is None
        proxy.restore()

        done = [observer.wait(in_flight, timeout=90)]
        for i in range(2):
            submitted = eventually(
                lambda i=i: observer.find_goal_operation(WS, f"public-{i}", "1"),
                timeout_s=90,
                what=f"public submit {i} to be accepted",
            )
            done.append(observer.wait(submitted, timeout=90))
        assert [op.status for op in done] == ["completed"] * 3
        assert done[0].attempt >= 1  # recorded when the database came back, or sent again
        assert effects_by_operation(sim_control) == {op.operation_id: 1 for op in [before, *done]}
        assert observer.find_goal_operation(WS, "refused", "1") is None
        assert all(p.alive() for p in stack.procs)
    finally:
        publisher.close()
        through_proxy.close()
        observer.close()
        stack.kill()  # as the stack fixture: the test is over, no warm shutdown to wait for

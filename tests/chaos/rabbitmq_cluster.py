"""A three-node RabbitMQ cluster of a test's own (docs/broker-cluster.md), and clients that
submit goal operations to it under load.

The nodes are the broker-restart test's own nodes (tests/faults/test_broker_restart.py: a
node name, ports and a data folder each, run as the `rabbitmq` user in a process group of
their own, with the `rabbitmq` user's Erlang cookie). They form their cluster as they boot,
before anything declares a queue, so every quorum queue has a member on each node. The shared
node is never touched."""

import json
import os
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import amqp.exceptions
import kombu.exceptions
from celery import Celery

from agent_radar.workflows import ids
from tests.conftest import rabbitmqctl
from tests.faults.test_broker_restart import OwnRabbitMQ
from tests.helpers import documented_producer, eventually

# The cluster's virtual host. Created with quorum as its default queue type, as
# docs/broker-cluster.md asks: Celery's queue `celery`, which the workers and plain Celery
# producers declare with no type, is then a quorum queue too.
VHOST = "radar"
# The default virtual host, with RabbitMQ's default (classic) queue type: where a worker
# shows what becomes of a classic `celery` queue whose node is lost.
CLASSIC_VHOST = "/"
# What a client sees when a publish does not get its confirm: the connection dropped under
# it (after kombu's retries on the next nodes), or the broker refused it (a nack).
PUBLISH_ERRORS = (
    kombu.exceptions.KombuError,
    amqp.exceptions.AMQPError,
    amqp.exceptions.MessageNacked,
    OSError,
)
# A joining node asks the first node this often, this many times (30 s) if it does not answer.
JOIN_RETRY_MS = 250
JOIN_RETRIES = 120


class ClusterNode(OwnRabbitMQ):
    """One node of the cluster (a node of tests/faults/test_broker_restart.py)."""

    def crash(self) -> None:
        """SIGKILL the node's Erlang VM by its pid (the node writes it to its pid file), then
        whatever else of its process group is left: no chance to sync or say goodbye."""
        pid = int((self.folder / "node.pid").read_text())
        os.kill(pid, signal.SIGKILL)
        self.kill()


class OwnCluster:
    """Three nodes, one cluster. Clients and workers get them all in one broker URL, the
    first node first (`amqp://…:p1/radar;amqp://…:p2/radar;…`)."""

    def __init__(self, size: int = 3) -> None:
        self.nodes = [ClusterNode() for _ in range(size)]
        # The other nodes join the first as they boot (peer discovery from the config file):
        # no `join_cluster`, no second start of their app. A restarted node finds its
        # cluster in its data folder.
        for node in self.nodes[1:]:
            with open(node.folder / "rabbitmq.conf", "a") as conf:
                conf.write(
                    "cluster_formation.peer_discovery_backend = classic_config\n"
                    f"cluster_formation.classic_config.nodes.1 = {self.first.node}\n"
                    f"cluster_formation.discovery_retry_limit = {JOIN_RETRIES}\n"
                    f"cluster_formation.discovery_retry_interval = {JOIN_RETRY_MS}\n"
                )

    @property
    def first(self) -> ClusterNode:
        return self.nodes[0]

    def url(self, vhost: str = VHOST) -> str:
        return ";".join(f"amqp://guest:guest@127.0.0.1:{n.port}/{vhost}" for n in self.nodes)

    def start(self) -> None:
        """Boot the first node, then the others at once (they join it as they boot: one that
        joined a first node still booting itself could copy its tables mid-upgrade and fail
        its schema check), then make the virtual host."""
        self.first.start()
        self._each(lambda node: node.start(), self.nodes[1:])
        eventually(
            lambda: self.running() == {n.node for n in self.nodes},
            timeout_s=30,
            what="three running nodes",
        )
        first = self.first.node
        rabbitmqctl("add_vhost", VHOST, "--default-queue-type", "quorum", node=first)
        rabbitmqctl("set_permissions", "-p", VHOST, "guest", ".*", ".*", ".*", node=first)

    @staticmethod
    def _each(fn, nodes) -> None:
        with ThreadPoolExecutor(len(nodes)) as pool:
            for done in [pool.submit(fn, node) for node in nodes]:
                done.result()

    def _live(self) -> ClusterNode:
        return next(n for n in self.nodes if n.proc is not None and n.proc.poll() is None)

    def running(self) -> set[str]:
        """The nodes the cluster counts as running, asked of a live one."""
        out = rabbitmqctl("cluster_status", "--formatter", "json", node=self._live().node)
        return set(json.loads(out)["running_nodes"])

    def queues(self, vhost: str = VHOST) -> dict[str, dict[str, str]]:
        """Each queue's type, leader, members and members online, asked of a live node."""
        columns = ("name", "type", "leader", "members", "online")
        out = rabbitmqctl(
            "list_queues", "-p", vhost, "--formatter", "json", *columns, node=self._live().node
        )
        return {q["name"]: q for q in json.loads(out)}

    def remove(self) -> None:
        for node in self.nodes:
            node.remove()


@dataclass
class Submission:
    """One goal submission: a session, a client submit ID, and what became of its sends."""

    workspace_id: str
    session_id: str
    submit_id: str
    via_client: bool  # the Python client (accepted at commit), else a Celery producer
    confirmed_at: list[float] = field(default_factory=list)  # time.time() of each acceptance
    refused: list[str] = field(default_factory=list)  # the error of each send that failed

    @property
    def accepted(self) -> bool:
        return bool(self.confirmed_at)

    @property
    def operation_id(self) -> str:
        return ids.goal_operation_id(self.workspace_id, self.session_id, self.submit_id)


class Load:
    """Clients submitting `set` goals, paced: `count` submissions over `sessions` sessions at
    `rate_per_s`, each sent twice with the same client submit ID (the second `lag` submissions
    later). Every tenth goes through the Python client, which accepts at its commit; the rest
    are Celery producers' messages, accepted once their publisher confirm arrives."""

    def __init__(
        self,
        broker_url: str,
        client,
        workspace_id: str,
        count: int,
        sessions: int,
        rate_per_s: float,
        lag: int = 20,
        producers: int = 3,
    ) -> None:
        self.broker_url = broker_url
        self.client = client
        self.submissions = [
            Submission(workspace_id, f"s{i % sessions}", f"g{i}", via_client=i % 10 == 0)
            for i in range(count)
        ]
        self.rate_per_s = rate_per_s
        # Every send, in order: (due after the start in seconds, submission)
        sends = [(i / rate_per_s, s) for i, s in enumerate(self.submissions)]
        sends += [((i + lag) / rate_per_s, s) for i, s in enumerate(self.submissions)]
        sends.sort(key=lambda send: send[0])
        self._shares = [sends[k::producers] for k in range(producers)]
        self._threads: list[threading.Thread] = []
        self.unexpected: list[BaseException] = []
        self.started_at = self.finished_at = 0.0  # time.monotonic(): the first and last send

    def start(self) -> None:
        self.started_at = time.monotonic()
        self._threads = [
            threading.Thread(target=self._produce, args=(share,), name=f"producer-{k}")
            for k, share in enumerate(self._shares)
        ]
        for thread in self._threads:
            thread.start()

    def join(self, timeout_s: float) -> None:
        for thread in self._threads:
            thread.join(max(0.0, self.started_at + timeout_s - time.monotonic()))
            assert not thread.is_alive(), f"{thread.name} still sending after {timeout_s} s"
        assert not self.unexpected, self.unexpected

    def _produce(self, share) -> None:
        app = documented_producer(self.broker_url)
        try:
            for due_s, submission in share:
                time.sleep(max(0.0, self.started_at + due_s - time.monotonic()))
                self._send(app, submission)
                self.finished_at = max(self.finished_at, time.monotonic())
        except BaseException as exc:  # noqa: BLE001 - the test thread reports it
            self.unexpected.append(exc)
        finally:
            app.close()

    def _send(self, app: Celery, s: Submission) -> None:
        if s.via_client:
            # The Python client: accepted once committed; its message is the sweeper's if
            # the publish fails (the row is the outbox).
            self.client.set_goal(
                s.workspace_id, s.session_id, "cluster", client_submit_id=s.submit_id
            )
            s.confirmed_at.append(time.time())
            return
        try:
            app.send_task(
                "agent_radar.goal_control",
                kwargs={
                    "workspace_id": s.workspace_id,
                    "session_id": s.session_id,
                    "action": "set",
                    "objective": "cluster",
                    "client_submit_id": s.submit_id,
                },
            )
        except PUBLISH_ERRORS as exc:
            s.refused.append(f"{type(exc).__name__}: {exc}"[:120])
        else:
            s.confirmed_at.append(time.time())

    @property
    def accepted(self) -> list[Submission]:
        return [s for s in self.submissions if s.accepted]

    def refusals(self) -> Counter:
        return Counter(error for s in self.submissions for error in s.refused)

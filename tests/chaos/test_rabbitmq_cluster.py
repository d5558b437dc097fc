"""A RabbitMQ cluster node lost under load (docs/broker-cluster.md): three nodes of the test's
own, quorum queues with a member on each, and clients and workers given all three in one
broker URL. The node they all reach first, which leads every queue, is SIGKILLed while goal
submissions pour in, and restarted later. Every submission a client saw accepted is applied
exactly once, everything settles within SETTLE_TARGET_S of the loss, the workers and clients
carry on through the other nodes while it is down, and the node rejoins.

The suite runs a short form; `make chaos` (AGENT_RADAR_CHAOS=full) runs 2,000 submissions, a
20-second outage, a worker SIGKILLed and another SIGSTOPped past its lease, and a worker whose
`celery` queue is classic."""

import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import select

from agent_radar.models.operations import GoalOperation as GoalOperationRow
from agent_radar.workflows.adapters.config import Settings
from agent_radar.workflows.kinds.goal import TERMINAL_OPERATION_STATUSES, OperationStatus
from agent_radar.workflows.tools.stack import free_port
from tests.chaos.rabbitmq_cluster import CLASSIC_VHOST, Load, OwnCluster
from tests.conftest import skip_or_fail, throwaway_pg_database
from tests.helpers import effects_by_operation, eventually, queue_depth

WS = "ws-cluster"
FULL = os.environ.get("AGENT_RADAR_CHAOS") == "full"
# The promise: every accepted operation settled within this long of the node's loss.
SETTLE_TARGET_S = 60.0


@dataclass(frozen=True)
class Shape:
    submissions: int
    sessions: int
    rate_per_s: float  # submissions a second (each is sent twice)
    workers: int  # each with 2 pool processes
    lost_after: float  # the share of the submissions accepted when the node is killed
    down_s: float  # from the kill to the node's restart
    worker_faults: bool  # a worker SIGKILLed, another SIGSTOPped past its lease
    classic_worker: bool  # a worker on a classic `celery` queue, stopped by the loss


# The short form keeps the suite's budget (three nodes boot in ~15 s on a 2-core machine). The
# full form is the trial: 2,000 submissions sent twice, the node back after 20 s; the
# load goes on for ~25 s after the loss, at a pace a 2-core machine's fleet keeps up with, so
# that the time to settle is the loss's and not a backlog's.
FULL_SHAPE = Shape(2000, 400, 25.0, 3, 0.7, down_s=20.0, worker_faults=True, classic_worker=True)
SHORT_SHAPE = Shape(200, 50, 40.0, 2, 0.3, down_s=3.0, worker_faults=False, classic_worker=False)
SHAPE = FULL_SHAPE if FULL else SHORT_SHAPE


@pytest.fixture
def cluster():
    if not Path("/usr/lib/rabbitmq/bin/rabbitmq-server").exists():
        skip_or_fail("rabbitmq-server is not installed")
    if shutil.which("rabbitmqctl") is None:
        skip_or_fail("rabbitmqctl is not installed")
    try:
        pwd.getpwnam("rabbitmq")
    except KeyError:
        skip_or_fail("there is no rabbitmq user to run RabbitMQ nodes as")
    if os.geteuid() != 0:
        skip_or_fail("starting RabbitMQ nodes as the rabbitmq user needs root")
    own = OwnCluster()
    try:
        own.start()
        yield own
    finally:
        own.remove()


@pytest.fixture
def settings(tmp_path, cluster):
    """The conftest's test settings, on a database of this test's own and the cluster."""
    home = tmp_path / "home"
    home.mkdir()
    with throwaway_pg_database("agent_radar_rmqchaos") as database_url:
        yield Settings(
            home=home,
            database_url=database_url,
            broker_url=cluster.url(),
            runtime_url=f"http://127.0.0.1:{free_port()}",
            sweep_interval_s=0.5,
            lease_s=3.0,
            runtime_timeout_s=2.0,
            maintenance_cancel_grace_s=1.0,
        )


def goal_statuses(client) -> dict[str, str]:
    with client.engine.connect() as conn:
        rows = conn.execute(
            select(GoalOperationRow.operation_id, GoalOperationRow.status).where(
                GoalOperationRow.workspace_id == WS
            )
        )
        return dict(rows.all())


def cli(settings, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "agent_radar.workflows.tools.cli", *args],
        env={**os.environ, **settings.to_env()},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.timeout(300)
def test_a_node_lost_under_load_loses_nothing_and_applies_nothing_twice(
    cluster, settings, client, stack, sim_control
):
    shape = SHAPE
    workers, classic_worker = _start_workers(stack, cluster, shape)
    beat = stack.start_beat()
    # Declared once the cluster was formed: every queue has a member on each node, and the
    # leaders are on the node every client reaches first.
    queues = cluster.queues()
    for name in ("default", "maintenance", "celery"):
        assert queues[name]["type"] == "quorum", queues[name]
        assert len(queues[name]["members"]) == 3, queues[name]
    assert queues["default"]["leader"] == cluster.first.node

    load = Load(
        settings.broker_url, client, WS, shape.submissions, shape.sessions, shape.rate_per_s
    )
    load.start()
    eventually(
        lambda: len(load.accepted) >= shape.lost_after * shape.submissions,
        timeout_s=shape.submissions / shape.rate_per_s + 60,
        what="the load under way",
    )
    cluster.first.crash()
    lost_at, lost_wall = time.monotonic(), time.time()
    killed = None
    with ThreadPoolExecutor(3) as pool:
        # While the node is down: the broker probe reaches another node, the exporter serves,
        # and the worker on a classic `celery` queue stops (docs/broker-cluster.md).
        health = pool.submit(cli, settings, "health", "broker")
        scrape = pool.submit(cli, settings, "metrics", "--once")
        if shape.worker_faults:
            killed = _hurt_workers(stack, workers, settings.lease_s)
        if classic_worker:
            eventually(lambda: not classic_worker.alive(), timeout_s=60, what="classic worker")
        time.sleep(max(0.0, lost_at + shape.down_s - time.monotonic()))  # the outage
        health_run, scrape_run = health.result(), scrape.result()  # done while it lasted
        back = pool.submit(cluster.first.start)
        load.join(timeout_s=shape.submissions / shape.rate_per_s + 120)

        accepted = load.accepted
        statuses: dict[str, str] = {}

        def settled() -> bool:
            statuses.update(goal_statuses(client))
            return all(s.operation_id in statuses for s in accepted) and all(
                status in TERMINAL_OPERATION_STATUSES for status in statuses.values()
            )

        eventually(settled, timeout_s=180, poll_s=0.25, what="every operation settled")
        settled_s = time.monotonic() - lost_at
        after_load_s = time.monotonic() - load.finished_at
        rate = len(statuses) / (time.monotonic() - load.started_at)
        back.result()
        back_wall = time.time()

    effects = effects_by_operation(sim_control)
    lost = [s.operation_id for s in accepted if s.operation_id not in statuses]
    twice = {op: n for op, n in effects.items() if n > 1}
    completed = {op for op, status in statuses.items() if status == OperationStatus.COMPLETED}
    refused = [s for s in load.submissions if not s.accepted]
    in_doubt = [s for s in refused if s.operation_id in statuses]
    during = [s for s in accepted if any(lost_wall < t < back_wall for t in s.confirmed_at)]
    applied_during = [e for e in sim_control.effects() if lost_wall < e["at"] < back_wall]
    print(
        f"\nRabbitMQ cluster, {'full' if FULL else 'short'} form: {len(load.submissions)} "
        f"submissions sent twice, {len(accepted)} accepted ({len(during)} while the node was "
        f"down), {len(refused)} not ({len(in_doubt)} of those applied all the same); sends "
        f"refused: {dict(load.refusals()) or 0}; lost {len(lost)}, applied twice {len(twice)}; "
        f"{len(completed)} completed, {len(statuses) - len(completed)} superseded; all "
        f"settled {settled_s:.1f} s after the node's loss, {after_load_s:.1f} s after the "
        f"load ({rate:.0f} operations/s from the first submission to the last settled)"
    )
    assert not lost and not twice
    # A completed operation was applied; a superseded one at most once (the host may have
    # applied it before a newer revision overtook its record: docs/lifecycles.md).
    assert completed <= set(effects)
    assert set(statuses.values()) <= {OperationStatus.COMPLETED, OperationStatus.SUPERSEDED}
    assert settled_s <= SETTLE_TARGET_S
    # The clients and the workers carried on through the other nodes.
    assert during and applied_during
    assert beat.alive() and all(w.alive() for w in workers if w is not killed)
    assert health_run.returncode == 0, health_run.stdout + health_run.stderr
    assert scrape_run.returncode == 0 and "agent_radar_" in scrape_run.stdout, scrape_run.stderr
    if classic_worker:
        assert "NOT_FOUND - home node" in classic_worker.log_path.read_text()
    # The node rejoined: each queue has its three members online again.
    every = {n.node for n in cluster.nodes}
    eventually(
        lambda: all(set(cluster.queues()[q]["online"]) == every for q in ("default", "celery")),
        timeout_s=60,
        poll_s=0.5,
        what="every queue's three members online",
    )
    eventually(lambda: queue_depth(settings) == 0, what="every message acknowledged")


def _start_workers(stack, cluster, shape: Shape):
    """The fleet's workers, started at once, and (in the full form) a worker on the default
    virtual host, where `celery` is a classic queue on the first node."""
    with ThreadPoolExecutor(shape.workers + 1) as pool:
        starting = [pool.submit(stack.start_worker, concurrency=2) for _ in range(shape.workers)]
        classic = shape.classic_worker and pool.submit(
            stack.start_worker,
            name="classic",
            extra_env={"AGENT_RADAR_BROKER_URL": cluster.url(CLASSIC_VHOST)},
            extra_args=["--pool", "solo"],
        )
        return [w.result() for w in starting], classic and classic.result()


def _hurt_workers(stack, workers, lease_s: float):
    """The full form's worker faults during the outage: the first worker SIGKILLed and a
    replacement started, the second SIGSTOPped past its lease and let go. The one killed."""
    killed = workers[0]
    killed.kill()
    workers.append(stack.start_worker(concurrency=2))
    workers[1].signal_group(signal.SIGSTOP)
    try:
        time.sleep(lease_s + 2)  # past its lease: the sweeper hands its work to another
    finally:
        workers[1].signal_group(signal.SIGCONT)
    return killed

"""RabbitMQ as the production broker (docs/architecture.md): PostgreSQL + RabbitMQ, quorum queues,
real `agent-radar worker` / `beat` subprocesses, each test in a virtual host of its own. The restart
of a RabbitMQ node is in tests/faults/test_broker_restart.py."""

from dataclasses import replace

import pytest

from agent_radar.workflows.adapters.broker import (
    QUEUES,
    kombu_queues,
    transport_options,
)
from agent_radar.workflows.adapters.config import Settings
from tests.conftest import free_port, rabbitmqctl
from tests.helpers import (
    dispatching,
    documented_producer,
    effects_by_operation,
    eventually,
    queue_depth,
)

WS = "ws-rabbit"


@pytest.fixture
def backend():
    return "rabbitmq"


def queue_types(vhost: str) -> dict[str, str]:
    out = rabbitmqctl("list_queues", "-p", vhost, "--quiet", "--no-table-headers", "name", "type")
    return dict(line.split("\t")[:2] for line in out.splitlines() if "\t" in line)


def test_goal_work_runs_on_quorum_queues(settings, rabbitmq_vhost, client, stack, sim_control):
    stack.start_worker(concurrency=2)
    stack.start_worker(concurrency=1)
    last = {}
    for i in range(8):
        client.set_goal(WS, f"s{i}", f"goal {i}", client_submit_id="set")
        last[i] = client.clear_goal(WS, f"s{i}", client_submit_id="clear")
    compaction = client.start_maintenance(WS, "s-m", client_submit_id="m1")
    for i, op in last.items():
        assert client.wait(op, timeout=60).status == "completed"
        assert client.goal_state(WS, f"s{i}").sync_status == "synced"
    assert client.wait(compaction, timeout=60).status == "completed"
    assert all(n == 1 for n in effects_by_operation(sim_control).values())
    assert len(sim_control.effects("maintenance")) == 1
    types = queue_types(rabbitmq_vhost)
    # The work queues are quorum queues; so are the delay queues Celery's native delayed
    # delivery declares for countdown retries (celery_delayed_0 … 27). Celery's default
    # queue is classic, as producers with Celery's defaults declare it.
    assert {name: types[name] for name in QUEUES} == {
        "default": "quorum",
        "maintenance": "quorum",
        "celery": "classic",
    }
    assert types["celery_delayed_0"] == "quorum" and types["celery_delayed_27"] == "quorum"


def test_a_killed_workers_message_is_redelivered(settings, client, stack, sim_control):
    """SIGKILL the worker mid-call: RabbitMQ puts its unacknowledged message back in the
    queue at once (no visibility timeout to wait out); the next worker and the sweeper
    finish the operation, and the agent applied it once."""
    victim = stack.start_worker(concurrency=1)
    sim_control.latency("goal", 2000)
    op = client.set_goal(WS, "killed", "finish me", client_submit_id="1")
    eventually(lambda: dispatching(client, op), what="the dispatch to start")
    assert queue_depth(settings) == 0  # the worker holds the message, unacknowledged
    victim.kill()
    eventually(lambda: queue_depth(settings) == 1, what="the message back in its queue")
    sim_control.latency("goal", 0)
    stack.start_worker(concurrency=1)
    stack.start_beat()
    done = client.wait(op, timeout=90)
    assert done.status == "completed" and done.attempt >= 2
    assert effects_by_operation(sim_control) == {op.operation_id: 1}
    eventually(lambda: queue_depth(settings) == 0, what="the redelivered message acknowledged")


def test_a_countdown_travels_through_native_delayed_delivery(
    settings, rabbitmq_vhost, client, stack, sim_control
):
    """A producer that uses Celery with a countdown (as `Task.retry` does): on quorum queues
    the message waits in RabbitMQ's delay queues, not in a worker's memory, and then arrives
    in the `default` queue like any other.

    The worker's broker URL lists a node that is down first (docs/broker-cluster.md): it
    connects to the next one and sets up the delay queues through it, once
    (tasks/delayed_delivery.py). Celery's own step tried each listed node in turn and held
    the consumer ~9 s on one that refused, at every start and reconnect of every worker."""
    from agent_radar.tasks.app import create_app

    down = f"amqp://guest:guest@127.0.0.1:{free_port()}/{rabbitmq_vhost}"
    worker = stack.start_worker(
        concurrency=1, extra_env={"AGENT_RADAR_BROKER_URL": f"{down};{settings.broker_url}"}
    )
    assert "delayed delivery" not in worker.log_path.read_text()
    producer = create_app(settings)
    try:
        producer.send_task(
            "agent_radar.goal_control",
            kwargs={
                "workspace_id": WS,
                "session_id": "later",
                "action": "set",
                "objective": "in three seconds",
                "client_submit_id": "delayed-1",
            },
            countdown=3,
        )
        # Parked in the delay queues: nothing reached `default`, nothing was written.
        assert queue_depth(settings) == 0
        assert client.list_goal_operations(WS, "later") == []
        ops = eventually(
            lambda: client.list_goal_operations(WS, "later"), timeout_s=60, what="the submit"
        )
    finally:
        producer.close()
    assert client.wait(ops[0], timeout=60).status == "completed"
    assert effects_by_operation(sim_control) == {ops[0].operation_id: 1}


def test_rabbitmq_settings():
    """amqp URLs select RabbitMQ; a Redis-only key prefix beside one is refused, not ignored
    (deployments share a RabbitMQ by virtual host)."""
    env = {"AGENT_RADAR_BROKER_URL": "amqp://agent:secret@mq.internal:5672/radar"}
    settings = Settings.from_env(env)
    assert settings.is_amqp_broker and not settings.is_embedded_broker
    assert transport_options(settings) == {"confirm_publish": True}
    queues = {q.name: q for q in kombu_queues(settings)}
    for name in ("default", "maintenance"):
        assert queues[name].queue_arguments == {"x-queue-type": "quorum"}
        assert (queues[name].exchange.name, queues[name].exchange.type) == (
            f"agent_radar.{name}",
            "topic",
        )
    # Celery's default queue as Celery's and celery-node's defaults declare it.
    assert queues["celery"].queue_arguments is None and queues["celery"].durable
    assert (queues["celery"].exchange.name, queues["celery"].exchange.type) == ("celery", "direct")
    assert "secret" not in repr(settings)
    with pytest.raises(ValueError, match="virtual host"):
        Settings.from_env({**env, "AGENT_RADAR_BROKER_KEY_PREFIX": "team-a:"})
    redis = Settings.from_env({"AGENT_RADAR_BROKER_URL": "redis://cache:6379/0"})
    assert not redis.is_amqp_broker
    assert all(q.queue_arguments is None for q in kombu_queues(redis))


def test_a_cluster_broker_url():
    """Every node of a cluster in one broker URL (docs/broker-cluster.md): RabbitMQ's settings,
    kombu's failover list in the order given, and no node's password in the settings' repr."""
    from agent_radar.workflows.adapters.broker import broker_connection

    nodes = [f"amqp://agent:secret{i}@mq-{i}.internal:5672/radar" for i in range(3)]
    settings = Settings.from_env({"AGENT_RADAR_BROKER_URL": ";".join(nodes)})
    assert settings.is_amqp_broker
    assert transport_options(settings) == {"confirm_publish": True}
    assert all(q.queue_arguments for q in kombu_queues(settings) if q.name != "celery")
    assert "secret" not in repr(settings) and repr(settings).count("agent:********@") == 3
    connection = broker_connection(settings)
    assert connection.alt == nodes and connection.hostname == "mq-0.internal"
    # A password holding a `;` in a single URL is still masked whole.
    assert "pa;ss" not in repr(replace(settings, database_url="postgresql://u:pa;ss@db/radar"))


def test_plain_celery_producers_as_the_docs_show(settings, client, stack, sim_control):
    """A producer with Celery's defaults works on RabbitMQ as it does on Redis (its queue,
    `celery`, is declared as it declares it); so does docs/producers.md's producer for the
    replicated `default` queue."""
    from celery import Celery

    stack.start_worker(concurrency=1)  # declares the queues, as a running fleet has
    kwargs = {"workspace_id": WS, "action": "set", "objective": "hi"}

    defaults = Celery("producer", broker=settings.broker_url)
    try:
        defaults.send_task(
            "agent_radar.goal_control",
            kwargs={**kwargs, "session_id": "defaults", "client_submit_id": "d"},
        )
    finally:
        defaults.close()

    app = documented_producer(settings.broker_url)
    try:
        app.send_task(
            "agent_radar.goal_control",
            kwargs={**kwargs, "session_id": "docs", "client_submit_id": "r"},
        )
    finally:
        app.close()
    ops = [
        eventually(lambda sid=sid: client.list_goal_operations(WS, sid), 60, what=sid)[0]
        for sid in ("defaults", "docs")
    ]
    assert [op.client_submit_id for op in ops] == ["d", "r"]
    assert [client.wait(op, timeout=60).status for op in ops] == ["completed", "completed"]
    assert effects_by_operation(sim_control) == {op.operation_id: 1 for op in ops}


class TestCeleryNodeDefaults:
    """celery-node with its defaults (the queue `celery`, declared as it declares it; an
    exchange `default` of its own) works on RabbitMQ as on Redis, results through Redis."""

    @pytest.fixture
    def settings(self, settings):
        from tests.end_to_end.test_results import RESULTS_REDIS, clean_results

        clean_results()
        yield replace(settings, result_backend=RESULTS_REDIS)
        clean_results()

    def test_a_node_producer_on_rabbitmq(self, settings, stack, sim_control, tmp_path):
        from tests.end_to_end.test_results import check_node_outcomes, run_node_producer

        stack.start_worker(concurrency=1)
        out = run_node_producer(tmp_path, settings.broker_url, settings.result_backend)
        check_node_outcomes(out, sim_control)


def test_an_eta_does_not_hold_the_queue_behind_it(settings, client, stack, sim_control):
    """On quorum queues Celery's prefetch is static: a message held for its ETA would keep a
    slot from every message behind it, so a producer's burst of ETAs (each within the gate's
    limit) stalled the queue for as long as it liked. The gate runs them at once instead."""
    from datetime import UTC, datetime, timedelta

    from celery import Celery

    stack.start_worker(concurrency=1)
    producer = Celery("producer", broker=settings.broker_url)
    later = datetime.now(UTC) + timedelta(seconds=55)
    try:
        for i in range(6):
            producer.send_task(
                "agent_radar.get_operation", kwargs={"operation_id": f"nope-{i}"}, eta=later
            )
        producer.send_task(
            "agent_radar.goal_control",
            kwargs={
                "workspace_id": WS,
                "session_id": "behind",
                "action": "set",
                "objective": "not held",
                "client_submit_id": "b1",
            },
        )
    finally:
        producer.close()
    # Well before the ETAs: the goal behind them was taken and applied.
    ops = eventually(lambda: client.list_goal_operations(WS, "behind"), 20, what="the submit")
    assert client.wait(ops[0], timeout=20).status == "completed"
    assert datetime.now(UTC) < later

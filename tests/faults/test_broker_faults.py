"""A broker fault never exits a worker (docs/security.md): Redis at `maxmemory` refuses
every write (the ack's and the delivery's bookkeeping in a transaction, a publish, a reply),
which used to raise out of the worker's event loop ("Unrecoverable error") on every worker of
that broker at once, none coming back when memory was freed. Here the test's own Redis fills
up under a running worker: the work it takes meanwhile is applied, it logs what it could not
write, and once memory is freed the same worker, with the same pool, applies the next goal."""

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import pytest
import redis

from tests.faults.test_broker_restart import OwnRedis, running_redis
from tests.helpers import effects_by_operation, eventually
from tests.hostile import raw_publish, task_headers

WS = "ws-broker-faults"
MAXMEMORY = "16mb"


@pytest.fixture
def backend():
    return "production"


@pytest.fixture
def full_redis(tmp_path):
    with running_redis(
        tmp_path, "--maxmemory", MAXMEMORY, "--maxmemory-policy", "noeviction"
    ) as server:
        yield server


@pytest.fixture
def settings(settings, full_redis):
    return replace(settings, broker_url=full_redis.url, broker_key_prefix="")


def fill(server: OwnRedis) -> redis.Redis:
    """Fill the server until it refuses writes, and keep it there (its limit lowered to what
    it holds less a megabyte: the message a worker pops must not make room); the client that
    holds the filler keys."""
    probe = redis.Redis(port=server.port)
    chunk = b"x" * (256 * 1024)
    for i in range(10_000):
        try:
            probe.set(f"filler-{i}", chunk)
        except redis.exceptions.ResponseError as exc:
            assert "maxmemory" in str(exc)
            used = probe.info("memory")["used_memory"]
            probe.config_set("maxmemory", used - (1 << 20))
            return probe
    raise AssertionError("the server never filled up")


def free(probe: redis.Redis) -> None:
    for key in probe.scan_iter("filler-*"):
        probe.delete(key)
    probe.config_set("maxmemory", MAXMEMORY)
    probe.close()


def goal_message(session_id: str) -> list:
    kwargs = {
        "workspace_id": WS,
        "session_id": session_id,
        "action": "set",
        "objective": "through a full broker",
        "client_submit_id": "1",
    }
    return [[], kwargs, None]


def test_a_full_redis_never_exits_a_worker(settings, full_redis, client, stack, sim_control):
    worker = stack.start_worker(concurrency=1)
    pool = worker.children()
    raw_publish(settings, goal_message("before"), headers=task_headers())
    before = eventually(lambda: client.find_goal_operation(WS, "before", "1"), what="before")
    assert client.wait(before, timeout=60).status == "completed"

    # Taken while Redis refuses writes: its delivery cannot be recorded as unacknowledged,
    # nor its ack written in a transaction. The worker is paused while the message goes in.
    worker.signal_group(signal.SIGSTOP)
    try:
        raw_publish(settings, goal_message("full"), headers=task_headers())
        filler = fill(full_redis)
    finally:
        worker.signal_group(signal.SIGCONT)
    full = eventually(
        lambda: client.find_goal_operation(WS, "full", "1"), timeout_s=60, what="the goal"
    )
    assert client.wait(full, timeout=60).status == "completed"
    # Some seconds of a full broker: heartbeats, events and the worker's own housekeeping.
    eventually(lambda: "maxmemory" in worker.log_path.read_text(), what="the refusal logged")
    assert worker.alive() and worker.children() == pool

    free(filler)
    raw_publish(settings, goal_message("after"), headers=task_headers())
    after = eventually(
        lambda: client.find_goal_operation(WS, "after", "1"), timeout_s=60, what="after"
    )
    assert client.wait(after, timeout=60).status == "completed"
    assert worker.alive() and worker.children() == pool
    log = worker.log_path.read_text()
    assert "Unrecoverable" not in log
    assert effects_by_operation(sim_control) == {op.operation_id: 1 for op in (before, full, after)}


def test_a_restore_redis_refused_is_made_once_it_takes_writes(tmp_path):
    """When the consumer restarts (a lost connection, a refusal) kombu puts its channel's
    unacknowledged messages back; Redis read-only or full refused that, and the messages
    waited out the visibility timeout (an hour) — a producer's goal with them, found by the
    broker-fault campaign. The restore is tried again until Redis takes it."""
    from kombu import Connection, Exchange, Queue

    from agent_radar.tasks.envelope import REFUSED_RESTORES, GuardedRedisTransport
    from tests.faults.test_broker_restart import running_redis

    with running_redis(tmp_path) as server:
        admin = redis.Redis(port=server.port)
        queue = Queue("q", Exchange("q", type="direct"), routing_key="q")
        with Connection(server.url, transport=GuardedRedisTransport) as conn:
            conn.Producer().publish(
                {"x": 1}, exchange=queue.exchange, routing_key="q", declare=[queue]
            )
            channel = conn.default_channel
            assert queue(channel).get(no_ack=False) is not None  # delivered, unacknowledged
            assert admin.llen("q") == 0
            admin.replicaof("127.0.0.1", 1)  # a failover made it a replica: read-only
            try:
                channel.qos.restore_unacked()  # as the consumer's restart does
                assert admin.llen("q") == 0 and REFUSED_RESTORES
            finally:
                admin.replicaof("NO", "ONE")
            eventually(
                lambda: channel.qos.restore_visible() or admin.llen("q") == 1,
                what="the message back in its queue",
            )
        assert not REFUSED_RESTORES
        admin.close()


def test_a_worker_s_loop_keeps_one_poll_callback_however_often_its_broker_came_back(tmp_path):
    """kombu's Redis transport adds a callback to the worker's event loop each time a
    connection registers with it (once per reconnect) and never removed the last one: after
    the broker-fault campaign's 24,000 reconnects the worker ran as many on every turn of its
    loop and consumed 5 messages a second. The loop keeps the newest only, and it still
    polls: a message published after the last reconnect is read."""
    from kombu import Connection, Exchange, Queue
    from kombu.asynchronous import Hub

    from agent_radar.tasks.envelope import GuardedRedisTransport
    from tests.faults.test_broker_restart import running_redis

    queue = Queue("q", Exchange("q", type="direct"), routing_key="q")
    with running_redis(tmp_path) as server:
        hub = Hub()
        got = []
        connections = []
        try:
            for _ in range(50):  # as many reconnects, each a connection of its own
                conn = Connection(server.url, transport=GuardedRedisTransport)
                connections.append(conn)
                conn.transport.register_with_event_loop(conn.connection, hub)
            assert len(hub.on_tick) == 1
            conn = connections[-1]
            consumer = conn.Consumer([queue], callbacks=[lambda body, m: got.append(body)])
            consumer.consume()
            with Connection(server.url) as producer:
                producer.Producer().publish(
                    {"x": 1}, exchange=queue.exchange, routing_key="q", declare=[queue]
                )
            loop = hub.create_loop()
            for _ in range(200):
                next(loop)
                if got:
                    break
            assert got == [{"x": 1}]
        finally:
            hub.close()
            for conn in connections:
                conn.release()


def test_a_forged_delivery_tag_cannot_take_over_another_message_s_record(tmp_path):
    """On Redis the producer writes a message's delivery tag, and the tag names the worker's
    record of the unacknowledged message (what its restore puts back when it stops). A
    forged message reusing an in-flight message's tag (readable in the `unacked` hash) had
    the gate's refusal of it delete that record, and the message was lost. Each delivery now
    has a tag of the consumer's own: the refusal takes only the forged one's record, and the
    in-flight message is put back."""
    import json

    from kombu import Connection, Exchange, Queue

    from agent_radar.tasks.envelope import GuardedRedisTransport

    queue = Queue("q", Exchange("q", type="direct"), routing_key="q")
    with running_redis(tmp_path) as server:
        admin = redis.Redis(port=server.port, decode_responses=True)
        got = []
        with Connection(server.url, transport=GuardedRedisTransport) as conn:
            conn.Producer().publish(
                {"x": "held"}, exchange=queue.exchange, routing_key="q", declare=[queue]
            )
            consumer = conn.Consumer([queue], callbacks=[lambda body, m: got.append((body, m))])
            consumer.consume()
            conn.drain_events(timeout=5)
            ((held_body, held),) = got
            assert admin.hkeys("unacked") == [held.delivery_tag]
            # The attacker's copy of the held message's envelope, naming its tag.
            envelope, _exchange, _key = json.loads(admin.hget("unacked", held.delivery_tag))
            envelope["body"] = ""
            envelope["properties"]["delivery_tag"] = held.delivery_tag
            admin.lpush("q", json.dumps(envelope))
            conn.drain_events(timeout=5)
            _forged_body, forged = got[1]
            assert forged.delivery_tag != held.delivery_tag
            forged.reject()  # as the gate refuses it
            assert admin.hexists("unacked", held.delivery_tag)
            conn.default_channel.qos.restore_unacked()  # the worker stops
        (item,) = admin.lrange("q", 0, -1)
        assert json.loads(item)["body"] == envelope_body(held_body)
        admin.close()


def envelope_body(body) -> str:
    import base64
    import json

    return base64.b64encode(json.dumps(body).encode()).decode()


def test_an_unacknowledged_entry_that_is_not_a_message_is_dropped_once(tmp_path, caplog):
    """Anyone who may write to Redis may write its `unacked` hash. An entry that is not a
    message aborted kombu's restore, stayed, and was tried again on every round of the
    worker's loop (200,000 of them stalled a worker for a minute a round). Each is removed
    at the first look, all in one log line, and a real message among them is put back."""
    import json

    from agent_radar.tasks import envelope as guard

    with one_held(tmp_path, {"x": "real"}) as (admin, channel, real):
        poison = {
            "not-json": "not json",
            "not-a-triple": json.dumps({"a": 1}),
            "not-an-envelope": json.dumps([{"properties": []}, "q", "q"]),
            "deep": "[" * 5000,
            "headers-null": json.dumps([{**real_envelope(admin), "headers": None}, "q", "q"]),
        }
        poison |= {f"poison-{i}": "x" for i in range(2000)}
        pipe = admin.pipeline(transaction=False)
        for tag, value in poison.items():
            pipe.hset("unacked", tag, value).zadd("unacked_index", {tag: 1})
        pipe.zadd("unacked_index", {real.delivery_tag: 1})  # past its visibility timeout
        pipe.execute()
        with caplog.at_level("ERROR", logger="agent_radar.gate"):
            channel.qos.restore_visible(num=len(poison) + 1, interval=1)
        assert admin.hlen("unacked") == 0 and admin.zcard("unacked_index") == 0
        assert not guard.REFUSED_RESTORES
        dropped = [r for r in caplog.records if "not messages" in r.getMessage()]
        assert len(dropped) == 1 and f"dropped {len(poison)} " in dropped[0].getMessage()
        (item,) = admin.lrange("q", 0, -1)
        assert json.loads(item)["body"] == envelope_body({"x": "real"})


def real_envelope(admin) -> dict:
    """The envelope of the one message held unacknowledged now."""
    import json

    (tag,) = admin.hkeys("unacked")
    return json.loads(admin.hget("unacked", tag))[0]


def test_a_restore_lock_no_scan_holds_is_deleted(tmp_path, caplog, monkeypatch):
    """kombu's restore scan skips its round, silently, while its lock key exists: a key
    set without an expiry (anyone who may write to Redis may) stopped every restore for
    good, and a dead worker's messages were never put back. The scan deletes such a key in
    one log line and restores; a scan's own lock, with its expiry, is left alone."""
    import json

    from agent_radar.tasks import envelope as guard

    monkeypatch.setattr(guard, "FAULT_LOG_INTERVAL_S", 0.0)  # it looks at every round
    with one_held(tmp_path, {"x": "held"}) as (admin, channel, held):
        admin.zadd("unacked_index", {held.delivery_tag: 1})  # past its visibility timeout
        admin.set("unacked_mutex", "a-scan", px=60_000)  # a scan's own: left alone
        channel.qos.restore_visible(interval=1)
        assert admin.hexists("unacked", held.delivery_tag) and admin.exists("unacked_mutex")
        admin.set("unacked_mutex", "attacker")  # no expiry
        with caplog.at_level("ERROR", logger="agent_radar.gate"):
            channel.qos.restore_visible(interval=1)
        assert "no expiry" in caplog.text
        assert not admin.hexists("unacked", held.delivery_tag)
        (item,) = admin.lrange("q", 0, -1)
        assert json.loads(item)["body"] == envelope_body({"x": "held"})


@contextmanager
def one_held(tmp_path, body) -> Iterator[tuple[redis.Redis, Any, Any]]:
    """A Redis of the test's own, a guarded consumer's channel on it, and `body` published
    and taken unacknowledged: (an admin client, the channel, the message)."""
    from kombu import Connection, Exchange, Queue

    from agent_radar.tasks.envelope import GuardedRedisTransport

    queue = Queue("q", Exchange("q", type="direct"), routing_key="q")
    with running_redis(tmp_path) as server:
        admin = redis.Redis(port=server.port, decode_responses=True)
        try:
            with Connection(server.url, transport=GuardedRedisTransport) as conn:
                conn.Producer().publish(
                    body, exchange=queue.exchange, routing_key="q", declare=[queue]
                )
                channel = conn.default_channel
                yield admin, channel, queue(channel).get(no_ack=False)
        finally:
            admin.close()

"""A broker fault never exits a worker (docs/security.md): Redis at `maxmemory` refuses
every write (the ack's and the delivery's bookkeeping in a transaction, a publish, a reply),
which used to raise out of the worker's event loop ("Unrecoverable error") on every worker of
that broker at once, none coming back when memory was freed. Here the test's own Redis fills
up under a running worker: the work it takes meanwhile is applied, it logs what it could not
write, and once memory is freed the same worker, with the same pool, applies the next goal."""

import signal
from dataclasses import replace

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

"""Hostile-input campaign, broker faults: a Redis of the test's own misbehaves under a running
worker in every way a real one can, one fault at a time, drawn at random — it refuses every
write (`maxmemory`), drops the worker's connections (all of them, its subscriptions, or one),
stops answering for a while (a busy script), pauses its clients, turns read-only (a failover
that made it a replica) — while goals keep arriving (docs/security.md: broker faults).

Invariants: a broker fault never exits the worker nor kills a pool process; once the faults end
the worker consumes again without a restart, every goal published is applied exactly once at
the host, no lease is left held and the queue empties. `make fuzz` runs it long
(AGENT_RADAR_FUZZ_EXAMPLES faults); the suite runs a few.
"""

import time
from dataclasses import replace
from itertools import count

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st

from tests.faults.test_broker_restart import running_redis
from tests.faults.test_fuzz import CAMPAIGN, EXAMPLES, FUZZ, Tally, report_tally  # noqa: F401
from tests.faults.test_fuzz_headers import assert_unharmed
from tests.helpers import effects_by_operation
from tests.hostile import raw_publish, task_headers

WS = "ws-broker-fuzz"
# A fault takes up to a second of the worker's time (a reconnect): the suite draws this many.
SUITE_FAULTS = 12
# Nothing listens here: as a replica of it, the server keeps its data and refuses writes.
NO_PRIMARY = ("127.0.0.1", 1)

FAULTS = st.one_of(
    st.tuples(st.just("full"), st.floats(0.01, 0.5)),
    st.tuples(st.just("kill"), st.sampled_from(["normal", "pubsub", "one"])),
    st.tuples(st.just("pause"), st.sampled_from(["ALL", "WRITE"]), st.integers(10, 500)),
    st.tuples(st.just("busy"), st.floats(0.01, 0.5)),
    st.tuples(st.just("read-only"), st.floats(0.01, 0.5)),
)


@pytest.fixture
def backend():
    return "production"


@pytest.fixture
def own_redis(tmp_path):
    with running_redis(tmp_path, "--enable-debug-command", "yes") as server:
        yield server


@pytest.fixture
def settings(settings, own_redis):
    return replace(settings, broker_url=own_redis.url, broker_key_prefix="")


def inflict(admin: redis.Redis, fault: tuple) -> None:
    """One fault, over before this returns (a reconnect after it is the worker's business)."""
    kind = fault[0]
    if kind == "full":
        used = admin.info("memory")["used_memory"]
        admin.config_set("maxmemory", max(used // 2, 1))
        time.sleep(fault[1])
        admin.config_set("maxmemory", 0)
    elif kind == "kill":
        if fault[1] == "one":
            others = [c for c in admin.client_list() if c["name"] != "fault-admin"]
            if others:
                admin.client_kill_filter(_id=others[len(others) // 2]["id"])
        else:
            admin.client_kill_filter(_type=fault[1], skipme=True)
    elif kind == "pause":
        admin.execute_command("CLIENT", "PAUSE", fault[2], fault[1])
        time.sleep(fault[2] / 1000)
    elif kind == "busy":
        admin.execute_command("DEBUG", "SLEEP", f"{fault[1]:.3f}")
    elif kind == "read-only":
        admin.replicaof(*NO_PRIMARY)
        time.sleep(fault[1])
        admin.replicaof("NO", "ONE")


# The backlog a campaign leaves drains at its own pace; a stall this long is a failure.
STALL_S = 120.0


def drained(done, wanted: set, stall_s: float) -> None:
    """Poll `done()` until it holds all of `wanted`; AssertionError once it has not grown for
    `stall_s` (a goal that will never be applied, not a slow queue)."""
    seen, since = -1, time.monotonic()
    while True:
        got = done()
        if got >= wanted:
            return
        if len(got) > seen:
            seen, since = len(got), time.monotonic()
        elif time.monotonic() - since > stall_s:
            raise AssertionError(f"stalled at {len(got)} of {len(wanted)} goals applied")
        time.sleep(1.0)


def admin_len(own_redis, key) -> int:
    """How many items the broker's list (or hash) `key` holds now."""
    client = redis.Redis(port=own_redis.port)
    try:
        return client.llen(key) if client.type(key) == b"list" else client.hlen(key)
    finally:
        client.close()


def publish_goal(settings, session: str) -> bool:
    """A goal for `session`, published as a producer would, retried while the broker is down
    (the producer's side is not what this campaign tests); False if it never went."""
    body = [
        [],
        {
            "workspace_id": WS,
            "session_id": session,
            "action": "set",
            "objective": "through faults",
            "client_submit_id": "1",
        },
        None,
    ]
    for _ in range(50):
        try:
            raw_publish(settings, body, headers=task_headers())
            return True
        except Exception:  # noqa: BLE001 - a broker fault at the producer: try again
            time.sleep(0.1)
    return False


def test_broker_faults(client, stack, settings, sim_control, own_redis):
    worker = stack.start_worker(concurrency=1)
    pool = worker.children()
    admin = redis.Redis(port=own_redis.port, client_name="fault-admin")
    published: list[str] = []
    sessions = count()
    faults = FUZZ if CAMPAIGN else FUZZ.__class__(FUZZ, max_examples=min(EXAMPLES, SUITE_FAULTS))

    @faults
    @given(fault=FAULTS)
    def one(fault):
        session = f"f-{next(sessions)}"
        if publish_goal(settings, session):
            published.append(session)
        inflict(admin, fault)
        Tally.add("broker faults", "redis")

    try:
        one()
    finally:
        admin.config_set("maxmemory", 0)
        admin.replicaof("NO", "ONE")
        admin.close()
    assert publish_goal(settings, "after")
    published.append("after")

    def applied() -> set[str]:
        return {
            session
            for session in published
            if (op := client.find_goal_operation(WS, session, "1")) and op.status == "completed"
        }

    try:
        # A campaign leaves a backlog (one pool process works through every goal, and the
        # reports of its turns, after the faults): it must drain, and never stall.
        drained(applied, set(published), stall_s=STALL_S)
    except AssertionError:
        # What became of the goals that were not applied: never accepted (the message was
        # lost or is still held), or accepted and stuck (which status, which error).
        missing = sorted(set(published) - applied())
        ops = {s: client.find_goal_operation(WS, s, "1") for s in missing}
        held = {k: admin_len(own_redis, k) for k in ("default", "unacked")}
        raise AssertionError(
            f"{len(missing)} goal(s) not applied: "
            + "; ".join(
                f"{s}: " + ("never accepted" if op is None else f"{op.status} {op.last_error}")
                for s, op in ops.items()
            )[:3000]
            + f"; broker holds {held}; worker log tail: {worker.log_path.read_text()[-4000:]}"
        ) from None
    ops = [client.find_goal_operation(WS, session, "1").operation_id for session in published]
    effects = effects_by_operation(sim_control)
    assert {op: effects.get(op) for op in ops} == {op: 1 for op in ops}
    log = worker.log_path.read_text()
    assert "Unrecoverable" not in log
    # The faults reached the worker: it lost its connection or met a refusal, and went on.
    assert "Connection to broker lost" in log or "Redis refused" in log, log[-3000:]
    assert_unharmed(worker, pool, client.engine, "broker faults", "redis")

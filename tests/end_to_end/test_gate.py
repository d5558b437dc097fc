"""Messages that used to fail inside Celery and kombu, before any check of ours ran (issue:
nothing below the guard can stop a worker). Each is published raw, as any producer with broker
access could, to a real worker on the embedded backend, Redis and RabbitMQ; each must be
refused with one log line, and the same worker must apply a normal goal right after."""

import bz2
import json
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select

from agent_radar.beat.sweeper import SWEEPER_LEASE
from agent_radar.models.db import run_transaction
from agent_radar.models.tables import Lease
from tests.helpers import effects_by_operation, eventually, queue_depth, row_counts
from tests.hostile import raw_publish, task_headers

WS = "ws-gate"
GOAL = {"workspace_id": WS, "session_id": "s", "action": "set", "objective": "x"}
FORGED = "[2026-01-01 00:00:00,000: CRITICAL/MainProcess] forged"
# Unpacked, this many zero bytes; packed with bz2 it is about a hundred bytes.
BOMB_BYTES = 128 << 20


@pytest.fixture(params=["embedded", "production", "rabbitmq"])
def backend(request) -> str:
    return request.param


def goal_body(submit_id: str) -> list:
    return [[], dict(GOAL, client_submit_id=submit_id), None]


def rows() -> list[tuple[str, object, dict]]:
    """(what, body, headers) of each message the issue found stopping or burdening a worker."""
    far = "9999-12-31T00:00:00+00:00"
    soon = (datetime.now(UTC) + timedelta(seconds=1)).isoformat()
    return [
        ("a task header that is a list", goal_body("a"), task_headers(task=["agent_radar.sweep"])),
        ("an unknown task with no id", [[], {}, None], {"task": "agent_radar.nope"}),
        (
            "a protocol 1 body whose task is an object",
            {"task": {"x": 1}, "id": str(uuid.uuid4()), "args": [], "kwargs": {}},
            {},
        ),
        (
            "celery.chord_unlock",
            [["g"], {"interval": 1}, None],
            task_headers("celery.chord_unlock"),
        ),
        (
            "celery.starmap",
            [[], {"task": {"task": "agent_radar.sweep"}, "it": [[]] * 50}, None],
            task_headers("celery.starmap"),
        ),
        ("an eta at the end of time", goal_body("eta"), task_headers(eta=far)),
        ("an eta that is a number", goal_body("eta2"), task_headers(eta=12)),
        ("a task id with a newline", goal_body("nl"), task_headers(id="x\n" + FORGED)),
        ("a task id of 300 characters", goal_body("long"), task_headers(id="i" * 300)),
        # Found by the long header campaign: a stamp that is a list failed in Celery's
        # revoked-check after the worker took its one pool slot, which it never gave back.
        (
            "a stamp that is a list",
            goal_body("stamp"),
            task_headers(stamped_headers=[["x"], []], stamps={}),
        ),
        (
            "a stamp that is a list, due in a second",
            goal_body("stamp2"),
            task_headers(stamped_headers=[["x"]], eta=soon),
        ),
        ("an empty eta", goal_body("eta3"), task_headers(eta="")),
    ]


def vm_peak_kib(pid: int) -> int:
    """The process's peak resident memory (VmHWM), KiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError("no VmHWM")


def refused_lines(worker) -> list[str]:
    """The gate's refusals in a worker's log, one line each."""
    return [line for line in worker.log_path.read_text().splitlines() if "rejected" in line]


def apply_good_goal(client, settings, sim_control, submit_id: str):
    raw_publish(settings, goal_body(submit_id), headers=task_headers())
    op = eventually(
        lambda: client.find_goal_operation(WS, "s", submit_id),
        timeout_s=60,
        what="the good message after the bad ones",
    )
    return client.wait(op, timeout=60)


def test_messages_that_failed_inside_celery_are_refused_with_one_line(
    client, stack, settings, sim_control
):
    worker = stack.start_worker(concurrency=1)
    pool = worker.children()
    before = row_counts(client.engine)
    bad = rows()
    for _what, body, headers in bad:
        raw_publish(settings, body, headers=headers)
    assert apply_good_goal(client, settings, sim_control, "good").status == "completed"
    eventually(lambda: queue_depth(settings) == 0, what="an empty queue")

    assert worker.alive() and worker.children() == pool  # the same processes throughout

    # The one due in a second is refused when it comes due.
    eventually(lambda: len(refused_lines(worker)) >= len(bad), what="every bad message refused")
    log = worker.log_path.read_text()
    assert "Restoring" not in log and "Unrecoverable" not in log and "Traceback" not in log
    refused = refused_lines(worker)
    assert len(refused) == len(bad), "\n".join(refused)
    assert not any(line.startswith(FORGED) for line in log.splitlines())
    assert sum("x\\n[2026-01-01" in line for line in refused) == 1  # the id, escaped
    # No built-in ran: chord_unlock would have re-sent itself, starmap run sweeps (which take
    # the sweeper's lease row).
    assert "chord_unlock" not in log.replace("'celery.chord_unlock'", "")
    names = run_transaction(client.engine, lambda s: s.scalars(select(Lease.name)).all())
    assert SWEEPER_LEASE not in names
    after = row_counts(client.engine)
    assert after["goal_operations"] == before["goal_operations"] + 1
    assert effects_by_operation(sim_control) == {
        client.find_goal_operation(WS, "s", "good").operation_id: 1
    }


def test_a_compressed_message_is_refused_before_it_is_unpacked(
    client, stack, settings, sim_control
):
    worker = stack.start_worker(concurrency=1)
    peak_before = vm_peak_kib(worker.pid)
    bomb = bz2.compress(b"\0" * BOMB_BYTES)
    assert len(bomb) < 2048
    raw_publish(
        settings,
        bomb,
        headers=task_headers(compression="application/x-bz2"),
        content_type="application/json",
    )
    raw_publish(
        settings,
        bz2.compress(json.dumps(goal_body("small")).encode()),
        headers=task_headers(compression="bzip2"),
    )
    assert apply_good_goal(client, settings, sim_control, "good").status == "completed"
    eventually(lambda: queue_depth(settings) == 0, what="an empty queue")
    # Unpacking the bomb alone would have raised the peak by its 128 MiB.
    assert vm_peak_kib(worker.pid) - peak_before < 32 * 1024
    log = worker.log_path.read_text()
    assert log.count("compressed messages are refused") == 2, log[-3000:]
    assert client.find_goal_operation(WS, "s", "small") is None


def test_an_eta_within_the_bound_still_runs(client, stack, settings, sim_control):
    """Our own retries carry an ETA (a countdown of at most 30 s): such a message is held
    and runs when due, not refused."""
    stack.start_worker(concurrency=1)
    soon = (datetime.now(UTC) + timedelta(seconds=2)).isoformat()
    raw_publish(settings, goal_body("soon"), headers=task_headers(eta=soon))
    op = eventually(
        lambda: client.find_goal_operation(WS, "s", "soon"), timeout_s=30, what="the ETA"
    )
    assert client.wait(op, timeout=30).status == "completed"


# Envelopes as a producer with Redis access could push them (LPUSH) or broadcast them
# (PUBLISH): kombu parsed each inside the transport's read and stopped the worker.
NOT_ENVELOPES = [
    b"not json",
    b"null",
    b"[1, 2, 3]",
    b'{"properties": 5}',
    b'{"body": "eA==", "properties": {"delivery_tag": "t", "body_encoding": "base64"},'
    b' "headers": [1], "content-type": "application/json"}',
    b'{"body": "eA==", "properties": {"delivery_tag": "t2", "body_encoding": "rot13"},'
    b' "headers": {}, "content-type": "application/json"}',
    b'{"body": 7, "properties": {"delivery_tag": ["x"], "body_encoding": "base64"},'
    b' "headers": {"task": "agent_radar.sweep"}, "content-type": "application/json"}',
    # kombu counts a KeyError as a lost connection and redis-py's DataError as a channel
    # error: each of these restarted the consumer, cancelling every running task.
    b"{}",
    b'{"body": "eA==", "properties": {"delivery_tag": "t3", "body_encoding": "base64",'
    b' "delivery_info": {"routing_key": "default"}}, "headers": {},'
    b' "content-type": "application/json"}',
    b'{"body": "eA==", "properties": {"delivery_tag": null, "body_encoding": "base64",'
    b' "delivery_info": {"exchange": "default", "routing_key": "default"}}, "headers": {},'
    b' "content-type": "application/json"}',
    # kombu decodes the body as it builds the message: on the filesystem, outside any guard
    # ("Unrecoverable error").
    b'{"body": "a", "properties": {"delivery_tag": "t4", "body_encoding": "base64",'
    b' "delivery_info": {"exchange": "default", "routing_key": "default"}}, "headers": {},'
    b' "content-type": "application/json"}',
    # Properties the worker would keep with a held message and hand to the pool.
    b'{"body": "eA==", "properties": {"delivery_tag": "t5", "body_encoding": "base64",'
    b' "delivery_info": {"exchange": "default", "routing_key": "default"}, "x": "'
    + b"y" * 5000
    + b'"}, "headers": {}, "content-type": "application/json"}',
]


@pytest.mark.parametrize("backend", ["production"], indirect=True)
def test_a_redis_item_that_is_no_envelope_is_dropped(client, stack, settings, sim_control):
    import redis

    worker = stack.start_worker(concurrency=1)
    pool = worker.children()
    r = redis.Redis.from_url(settings.broker_url)
    try:
        for item in NOT_ENVELOPES:
            r.lpush(f"{settings.broker_key_prefix}default", item)
        # the workers' remote control channel (kombu's fanout topic for `celery.pidbox`)
        pidbox = f"{settings.broker_key_prefix}/{r.connection_pool.connection_kwargs['db']}"
        eventually(lambda: r.publish(f"{pidbox}.celery.pidbox", b"[1]"), what="a subscriber")
        for item in NOT_ENVELOPES[1:]:
            r.publish(f"{pidbox}.celery.pidbox", item)
    finally:
        r.close()
    assert apply_good_goal(client, settings, sim_control, "good").status == "completed"
    assert worker.alive() and worker.children() == pool
    log = worker.log_path.read_text()
    assert "Unrecoverable" not in log and "Traceback" not in log
    assert "Connection to broker lost" not in log and "Restoring" not in log
    assert log.count("dropped a Redis item that is not a message envelope") == len(NOT_ENVELOPES)
    # (the broadcast that is not JSON at all is kombu's own one line)
    dropped = log.count("dropped a Redis broadcast") + log.count("Cannot process event")
    assert dropped == len(NOT_ENVELOPES)


def test_remote_control_that_changes_a_worker_is_not_obeyed(client, stack, settings, sim_control):
    """Any producer may broadcast remote control commands; a worker obeys none that would
    stop it, restart its pool or point it at another queue, and still answers a ping."""
    from agent_radar.tasks.app import create_app

    worker = stack.start_worker(concurrency=1)
    pool = worker.children()
    app = create_app(settings)
    try:
        app.control.add_consumer("elsewhere", reply=False)
        app.control.pool_restart(reply=False)
        app.control.broadcast("shutdown")
        replies = eventually(lambda: app.control.ping(timeout=1), what="a ping answered")
        assert len(replies) == 1
        # The one worker's answer is all there is to wait for (limit=1), not the timeout.
        queues = eventually(lambda: app.control.inspect(timeout=1, limit=1).active_queues())
        assert "elsewhere" not in {q["name"] for q in next(iter(queues.values()))}
        # Flower's worker pages read these; each answer goes out as JSON.
        assert eventually(lambda: app.control.inspect(timeout=1, limit=1).stats())
    finally:
        app.close()
    assert apply_good_goal(client, settings, sim_control, "good").status == "completed"
    assert worker.alive() and worker.children() == pool


@pytest.mark.parametrize("backend", ["production"], indirect=True)
def test_past_the_held_limit_an_eta_message_runs_at_once(client, stack, settings, sim_control):
    """The worker holds at most ETA_HELD_MAX messages for their ETA; those past it run at
    once, so a flood of ETAs cannot grow its memory."""
    from agent_radar.tasks.gate import ETA_HELD_MAX

    stack.start_worker(concurrency=1)
    later = (datetime.now(UTC) + timedelta(seconds=55)).isoformat()
    extra = 3
    for i in range(ETA_HELD_MAX + extra):
        body = [[], dict(GOAL, session_id=f"eta-{i}", client_submit_id="1"), None]
        raw_publish(settings, body, headers=task_headers(eta=later))
    eventually(lambda: queue_depth(settings) == 0, what="every message taken")
    ran = eventually(
        lambda: (lambda n: n >= extra and n)(row_counts(client.engine)["goal_operations"]),
        what="the messages past the limit",
    )
    assert ran == extra  # the others wait for their ETA, still 50 s away


@pytest.mark.parametrize("backend", ["embedded"], indirect=True)
def test_a_message_file_that_is_no_envelope_is_dropped(client, stack, settings, sim_control):
    """On the filesystem transport (the embedded default) any file in a queue that was not
    a message envelope stopped the worker ("Unrecoverable error")."""
    from agent_radar.workflows.adapters.broker import broker_folders

    worker = stack.start_worker(concurrency=1)
    pool = worker.children()
    queue = broker_folders(settings)["queue"]
    for i, item in enumerate([b"not json", b"[]", b'{"properties": {}}', *NOT_ENVELOPES]):
        (queue / f"{i:04d}_{uuid.uuid4()}.default.msg").write_bytes(item)
    assert apply_good_goal(client, settings, sim_control, "good").status == "completed"
    assert worker.alive() and worker.children() == pool
    log = worker.log_path.read_text()
    assert "Unrecoverable" not in log
    assert log.count("dropped a message file that is not a message envelope") == 3 + len(
        NOT_ENVELOPES
    )

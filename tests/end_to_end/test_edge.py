"""The edge admits only what this product's own producers send (docs/security.md). Each input
below was found, by a review that read the gate and went around it, to kill pool processes,
hold the sweeper's lease, grow a worker's memory, revoke a producer's task, grow Flower's
metrics or forge a log line. Each is sent raw, as any producer with broker access could, to a
real worker on the embedded backend, Redis and RabbitMQ: each is refused (or answered without
what it sought), no pool process changes, nothing is written, and the same worker applies a
normal goal right after."""

import json
import subprocess
import sys
import textwrap
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select

from agent_radar.beat.sweeper import SWEEPER_LEASE
from agent_radar.models.db import run_transaction
from agent_radar.models.tables import Lease
from tests.end_to_end.test_gate import (
    BOMB_BYTES,
    apply_good_goal,
    goal_body,
    refused_lines,
    vm_peak_kib,
)
from tests.helpers import effects_by_operation, eventually, queue_depth, row_counts
from tests.hostile import raw_broadcast, raw_publish, task_headers

WS = "ws-gate"  # test_gate's goal body
FORGED = "[2026-01-01 00:00:00,000: CRITICAL/MainProcess] forged"


@pytest.fixture(params=["embedded", "production", "rabbitmq"])
def backend(request) -> str:
    return request.param


def outside_the_allow_list() -> list[tuple[str, object, dict, str]]:
    """(what, body, headers, the refusal's words) of each message the review sent."""
    sweep = [[], {}, None]
    return [
        # Celery's order is [hard, soft]: the soft limit fired inside a database call, the
        # hard one SIGKILLed the pool process with every host call its drain had in flight.
        *(
            (
                "a goal with a time limit",
                goal_body(f"tl-{i}"),
                task_headers(timelimit=[0.002, 0.001]),
                "header 'timelimit' must be",
            )
            for i in range(5)
        ),
        # The process died holding the sweeper's lease: no sweep for its 30 s.
        (
            "a sweep with a time limit",
            sweep,
            task_headers("agent_radar.sweep", timelimit=[0.0082, 0.008]),
            "header 'timelimit' must be",
        ),
        (
            "a soft limit alone",
            goal_body("soft"),
            task_headers(timelimit=[None, 0.5]),
            "header 'timelimit' must be",
        ),
        # Each distinct shadow was 26 new series in Flower's /metrics, and the logs showed the
        # goal under another task's name.
        *(
            (
                "a shadow name",
                goal_body(f"shadow-{i}"),
                task_headers(shadow=f"agent_radar.other-{i}"),
                "header 'shadow' must be",
            )
            for i in range(5)
        ),
        # 2**retries on the retry path.
        (
            "a retry count of 10**11",
            goal_body("retries"),
            task_headers(retries=10**11),
            "header 'retries' must be",
        ),
        (
            "a header nobody sends",
            goal_body("x"),
            task_headers(x=[{}, {}, {}]),
            "header 'x' is not one this service sends",
        ),
        (
            "a header whose name forges a line",
            goal_body("nl"),
            task_headers(**{"x\n" + FORGED: 1}),
            "is not one this service sends",
        ),
        # Celery's conversion of this ETA overflowed (a traceback, and with a result backend
        # a FAILURE row under the message's id); an expired message was marked REVOKED.
        (
            "an eta that overflows in UTC",
            goal_body("eta-overflow"),
            task_headers(eta="0001-01-01T00:00:00+14:00"),
            "header 'eta' is not an ISO 8601 date",
        ),
        # ... and a REVOKED row under any id, expired or due after its expiry.
        (
            "an expiry on a task whose result is kept",
            goal_body("expired"),
            task_headers(expires="2000-01-01T00:00:00+00:00"),
            "header 'expires' is not taken on a task whose result is kept",
        ),
        (
            "an expiry before its eta",
            goal_body("expires-first"),
            task_headers(
                eta=(datetime.now(UTC) + timedelta(seconds=5)).isoformat(),
                expires=(datetime.now(UTC) + timedelta(seconds=2)).isoformat(),
            ),
            "header 'expires' is not taken on a task whose result is kept",
        ),
        (
            "a sweep that has expired",
            sweep,
            task_headers("agent_radar.sweep", expires="2001-01-01T00:00:00+00:00"),
            "header 'expires' has passed",
        ),
        # A message's ignore_result overrides its task's: a sweep stored a SUCCESS over a
        # producer's result, an expiring prompt dispatch a REVOKED under a pending id.
        (
            "a sweep that keeps its result",
            sweep,
            task_headers("agent_radar.sweep", ignore_result=False),
            "header 'ignore_result' must be",
        ),
        (
            "an internal task that keeps its result and expires",
            [[], {"workspace_id": WS, "session_id": "s"}, None],
            task_headers(
                "agent_radar.prompt.dispatch",
                ignore_result=False,
                expires=(datetime.now(UTC) + timedelta(seconds=60)).isoformat(),
            ),
            "header 'ignore_result' must be",
        ),
        (
            "a group index past any group",
            goal_body("prio"),
            task_headers(group_index=10**12),
            "header 'group_index' must be",
        ),
    ]


def test_headers_outside_the_allow_list_are_refused_and_no_pool_process_dies(
    client, stack, settings, sim_control
):
    worker = stack.start_worker(concurrency=1)
    pool = worker.children()
    before = row_counts(client.engine)
    bad = outside_the_allow_list()
    for _what, body, headers, _words in bad:
        raw_publish(settings, body, headers=headers)
    assert apply_good_goal(client, settings, sim_control, "good").status == "completed"
    eventually(lambda: queue_depth(settings) == 0, what="an empty queue")
    eventually(lambda: len(refused_lines(worker)) >= len(bad), what="every message refused")

    assert worker.alive() and worker.children() == pool  # no pool process killed or replaced
    refused = refused_lines(worker)
    assert len(refused) == len(bad), "\n".join(refused)
    for what, _body, _headers, words in bad:
        assert sum(words in line for line in refused) >= 1, what
    log = worker.log_path.read_text()
    assert "Restoring" not in log and "Traceback" not in log and "Hard time limit" not in log
    assert "SoftTimeLimitExceeded" not in log and "Couldn't convert ETA" not in log
    assert not any(line.startswith(FORGED) for line in log.splitlines())
    # Nothing written: no operation but the good one, and the sweeper's lease never taken.
    names = run_transaction(client.engine, lambda s: s.scalars(select(Lease.name)).all())
    assert SWEEPER_LEASE not in names
    assert row_counts(client.engine)["goal_operations"] == before["goal_operations"] + 1
    good = client.find_goal_operation(WS, "s", "good")
    assert effects_by_operation(sim_control) == {good.operation_id: 1}


def test_the_product_s_own_time_limits_and_a_sweep_without_one_are_admitted(
    client, stack, settings, sim_control
):
    """What beat sends (the worker's own [hard, soft] limits copied from the configuration)
    and a sweep from anyone: internal tasks are safe to receive."""
    from agent_radar.tasks.strict import TASK_SOFT_TIME_LIMIT_S, TASK_TIME_LIMIT_S

    worker = stack.start_worker(concurrency=1)
    pool = worker.children()
    limits = [TASK_TIME_LIMIT_S, TASK_SOFT_TIME_LIMIT_S]
    raw_publish(settings, goal_body("own-limits"), headers=task_headers(timelimit=limits))
    raw_publish(settings, [[], {}, None], headers=task_headers("agent_radar.sweep"))
    op = eventually(lambda: client.find_goal_operation(WS, "s", "own-limits"), what="the goal")
    assert client.wait(op, timeout=60).status == "completed"
    eventually(lambda: queue_depth(settings) == 0, what="an empty queue")
    assert refused_lines(worker) == []
    assert worker.alive() and worker.children() == pool


def test_an_oversized_message_is_dropped_before_it_is_decoded(
    client, stack, settings, sim_control, backend
):
    """A 48 MB header of `[{}, {}, …]` took a worker's main process from 102 to 1,815 MB. Each
    transport drops an item over MAX_ENVELOPE_BYTES before decoding it; on RabbitMQ a header
    frame is bounded by the connection's frame size, so there the big part is the body."""
    worker = stack.start_worker(concurrency=1)
    pool = worker.children()
    peak_before = vm_peak_kib(worker.pid)
    if backend == "rabbitmq":
        body = [[], dict(goal_body("big")[1], objective="o" * (8 << 20)), None]
        raw_publish(settings, body, headers=task_headers())
    else:
        # 8 MB of JSON: as Python objects, about 2 million dicts (well over 100 MB).
        raw_publish(settings, goal_body("big"), headers=task_headers(x=[{}] * (2 << 20)))
    assert apply_good_goal(client, settings, sim_control, "good").status == "completed"
    eventually(lambda: queue_depth(settings) == 0, what="an empty queue")
    assert worker.alive() and worker.children() == pool
    assert vm_peak_kib(worker.pid) - peak_before < 32 * 1024
    log = worker.log_path.read_text()
    assert "dropped a" in log or "no body (or one of over" in log, log[-3000:]
    assert client.find_goal_operation(WS, "s", "big") is None


def test_remote_control_cannot_revoke_forge_a_line_or_read_arguments(
    client, stack, settings, sim_control, backend
):
    from agent_radar.tasks.app import create_app

    worker = stack.start_worker(concurrency=1)
    pool = worker.children()
    app = create_app(settings)
    task_id = str(uuid.uuid4())
    try:
        eventually(lambda: app.control.ping(timeout=1), what="a ping answered")
        # `hello` merged the ids it was sent into every worker's revoked set for 3 hours.
        app.control.broadcast(
            "hello", arguments={"from_node": "intruder", "revoked": [task_id]}, reply=False
        )
        app.control.broadcast("revoke", arguments={"task_id": task_id}, reply=False)
        # kombu logged the traceback of an unknown argument unescaped: a forged log line.
        app.control.broadcast("heartbeat", arguments={f"x\n{FORGED}\x1b[31m": 1}, reply=False)
        app.control.broadcast("ping", arguments={"pattern": "(a+)+$"}, reply=False)
        eventually(
            lambda: worker.log_path.read_text().count("refused a remote control command") >= 4,
            what="the commands refused",
        )
        revoked = eventually(lambda: app.control.inspect(timeout=1, limit=1).revoked())
        assert next(iter(revoked.values())) == []
        # A producer's task that carries that id is applied, not discarded.
        raw_publish(settings, goal_body("revoked-id"), headers=task_headers(id=task_id))
        op = eventually(lambda: client.find_goal_operation(WS, "s", "revoked-id"), what="it")
        assert client.wait(op, timeout=60).status == "completed"
        if backend != "rabbitmq":  # there no message is held for its ETA (docs/security.md)
            _scheduled_shows_no_prompt_text(app, settings)
    finally:
        app.close()
    log = worker.log_path.read_text()
    assert not any(line.startswith(FORGED) for line in log.splitlines())
    assert "\x1b[31m" not in log and "Traceback" not in log
    assert apply_good_goal(client, settings, sim_control, "good").status == "completed"
    assert worker.alive() and worker.children() == pool


def _scheduled_shows_no_prompt_text(app, settings) -> None:
    """`inspect scheduled` showed another tenant's prompt text to any broker client."""

    secret = f"secret-{uuid.uuid4().hex}"
    body = [
        [],
        {"workspace_id": WS, "session_id": "p", "text": secret, "client_submit_id": "p1"},
        None,
    ]
    later = (datetime.now(UTC) + timedelta(seconds=50)).isoformat()
    raw_publish(settings, body, headers=task_headers("agent_radar.submit_prompt", eta=later))

    def held():
        replies = app.control.inspect(timeout=1, limit=1).scheduled() or {}
        return next((r for r in replies.values() if r), None)

    scheduled = eventually(held, what="the prompt held for its ETA")
    assert secret not in repr(scheduled)
    assert scheduled[0]["request"]["name"] == "agent_radar.submit_prompt"
    for command in ("active", "reserved"):
        answer = getattr(app.control.inspect(timeout=1, limit=1), command)()
        assert secret not in repr(answer)


@pytest.mark.parametrize("backend", ["production"], indirect=True)
def test_flower_s_metrics_answer_only_behind_its_auth(settings, client, stack):
    """Flower's /metrics answered anyone, and every distinct `shadow` or task name any broker
    client put in an event made 26 series more (300 messages: 19 KB to 63 MB)."""
    import urllib.error
    import urllib.request

    from tests.end_to_end.test_flower_browser import Flower

    stack.start_worker(concurrency=1)
    flower = Flower(stack)
    eventually(flower.sees_a_worker, 60, what="Flower to see the worker")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(flower.base + "/metrics", timeout=10)
    assert refused.value.code == 401
    with urllib.request.urlopen(flower.base + "/healthcheck", timeout=10) as answer:
        assert answer.read() == b"OK"
    # Events from anyone: a task name of no task of ours makes no series.
    from agent_radar.tasks.app import create_app

    peak_before = vm_peak_kib(flower.proc.pid)
    app = create_app(settings)
    try:
        with app.events.default_dispatcher(hostname="intruder@x") as dispatcher:
            # 8 MB of `[{}, {}, …]`, over 150 MB decoded: read through the guarded transport
            # and dropped undecoded (its raw bytes pass through the client's buffers).
            dispatcher.send(
                "task-received",
                uuid=str(uuid.uuid4()),
                name="agent_radar.goal_control",
                args=[{}] * (2 << 20),
                kwargs="",
            )
            for i in range(20):
                dispatcher.send(
                    "task-received", uuid=str(uuid.uuid4()), name=f"forged-{i}", args="", kwargs=""
                )
    finally:
        app.close()
    # A goal through the public task, whose events Flower counts.
    assert apply_good_goal(client, settings, None, "after-events").status == "completed"
    eventually(
        lambda: "agent_radar.goal_control" in _metrics(flower), what="the goal in the metrics"
    )
    text = _metrics(flower)
    assert "forged-" not in text and "intruder" not in text
    assert vm_peak_kib(flower.proc.pid) - peak_before < 96 * 1024


def _metrics(flower) -> str:
    import base64
    import urllib.request

    from tests.end_to_end.test_flower_browser import AUTH

    request = urllib.request.Request(flower.base + "/metrics")
    request.add_header(
        "Authorization", "Basic " + base64.b64encode(":".join(AUTH).encode()).decode()
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        return answer.read().decode()


def test_retry_countdown_never_raises_two_to_a_producer_s_number():
    from agent_radar.tasks.strict import PUBLIC_RETRY_MAX_S, retry_countdown_s

    assert retry_countdown_s(0) == 1.0
    assert retry_countdown_s(3) == 8.0
    assert retry_countdown_s(10**11) == PUBLIC_RETRY_MAX_S
    assert retry_countdown_s(-5) == 1.0
    assert retry_countdown_s("9" * 50) == 1.0
    assert retry_countdown_s(True) == 1.0


def test_a_body_is_never_unpacked_by_its_content_encoding(
    client, stack, settings, sim_control, backend
):
    """kombu decodes a body of content type `application/data` with whatever codec its
    `content_encoding` names: 785 bytes of `bz2_codec` took a worker's main process to 2.2 GB,
    and the same envelope broadcast to every worker's mailbox did it to all of them."""
    import bz2

    from agent_radar.tasks.app import create_app

    worker = stack.start_worker(concurrency=1)
    pool = worker.children()
    peak_before = vm_peak_kib(worker.pid)
    bomb = bz2.compress(b"\0" * BOMB_BYTES, 9)
    assert len(bomb) < 2048
    for content_type in ("application/data", "application/text"):
        raw_publish(
            settings,
            bomb,
            headers=task_headers(),
            content_type=content_type,
            content_encoding="bz2_codec",
        )
    # A JSON body in another encoding is refused too: our producers send UTF-8.
    raw_publish(
        settings,
        json.dumps(goal_body("latin")).encode(),
        headers=task_headers(),
        content_encoding="latin-1",
    )
    app = create_app(settings)
    try:
        eventually(lambda: app.control.ping(timeout=1), what="a ping answered")
        raw_broadcast(app, bomb, content_type="application/data", content_encoding="bz2_codec")
        assert eventually(lambda: app.control.ping(timeout=1), what="a ping after the bomb")
    finally:
        app.close()
    assert apply_good_goal(client, settings, sim_control, "good").status == "completed"
    eventually(lambda: queue_depth(settings) == 0, what="an empty queue")
    assert worker.alive() and worker.children() == pool
    assert vm_peak_kib(worker.pid) - peak_before < 32 * 1024
    log = worker.log_path.read_text()
    assert log.count("is not JSON") == 2 and "content encoding 'latin-1'" in log, log[-3000:]
    assert client.find_goal_operation(WS, "s", "latin") is None


def test_a_message_kombu_restored_is_admitted(client, stack, settings, sim_control):
    """kombu marks a message it restores on Redis (a lost connection, the visibility
    timeout, a worker's stop) with `redelivered`: the allow-list refused it, and a producer's
    goal was lost for good."""
    stack.start_worker(concurrency=1)
    raw_publish(settings, goal_body("restored"), headers=task_headers(redelivered=True))
    op = eventually(lambda: client.find_goal_operation(WS, "s", "restored"), what="the goal")
    assert client.wait(op, timeout=60).status == "completed"


@pytest.mark.parametrize("backend", ["rabbitmq"], indirect=True)
def test_a_timestamp_past_time_t_in_a_header_table_is_dropped(
    client, stack, settings, sim_control, monkeypatch
):
    """py-amqp turns an AMQP timestamp into a datetime while it decodes a message's
    properties: 2**63 + 5 raised OverflowError ("Unrecoverable error": the worker exited, and
    the message went back for the next one), 2**62 an OSError, a lost connection to kombu
    (223 consumer restarts, and nothing consumed). A broadcast did it to every worker."""
    import calendar

    from agent_radar.tasks.app import create_app

    worker = stack.start_worker(concurrency=1)
    pool = worker.children()
    marker = datetime(2001, 1, 1)
    timegm = calendar.timegm
    values = iter([2**63 + 5, 2**62, 2**63 + 5])
    monkeypatch.setattr(
        calendar,
        "timegm",
        lambda t: next(values) if t[:3] == (2001, 1, 1) else timegm(t),
    )
    for submit_id in ("t-overflow", "t-oserror"):
        raw_publish(
            settings, goal_body(submit_id), headers=task_headers(**{"x-death": [{"time": marker}]})
        )
    app = create_app(settings)
    try:
        eventually(lambda: app.control.ping(timeout=1), what="a ping answered")
        raw_broadcast(app, {"method": "ping"}, headers={"clock": 1, "when": marker})
        monkeypatch.undo()
        assert eventually(lambda: app.control.ping(timeout=1), what="a ping after it")
    finally:
        app.close()
    assert apply_good_goal(client, settings, sim_control, "good").status == "completed"
    assert worker.alive() and worker.children() == pool
    log = worker.log_path.read_text()
    assert "Unrecoverable" not in log and "Connection to broker lost" not in log
    for submit_id in ("t-overflow", "t-oserror"):
        assert client.find_goal_operation(WS, "s", submit_id) is None


def test_flower_keeps_short_events_of_our_tasks_only():
    """Flower keeps up to 10,000 tasks: 1,500 events of 380 KiB each took it to 1 GB."""
    from agent_radar.tasks.app import app
    from agent_radar.tasks.flower_view import MAX_EVENT_TEXT, MAX_WORKERS, event_kept

    app.loader.import_default_modules()  # our task names, as Flower's process knows them

    def received(**fields):
        return {
            "type": "task-received",
            "hostname": "w@x",
            "name": "agent_radar.goal_control",
            **fields,
        }

    workers: dict[str, float] = {}
    long = received(args="a" * (380 << 10), uuid="u1")
    assert event_kept(long, workers) and len(long["args"]) <= MAX_EVENT_TEXT + 3
    assert not event_kept(received(args=[{}] * 1000), workers)
    assert not event_kept(received(**{f"f{i}": i for i in range(100)}), workers)
    assert not event_kept(received(name="forged"), workers)
    assert not event_kept(received(hostname="a\nb"), workers)
    assert not event_kept({**received(), "type": "task-custom"}, workers)
    heartbeat = {"type": "worker-heartbeat", "hostname": "w@x", "loadavg": [0.1, 0.2, 0.3]}
    assert event_kept(heartbeat, workers)
    # Full of workers heard from lately, a new name is dropped; once some have gone quiet
    # (a worker restarts under a new name), they are forgotten and the new one is taken.
    many = {f"w{i}@x": 1000.0 for i in range(MAX_WORKERS)}
    forgotten: list = []
    assert not event_kept(received(hostname="one-more@x"), many, forgotten.extend, now=1030.0)
    assert forgotten == [] and len(many) == MAX_WORKERS
    many["w7@x"] = 1050.0
    assert event_kept(received(hostname="one-more@x"), many, forgotten.extend, now=1070.0)
    assert sorted(forgotten) == sorted(f"w{i}@x" for i in range(MAX_WORKERS) if i != 7)
    assert set(many) == {"w7@x", "one-more@x"}


def test_flower_forgets_a_quiet_worker_with_its_series_when_a_new_one_comes():
    """In Flower itself (its events state and its metrics; in a process of its own, as
    `install` changes Flower and kombu for good): at the cap of worker names, the ones gone
    quiet are forgotten, their series with them, and the new worker is shown."""
    script = textwrap.dedent(
        """
        import json, time
        from flower.events import EventsState
        from agent_radar.tasks import flower_view

        flower_view.install()
        flower_view.MAX_WORKERS = 3
        flower_view.WORKER_GONE_S = -1.0  # every other one is quiet
        state = EventsState(max_tasks_in_memory=100)
        for name in ("old-a@x", "old-b@x", "old-c@x", "new@x"):
            now = time.time()
            state.event({"type": "worker-heartbeat", "hostname": name, "timestamp": now,
                         "local_received": now})
            if name == "old-c@x":
                before = sorted(state.workers)
        series = sorted(labels[0] for labels in state.metrics.worker_online._metrics)
        print(json.dumps({"before": before, "after": sorted(state.workers), "series": series}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {
        "before": ["old-a@x", "old-b@x", "old-c@x"],
        "after": ["new@x"],
        "series": ["new@x"],
    }


@pytest.mark.parametrize("backend", ["production"])  # Redis: the publisher writes the tag
def test_a_refused_message_with_an_in_flight_message_s_tag_loses_nothing(
    client, stack, settings, sim_control
):
    """A producer's goal held by the worker (its ETA to come) sits in Redis's `unacked` hash
    under its delivery tag, which anyone with broker access can read. A forged message
    naming that tag was refused, and the refusal deleted the held goal's record: at the
    worker's stop nothing was put back, and the goal was never accepted. Counted at the
    host: the held goal is applied once, by the next worker."""
    import redis

    worker = stack.start_worker(concurrency=1)
    admin = redis.Redis.from_url(settings.broker_url, decode_responses=True)
    unacked = f"{settings.broker_key_prefix}unacked"
    eta = (datetime.now(UTC) + timedelta(seconds=6)).isoformat()
    raw_publish(settings, goal_body("held"), headers=task_headers(eta=eta))
    (tag,) = eventually(lambda: admin.hkeys(unacked), what="the held goal, unacknowledged")
    envelope, _exchange, _key = json.loads(admin.hget(unacked, tag))
    forged = dict(envelope, body="", headers={"task": "not.ours", "id": "attacker"})
    forged["properties"] = dict(envelope["properties"], delivery_tag=tag)
    admin.lpush(f"{settings.broker_key_prefix}default", json.dumps(forged))
    eventually(lambda: len(refused_lines(worker)) == 1, what="the forged message refused")
    assert admin.hexists(unacked, tag)
    worker.stop()  # before the held goal's ETA: it goes back to its queue
    assert client.find_goal_operation(WS, "s", "held") is None
    stack.start_worker(concurrency=1)
    op = eventually(
        lambda: client.find_goal_operation(WS, "s", "held"), timeout_s=60, what="the held goal"
    )
    assert client.wait(op, timeout=60).status == "completed"
    assert effects_by_operation(sim_control) == {op.operation_id: 1}
    admin.close()

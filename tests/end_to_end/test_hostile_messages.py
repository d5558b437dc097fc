"""Hostile broker messages against real worker processes, on both backends (issue: no message
can take the fleet down). Each message is published raw with kombu, the way any producer or
attacker with broker access could; then a good message proves the same worker went on."""

import json
import os
import socket
import subprocess
import sys
import textwrap
import uuid

import pytest

from tests.helpers import effects_by_operation, eventually, row_counts
from tests.hostile import raw_publish, task_headers

WS = "ws-hostile"


GOOD_KWARGS = {
    "workspace_id": WS,
    "session_id": "s",
    "action": "set",
    "objective": "x",
    "client_submit_id": "c",
}
# (what it is, body, headers, content type)
MALFORMED = [
    ("a JSON string body", "just a string", task_headers(), "application/json"),
    ("a body of two items", [[], {}], task_headers(), "application/json"),
    ("kwargs not an object", [[], ["a"], {}], task_headers(), "application/json"),
    ("args not a list", ["a", GOOD_KWARGS, None], task_headers(), "application/json"),
    ("embed not an object", [[], GOOD_KWARGS, "embed"], task_headers(), "application/json"),
    (
        "a callback in embed",
        [[], GOOD_KWARGS, {"callbacks": [{"task": "agent_radar.sweep"}]}],
        task_headers(),
        "application/json",
    ),
    ("bad JSON", b"{not json", task_headers(), "application/json"),
    ("invalid UTF-8", b"\xff\xfe[[],{},{}]", task_headers(), "application/json"),
    ("a pickle", b"\x80\x04N.", task_headers(), "application/x-python-serialize"),
    ("no headers at all", [[], GOOD_KWARGS, None], {}, "application/json"),
    (
        "no task id",
        [[], GOOD_KWARGS, None],
        {"task": "agent_radar.goal_control"},
        "application/json",
    ),
    ("a task id that is a number", [[], GOOD_KWARGS, None], task_headers(id=7), "application/json"),
    ("a bad eta", [[], GOOD_KWARGS, None], task_headers(eta="the day after"), "application/json"),
    (
        "a bad time limit",
        [[], GOOD_KWARGS, None],
        task_headers(timelimit="soon"),
        "application/json",
    ),
    (
        "a negative retry count",
        [[], GOOD_KWARGS, None],
        task_headers(retries=-3),
        "application/json",
    ),
    (
        "a protocol 1 body with args not a list",
        {"task": "agent_radar.goal_control", "id": "p1", "args": "x", "kwargs": {}},
        {},
        "application/json",
    ),
    (
        "a body over the size limit",
        [[], dict(GOOD_KWARGS, objective="o" * (300 << 10)), None],
        task_headers(),
        "application/json",
    ),
    (
        "an unknown task",
        [[], {}, None],
        task_headers(task="agent_radar.no_such_task"),
        "application/json",
    ),
    (
        "a Celery built-in with a bad body",
        "x",
        task_headers(task="celery.chord_unlock"),
        "application/json",
    ),
]


def test_malformed_messages_are_rejected_and_the_worker_goes_on(
    client, stack, settings, sim_control
):
    worker = stack.start_worker(concurrency=1)
    pool_before = worker.children()
    before = row_counts(client.engine)
    for _what, body, headers, content_type in MALFORMED:
        raw_publish(settings, body, headers=headers, content_type=content_type)
    raw_publish(
        settings,
        [[], dict(GOOD_KWARGS, session_id="good", client_submit_id="ok"), None],
        headers=task_headers(),
    )
    op = eventually(
        lambda: client.find_goal_operation(WS, "good", "ok"),
        timeout_s=60,
        what="the good message after the bad ones",
    )
    assert client.wait(op, timeout=60).status == "completed"
    assert effects_by_operation(sim_control) == {op.operation_id: 1}
    # The same main process took every message: it never died or restarted.
    assert worker.alive()
    assert worker.children() == pool_before
    log = worker.log_path.read_text()
    assert "Restoring" not in log and "Traceback" not in log.split("rejected")[0]
    assert log.count("rejected message") == len(MALFORMED), log[-4000:]
    after = row_counts(client.engine)
    assert after["goal_operations"] == before["goal_operations"] + 1
    assert after["goal_states"] == before["goal_states"] + 1


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (dict(GOOD_KWARGS, objective="null \x00 byte"), "objective must not contain NUL"),
        (dict(GOOD_KWARGS, objective="lone \ud800 surrogate"), "not valid Unicode"),
        (dict(GOOD_KWARGS, action=["set"]), "goal action must be a string"),
        (dict(GOOD_KWARGS, expected_revision=2**31), "expected_revision must be between"),
        (dict(GOOD_KWARGS, client_submit_id="goal-generation-fence:abc"), "reserved"),
    ],
)
def test_values_the_database_cannot_store_are_rejected_not_retried(
    client, stack, settings, kwargs, expected
):
    worker = stack.start_worker(concurrency=1)
    before = row_counts(client.engine)
    body = json.dumps([[], kwargs, None], ensure_ascii=True).encode()
    raw_publish(settings, body, headers=task_headers())
    raw_publish(
        settings,
        [[], dict(GOOD_KWARGS, session_id="after", client_submit_id="ok"), None],
        headers=task_headers(),
    )
    op = eventually(lambda: client.find_goal_operation(WS, "after", "ok"), timeout_s=60)
    client.wait(op, timeout=60)
    eventually(
        lambda: expected in worker.log_path.read_text(),
        timeout_s=30,
        what=f"the rejection {expected!r}",
    )
    log = worker.log_path.read_text()
    assert "Retry in" not in log, log[-3000:]
    after = row_counts(client.engine)
    assert after["goal_operations"] == before["goal_operations"] + 1


def test_reports_out_of_range_are_rejected_by_the_public_task(client, stack, settings):
    worker = stack.start_worker(concurrency=1)
    before = row_counts(client.engine)
    now_ms = int(__import__("time").time() * 1000)
    bad_reports = [
        {
            "workspace_id": WS,
            "session_id": "r",
            "occurred_at_ms": now_ms,
            "session": {"runtime_epoch": 2**31},
        },
        {
            "workspace_id": WS,
            "session_id": "r",
            "occurred_at_ms": 253402300799000,
            "session": {"live": False},
        },
        {"workspace_id": WS, "session_id": "r", "occurred_at_ms": 10**30},
        {
            "workspace_id": WS,
            "session_id": "r",
            "occurred_at_ms": now_ms,
            "goal_applied": {"operation_id": "x", "revision": 1, "goal": {"a": "\x00"}},
        },
    ]
    for report in bad_reports:
        raw_publish(
            settings,
            [[], {"report": report}, None],
            headers=task_headers("agent_radar.report_activity"),
        )
    eventually(
        lambda: (
            worker.log_path.read_text().count("rejected agent_radar.report_activity")
            >= len(bad_reports)
        ),
        timeout_s=30,
        what="every report to be rejected",
    )
    assert "Retry in" not in worker.log_path.read_text()
    assert row_counts(client.engine) == before


def test_the_bench_task_is_not_registered_in_a_production_worker(client, stack, settings):
    worker = stack.start_worker(concurrency=1)
    target = settings.home / "bench"
    raw_publish(
        settings,
        [[], {"run_id": "../../escape", "index": 1}, None],
        headers=task_headers("agent_radar.bench.noop"),
    )
    eventually(lambda: "agent_radar.bench.noop" in worker.log_path.read_text(), timeout_s=30)
    assert "not a task of this service" in worker.log_path.read_text()
    assert not target.exists() and not (settings.home.parent / "escape").exists()
    assert worker.alive()


def test_the_bench_task_checks_its_arguments(client, stack, settings, backend):
    from agent_radar.tasks.bench_tasks import Tally

    worker = stack.start_worker(concurrency=1, extra_env={"AGENT_RADAR_BENCH_TASKS": "1"})
    tally = Tally(settings, "beef")
    for run_id in ("../../escape", "ABC", "a" * 33, 7):
        raw_publish(
            settings,
            [[], {"run_id": run_id, "index": 1}, None],
            headers=task_headers("agent_radar.bench.noop"),
        )
    raw_publish(
        settings,
        [[], {"run_id": "beef", "index": 1}, None],
        headers=task_headers("agent_radar.bench.noop"),
    )
    eventually(lambda: tally.count() == 1, timeout_s=30, what="the good no-op counted")
    # The filesystem broker orders messages of the same millisecond at random: the good one
    # may run before some of the bad ones.
    log = eventually(
        lambda: (lambda text: text.count("rejected agent_radar.bench.noop message") >= 4 and text)(
            worker.log_path.read_text()
        ),
        timeout_s=30,
        what="every bad message rejected",
    )
    assert log.count("rejected agent_radar.bench.noop message") == 4
    assert "Traceback" not in log
    assert list(tally.times()) == [1]
    if backend == "production":  # one Redis list, for the good run only
        keys = {k.decode() for k in tally.redis.scan_iter(match=f"{settings.broker_key_prefix}*")}
        assert {k for k in keys if ":bench:" in k} == {
            f"{settings.broker_key_prefix}agent-radar:bench:beef"
        }
    else:  # one file, for the good run only
        assert [p.name.split("-")[0] for p in (settings.home / "bench").iterdir()] == ["beef"]
    tally.close()


SECRET_PASSWORD = "s3cret-db-pw-" + uuid.uuid4().hex[:8]
SECRET_TOKEN = "s3cret-token-" + uuid.uuid4().hex[:8]


@pytest.mark.parametrize("backend", ["production"])
def test_inspect_conf_shows_no_secret(backend, settings, stack):
    """`celery inspect conf` (what Flower's worker page shows) holds no secret in clear
    text. PostgreSQL here trusts local connections, so a password in the URL is harmless
    to the connection and still a secret to hide."""
    from dataclasses import replace

    secret = replace(
        settings,
        database_url=settings.database_url.replace("postgres@", f"postgres:{SECRET_PASSWORD}@"),
        runtime_token=SECRET_TOKEN,
    )
    assert SECRET_PASSWORD in secret.database_url
    stack.settings = secret
    worker = stack.start_worker(concurrency=1, name="secretive")
    env = {**os.environ, **secret.to_env()}
    # Asked by its node name (`agent-radar worker` names it `<name>-<pid>@<host>`), inspect
    # returns with the answer instead of waiting out its whole timeout for other workers.
    node = f"secretive-{worker.pid}@{socket.gethostname()}"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "agent_radar.tasks.app",
            "inspect",
            "conf",
            "--json",
            "--timeout",
            "10",
            "--destination",
            node,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "secretive" in proc.stdout
    assert "broker_url" in proc.stdout
    assert SECRET_PASSWORD not in proc.stdout + proc.stderr
    assert SECRET_TOKEN not in proc.stdout + proc.stderr
    assert "agent_radar_settings" not in proc.stdout


PLAIN_PRODUCER = textwrap.dedent("""
    # A producer written with plain Celery: no code of agent-radar.
    import sys
    from celery import Celery

    broker, queue, submit_id = sys.argv[1], sys.argv[2], sys.argv[3]
    app = Celery("producer", broker=broker)
    if broker.startswith("redis") and len(sys.argv) > 4:
        app.conf.broker_transport_options = {"global_keyprefix": sys.argv[4]}
    options = {"queue": queue} if queue != "-" else {}
    app.send_task("agent_radar.goal_control", kwargs={
        "workspace_id": "ws-plain", "session_id": "s-" + submit_id, "action": "set",
        "objective": "from plain Celery", "client_submit_id": submit_id}, **options)
""")


@pytest.mark.parametrize("backend", ["production"])
def test_a_plain_celery_producer_is_applied_with_or_without_a_queue(
    backend, client, stack, settings, sim_control, tmp_path
):
    stack.start_worker()
    script = tmp_path / "producer.py"
    script.write_text(PLAIN_PRODUCER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_RADAR_")}
    env["PYTHONPATH"] = ""
    for queue, submit_id in (("-", "default-queue"), ("default", "named-queue")):
        subprocess.run(
            [
                sys.executable,
                str(script),
                settings.broker_url,
                queue,
                submit_id,
                settings.broker_key_prefix,
            ],
            env=env,
            cwd=tmp_path,
            check=True,
            timeout=60,
        )
    ops = [
        eventually(
            lambda sid=sid: client.find_goal_operation("ws-plain", f"s-{sid}", sid),
            timeout_s=60,
            what=f"the {sid} operation",
        )
        for sid in ("default-queue", "named-queue")
    ]
    for op in ops:
        assert client.wait(op, timeout=60).status == "completed"
    assert effects_by_operation(sim_control) == {op.operation_id: 1 for op in ops}

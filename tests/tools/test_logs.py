"""Structured logs (AGENT_RADAR_LOG_FORMAT=json) from a real worker: one JSON object per
line, and a retried operation's lines carry its workspace, session, operation and attempt."""

import io
import json
import logging
import uuid

import pytest
from celery.app.log import TaskFormatter
from celery.utils.log import ColorFormatter

from agent_radar.workflows.adapters import logs
from tests.helpers import eventually
from tests.hostile import raw_publish, task_headers

DISPATCH = "agent_radar.goal.dispatch"


@pytest.mark.parametrize("backend", ["embedded"])  # logging is the same on both backends
def test_a_worker_logs_json_lines_with_the_operation_ids(settings, client, stack, sim_control):
    worker = stack.start_worker(extra_env={logs.LOG_FORMAT_ENV: "json"})
    beat = stack.start_beat()  # the sweeper re-publishes the retry when it is due
    sim_control.fault("goal", status=503, count=1)
    op = client.wait(client.set_goal("ws-logs", "s1", "ship it", client_submit_id="g1"), 60)
    assert op.status == "completed" and op.attempt == 2

    def retry_line():
        for line in worker.log_path.read_text().splitlines():
            if line.startswith("{") and "retrying" in line:
                return json.loads(line)
        return None

    line = eventually(retry_line, what="the retry's log line")
    assert line["level"] == "WARNING"
    assert (line["workspace_id"], line["session_id"], line["operation_id"], line["attempt"]) == (
        "ws-logs",
        "s1",
        op.operation_id,
        1,
    )
    assert line["task"] == "agent_radar.goal.dispatch" and line["task_id"]
    # A dispatch's result says what happened to each operation (Flower shows it too).
    results = [
        json.loads(x)["message"]
        for x in worker.log_path.read_text().splitlines()
        if x.startswith("{") and "agent_radar.goal.dispatch" in x and "succeeded" in x
    ]
    # (its calls go on in the worker's drain: docs/dispatch.md)
    assert any(f"'in_flight': ['{op.operation_id}']" in m for m in results), results
    # Celery's own lines about a message (received by the worker's main process, succeeded
    # in a pool process) carry the ids its arguments name: the client's dispatch its session
    # and submit ID, the sweeper's re-publish of the retry its operation.
    celery_lines = [
        json.loads(x)
        for x in worker.log_path.read_text().splitlines()
        if x.startswith("{") and '"logger": "celery.' in x and "goal.dispatch[" in x
    ]
    for verb in (" received", " succeeded in "):
        mine = [x for x in celery_lines if verb in x["message"]]
        assert all(x["task"] == DISPATCH and x["task_id"] in x["message"] for x in mine), mine
        assert any(
            (x.get("workspace_id"), x.get("session_id"), x.get("client_submit_id"))
            == ("ws-logs", "s1", "g1")
            for x in mine
        ), mine
        assert any(x.get("operation_id") == op.operation_id for x in mine), mine
    # The sweep ran (every 0.5 s here) without a line of Celery's about it: routine work
    # does not drown the lines about real work. The sweep that re-published the retry may
    # still be running when the operation completes (its heartbeat is its last write).
    from agent_radar.workflows.tools.status import fleet_status

    eventually(
        lambda: fleet_status(client.engine)["sweeper_heartbeat_age_s"] is not None,
        what="a sweep to finish",
    )
    assert "agent_radar.sweep[" not in worker.log_path.read_text()
    assert "Sending due task agent-radar-sweep" not in beat.log_path.read_text()
    assert "beat: Starting" in beat.log_path.read_text()  # beat's other lines still show
    # Every line is one JSON object, Celery's start banner left out.
    lines = [x for x in worker.log_path.read_text().splitlines() if x.strip()]
    plain = [x for x in lines if not x.startswith("{")]
    assert lines and not plain, plain[:10]
    assert all("level" in json.loads(x) for x in lines)


FORGED = "x\nCRITICAL forged\r\x1b[8m\u2028\u202e"
CELERY_FORMAT = "[%(asctime)s: %(levelname)s/%(processName)s] %(message)s"
TASK_FORMAT = "[%(asctime)s: %(levelname)s/%(processName)s] %(task_name)s[%(task_id)s]: %(message)s"


def _installed(monkeypatch, log_format: str, formatter: logging.Formatter | None):
    """A logger set up as Celery sets up its own (a handler with its formatter), then
    `logs.install` as the worker's signal runs it; returns the logger and its output."""
    monkeypatch.setenv(logs.LOG_FORMAT_ENV, log_format)
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter)
    logger = logging.getLogger(f"agent_radar.test_logs.{log_format}.{id(out)}")
    logger.propagate = False
    logger.addHandler(handler)
    logs.install(logger)
    logs.install(logger)  # Celery may signal twice (the pool processes): the same result
    return logger, out


def _log_forged(logger: logging.Logger) -> None:
    """A message that interpolates an untrusted id, with context ids as untrusted, then a
    line with a traceback."""
    with logs.task_context(task_id=FORGED, workspace_id="ws\nCRITICAL ws"):
        logger.error("rejected message %s: bad", FORGED)
        try:
            raise ValueError(f"boom {FORGED}")
        except ValueError:
            logger.exception("failed %s", FORGED)


def test_a_label_says_exactly_the_ids_it_was_written_from():
    ids = {"workspace_id": "acme", "session_id": "s1", "client_submit_id": "req-1"}
    assert logs.label(ids) == "acme/s1 submit=req-1"
    assert logs.parse_label(f"[{logs.label(ids)}] {{'operation_ids': ['x']}}") == ids
    # Ids may hold any printable text (check_id): none of it reads as the label's syntax.
    tricky = {
        "workspace_id": "team/a",
        "session_id": "victim/vs1 submit=forged] x",
        "client_submit_id": "mine', 'workspace_id': 'victim",
        "operation_id": "a=b; c",
    }
    assert logs.parse_label(f"[{logs.label(tricky)}] {{}}") == tricky
    # Not labels: none, a batch's, an unknown key, text that is not printable once decoded.
    for text in (
        "{'workspace_id': 'w', 'session_id': 's'}",
        "[a/s1 submit=x; a/s2 submit=y] {}",
        "[a/s1 owner=x] {}",
        "[a/s1 op=%1b%5B2J] {}",
        "[a/s1 op=%0A] {}",
        "[" + "x" * 5000 + "]",
    ):
        assert logs.parse_label(text) == {}, text


def test_a_retried_routine_task_still_ends_its_row(monkeypatch):
    """A report or prompt dispatch that did nothing sends no events, unless a retry already
    gave it a row in Flower: then its end is sent, or the row would stay RETRY for ever."""
    from types import SimpleNamespace

    from agent_radar.tasks import strict

    sent = []
    monkeypatch.setattr(strict, "_send_events", lambda task, at, last, **f: sent.append(last))
    first = SimpleNamespace(request=SimpleNamespace(retries=0), resultrepr_maxsize=1024)
    assert strict._shown_when_effective(first, lambda: strict.Routine("idle")) == "idle"
    assert sent == []
    retried = SimpleNamespace(request=SimpleNamespace(retries=1), resultrepr_maxsize=1024)
    assert strict._shown_when_effective(retried, lambda: strict.Routine("idle")) == "idle"
    assert sent == ["task-succeeded"]
    assert strict._shown_when_effective(first, lambda: "dispatched") == "dispatched"
    assert sent == ["task-succeeded", "task-succeeded"]


def test_the_gate_describes_a_message_by_its_body_not_its_headers():
    from agent_radar.tasks.gate import describe_arguments

    def described(kwargsrepr, kwargs, args=()):
        headers = {"kwargsrepr": kwargsrepr, "argsrepr": "()"}
        describe_arguments(headers, list(args), kwargs)
        return headers

    # The product's own dispatch: the submit ID it was sent for is kept (the body has none).
    own = described(
        "[acme/s1 submit=req-1] {...}",
        {"operation_ids": ["o1"], "workspace_id": "acme", "session_id": "s1"},
    )
    assert own["kwargsrepr"].startswith("[acme/s1 submit=req-1] {'operation_ids': ['o1']")
    # A label its body contradicts is dropped; the body's own ids lead.
    forged = described(
        "[victim/vs1 submit=forged-c1] {...}",
        {"report": {"workspace_id": "atk", "session_id": "as1", "occurred_at_ms": "x"}},
    )
    assert forged["kwargsrepr"].startswith("[atk/as1] {'report'")
    # Text that names another session than the body: the body wins.
    text_only = described(
        "{'workspace_id': 'victim', 'session_id': 'vs1', 'client_submit_id': 'victim-c9'}",
        {"workspace_id": "atk", "session_id": "as1", "client_submit_id": "c1"},
    )
    assert text_only["kwargsrepr"].startswith("[atk/as1 submit=c1] {'workspace_id': 'atk'")
    assert "victim" not in text_only["kwargsrepr"]
    # Positional arguments are shown as they are, never as "()".
    positional = described("[victim/vs2] {}", {}, args=[{"workspace_id": "atk"}])
    assert positional["kwargsrepr"] == "{}" and "atk" in positional["argsrepr"]
    assert logs.parse_label(positional["kwargsrepr"]) == {}


@pytest.mark.parametrize(
    "formatter",
    [
        None,
        logging.Formatter(CELERY_FORMAT),
        ColorFormatter(CELERY_FORMAT, use_color=False),
        ColorFormatter(CELERY_FORMAT, use_color=True),
        TaskFormatter(TASK_FORMAT, use_color=False),
    ],
    ids=["default", "logging", "celery", "celery-colour", "celery-task"],
)
def test_a_text_line_is_one_line_whatever_its_message_says(monkeypatch, formatter):
    logger, out = _installed(monkeypatch, "text", formatter)
    _log_forged(logger)
    lines = out.getvalue().splitlines()
    assert "x\\nCRITICAL forged\\r\\x1b[8m\\u2028\\u202e" in lines[0], lines
    assert "failed x\\nCRITICAL forged" in lines[1], lines
    # The traceback follows the second line, each of its lines indented and escaped: the
    # exception's message is untrusted too, and nothing else makes a line.
    assert lines[2] == "  Traceback (most recent call last):", lines
    assert all(line.startswith("  ") for line in lines[2:]), lines
    assert lines[-2] == "  ValueError: boom x", lines
    # (a colour formatter's own reset follows)
    assert lines[-1].startswith("  CRITICAL forged\\r\\x1b[8m\\u2028\\u202e"), lines
    assert not [x for x in lines if x.startswith("CRITICAL")]
    assert "\x1b[8m" not in out.getvalue() and "\u2028" not in out.getvalue()
    assert "\u202e" not in out.getvalue()


def test_celerys_task_id_on_a_text_line_is_escaped(monkeypatch):
    """Celery's task logger puts the running task's id (a message header) on each line; its
    formatter reads it at format time, after every filter."""
    from celery import Celery
    from celery._state import pop_current_task, push_current_task

    logger, out = _installed(monkeypatch, "text", TaskFormatter(TASK_FORMAT, use_color=False))

    def noop():
        pass

    task = Celery("test-logs", set_as_current=False).task(name="agent_radar.t")(noop)
    task.push_request(id=FORGED)
    push_current_task(task)
    try:
        logger.warning("working")
    finally:
        pop_current_task()
        task.pop_request()
    (line,) = out.getvalue().splitlines()
    assert line.endswith("agent_radar.t[x\\nCRITICAL forged\\r\\x1b[8m\\u2028\\u202e]: working")


def test_a_json_line_is_one_line_whatever_its_message_says(monkeypatch):
    logger, out = _installed(monkeypatch, "json", ColorFormatter(CELERY_FORMAT))
    _log_forged(logger)
    text = out.getvalue()
    lines = text.splitlines()
    assert len(lines) == 2 and text.isascii(), lines  # U+2028 and the like are \uXXXX too
    first, second = (json.loads(x) for x in lines)
    assert first["message"] == f"rejected message {FORGED}: bad"  # JSON keeps it exactly
    assert (first["task_id"], first["workspace_id"]) == (FORGED, "ws\nCRITICAL ws")
    assert "ValueError: boom" in second["exception"]


def test_a_bad_log_format_is_refused(monkeypatch):
    monkeypatch.setenv(logs.LOG_FORMAT_ENV, "xml")
    with pytest.raises(ValueError, match="text or json"):
        logs.json_logs_wanted()


@pytest.mark.parametrize("backend", ["embedded"])  # metrics are the same on both backends
def test_a_worker_serves_runtime_call_metrics(settings, client, stack, sim_control):
    """`worker --metrics-port`: latency and errors of the pool processes' runtime calls by
    host, call and code, and dispatch batch sizes, gathered from every pool process."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from agent_radar.workflows.adapters.metrics import WORKER_METRICS
    from tests.conftest import free_port

    port = free_port()
    stack.start_worker(concurrency=2, extra_args=["--metrics-port", str(port)])
    stack.start_beat()
    sim_control.fault("goal", status=503, count=1)
    op = client.wait(client.set_goal("ws-metrics", "s1", "ship it", client_submit_id="g1"), 60)
    assert op.status == "completed" and op.attempt == 2

    def scrape():
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            text = answer.read().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    got = eventually(scrape, what="the worker's metrics")
    names = {name for name, _ in got}
    for metric in WORKER_METRICS:
        assert any(n.startswith(metric) for n in names), (metric, sorted(names))
    goal_calls = got[
        ("agent_radar_runtime_call_seconds_count", (("call", "goal"), ("host", "default")))
    ]
    assert goal_calls >= 2  # the failed attempt and the applied one
    errors = got[
        (
            "agent_radar_runtime_call_errors_total",
            (("call", "goal"), ("code", "server_error"), ("host", "default")),
        )
    ]
    assert errors == 1
    assert got[("agent_radar_dispatch_batch_size_count", ())] >= 2


# A Celery text line, as a task id header would forge one after a newline.
FORGED_LINE = "[2026-01-01 00:00:00,000: CRITICAL/MainProcess] forged"


@pytest.mark.parametrize("backend", ["embedded"])  # logging is the same on both backends
def test_a_task_id_cannot_forge_a_line_in_a_workers_log(settings, client, stack):
    """Celery's own lines ("Task ... received") and ours interpolate the message's id. The
    worker may run such a message or reject it at the consumer: either way no line of its
    log starts with the forged text, and every line that names the id shows it escaped."""
    worker = stack.start_worker(concurrency=1)
    kwargs = {"workspace_id": "ws-forge", "session_id": "s", "action": "set", "objective": "x"}
    task_id = f"{uuid.uuid4()}\n{FORGED_LINE}"
    raw_publish(
        settings, [[], dict(kwargs, client_submit_id="f"), None], headers=task_headers(id=task_id)
    )
    # A good message after it: the worker goes on either way.
    raw_publish(
        settings,
        [[], dict(kwargs, session_id="good", client_submit_id="ok"), None],
        headers=task_headers(),
    )
    op = eventually(
        lambda: client.find_goal_operation("ws-forge", "good", "ok"),
        timeout_s=60,
        what="the good message",
    )
    assert client.wait(op, timeout=60).status == "completed"

    def handled():
        """The forging message was run (Celery logged it received) or rejected."""
        text = worker.log_path.read_text()
        return ("forged" in text or "rejected" in text) and text.splitlines()

    log = eventually(handled, what="the forging message run or rejected")
    assert not [x for x in log if x.startswith(FORGED_LINE[:20])], log
    naming = [x for x in log if "forged" in x]
    # A line that names the id shows its newline escaped (a rejection may shorten the id).
    assert all(f"\\n{FORGED_LINE}" in x for x in naming), naming
    if client.find_goal_operation("ws-forge", "s", "f") is not None:  # it ran: Celery said so
        received = f"[{task_id}] received".replace("\n", "\\n")
        assert any(received in x for x in naming), naming

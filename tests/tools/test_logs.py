"""Structured logs (AGENT_RADAR_LOG_FORMAT=json) from a real worker: one JSON object per
line, and a retried operation's lines carry its workspace, session, operation and attempt."""

import json
import re

import pytest

from tests.helpers import eventually
from workflows.adapters import logs


@pytest.mark.parametrize("backend", ["embedded"])  # logging is the same on both backends
def test_a_worker_logs_json_lines_with_the_operation_ids(settings, client, stack, sim_control):
    worker = stack.start_worker(extra_env={logs.LOG_FORMAT_ENV: "json"})
    stack.start_beat()  # the sweeper re-publishes the retry when it is due
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
    assert any(f"'{op.operation_id}': 'applied'" in m for m in results), results
    assert any(f"'{op.operation_id}': 'retry'" in m for m in results), results
    # The sweep ran (every 0.5 s here) without a line of Celery's about it: routine work
    # does not drown the lines about real work. The sweep that re-published the retry may
    # still be running when the operation completes (its heartbeat is its last write).
    from workflows.tools.status import fleet_status

    eventually(
        lambda: fleet_status(client.engine)["sweeper_heartbeat_age_s"] is not None,
        what="a sweep to finish",
    )
    assert "agent_radar.sweep[" not in worker.log_path.read_text()
    # Every log record is one JSON object: no line in the text format (only Celery's start
    # banner, printed and not logged, is plain text).
    lines = worker.log_path.read_text().splitlines()
    assert not [x for x in lines if re.match(r"^\[\d{4}-\d\d-\d\d .*: [A-Z]+/", x)]
    assert all("level" in json.loads(x) for x in lines if x.startswith("{"))


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

    from tests.conftest import free_port
    from workflows.adapters.metrics import WORKER_METRICS

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

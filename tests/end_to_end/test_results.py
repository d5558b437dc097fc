"""Results for any producer (README.md, producers): with a result backend configured
(AGENT_RADAR_RESULT_BACKEND), a producer that knows nothing of agent-radar but Celery learns
each submit's operation id from the task's result, follows the operation with
`agent_radar.get_operation` until it settles, and sees a refusal as a FAILURE carrying its
code — from plain Celery in Python, and from Node with celery-node.

These producers publish to Celery's default queue with no key prefix, so the module runs on
a Redis database of its own (AGENT_RADAR_TEST_RESULTS_REDIS), and PostgreSQL."""

import json
import os
import shutil
import subprocess
import time
from dataclasses import replace

import pytest
import redis
from celery import Celery

from tests.conftest import skip_or_fail
from tests.helpers import eventually

RESULTS_REDIS = os.environ.get("AGENT_RADAR_TEST_RESULTS_REDIS", "redis://127.0.0.1:6379/13")
WS = "ws-results"
CELERY_NODE = "celery-node@0.5.9"


@pytest.fixture
def backend():
    return "production"


def clean_results() -> None:
    """Only what this module's producers and workers make: queues, results, kombu's keys."""
    probe = redis.Redis.from_url(RESULTS_REDIS)
    try:
        for pattern in ("celery*", "default*", "maintenance*", "_kombu*", "unacked*"):
            for key in probe.scan_iter(pattern):
                probe.delete(key)
    finally:
        probe.close()


@pytest.fixture
def settings(settings):
    clean_results()
    yield replace(
        settings, broker_url=RESULTS_REDIS, broker_key_prefix="", result_backend=RESULTS_REDIS
    )
    clean_results()


def _follow(send, operation_id: str, settled=("completed", "failed", "superseded")) -> dict:
    """Poll agent_radar.get_operation through the producer until the operation settles."""
    deadline = time.monotonic() + 60
    while True:
        record = send("agent_radar.get_operation", {"operation_id": operation_id})
        if record["status"] in settled or time.monotonic() > deadline:
            return record
        time.sleep(0.2)


def test_a_plain_celery_producer_reads_outcomes_and_refusals(settings, stack, sim_control):
    stack.start_worker(concurrency=1)
    producer = Celery("producer", broker=RESULTS_REDIS, backend=RESULTS_REDIS)
    try:

        def send(task, kwargs):
            return producer.send_task(task, kwargs=kwargs).get(timeout=60)

        submitted = send(
            "agent_radar.goal_control",
            {
                "workspace_id": WS,
                "session_id": "s1",
                "action": "set",
                "objective": "ship it",
                "client_submit_id": "py-1",
            },
        )
        assert set(submitted) == {"operation_id", "status"}
        record = _follow(send, submitted["operation_id"])
        assert (record["kind"], record["status"], record["provider_phase"]) == (
            "goal",
            "completed",
            "applied",
        )
        assert record["client_submit_id"] == "py-1" and isinstance(record["completed_at"], str)
        # A fence of an operation that does not exist: FAILURE, with the code.
        refused = producer.send_task(
            "agent_radar.fence_goal_generation",
            kwargs={
                "workspace_id": WS,
                "session_id": "s1",
                "target_operation_id": "no-such-operation",
                "client_submit_id": "f-1",
            },
        )
        with pytest.raises(Exception, match="not_found"):
            refused.get(timeout=60)
        assert refused.state == "FAILURE"
        missing = producer.send_task("agent_radar.get_operation", kwargs={"operation_id": "nope"})
        with pytest.raises(Exception, match="not_found"):
            missing.get(timeout=60)
    finally:
        producer.close()


def test_a_plain_celery_producer_resumes_stops_and_retries(settings, stack, sim_control):
    """What the Python client's ensure_session, stop_session and retry_operation do, a
    producer in any language does with a task of each, with the client's checks, and reads
    the outcome as the other tasks' (issue: every action a producer needs is a task)."""
    stack.start_worker(concurrency=1)
    producer = Celery("producer", broker=RESULTS_REDIS, backend=RESULTS_REDIS)
    try:

        def send(task, kwargs):
            return producer.send_task(task, kwargs=kwargs).get(timeout=60)

        def refused(task, kwargs, code):
            result = producer.send_task(task, kwargs=kwargs)
            with pytest.raises(Exception, match=code):
                result.get(timeout=60)
            assert result.state == "FAILURE"

        # A goal the host rejects for good fails; the operator's retry applies it.
        sim_control.fault("goal", status=422, error="rejected", count=1, session_id="s2")
        goal = {"workspace_id": WS, "session_id": "s2", "action": "set", "objective": "x"}
        submitted = send("agent_radar.goal_control", {**goal, "client_submit_id": "g-2"})
        assert _follow(send, submitted["operation_id"])["status"] == "failed"
        retry = {"operation_id": submitted["operation_id"], "reason": "the host is fixed"}
        refused("agent_radar.retry_operation", {**retry, "workspace_id": "other"}, "not_found")
        refused(
            "agent_radar.retry_operation", {**retry, "workspace_id": WS, "reason": ""}, "reason"
        )
        again = send("agent_radar.retry_operation", {**retry, "workspace_id": WS})
        assert (again["kind"], again["operation_id"]) == ("goal", submitted["operation_id"])
        assert again["status"] in ("prepared", "dispatched", "completed")
        assert _follow(send, submitted["operation_id"])["status"] == "completed"
        assert [e["operation_id"] for e in sim_control.effects()] == [submitted["operation_id"]]

        # A session resumed: as the record has it after.
        ensured = send("agent_radar.ensure_session", {"workspace_id": WS, "session_id": "s3"})
        assert (ensured["workspace_id"], ensured["session_id"], ensured["live"]) == (
            WS,
            "s3",
            True,
        )
        refused("agent_radar.ensure_session", {"workspace_id": WS, "session_id": ""}, "session_id")

        # A session stopped: idempotent by its submit ID, followed to its end.
        stop = {"workspace_id": WS, "session_id": "s3", "client_submit_id": "stop-1"}
        stopped = send("agent_radar.stop_session", stop)
        assert set(stopped) == {"stop_id", "status"}
        assert send("agent_radar.stop_session", stop)["stop_id"] == stopped["stop_id"]
        record = _follow(send, stopped["stop_id"], settled=("completed",))
        assert (record["kind"], record["status"]) == ("stop", "completed")
    finally:
        producer.close()


NODE_PRODUCER = """
const celery = require("celery-node");
const client = celery.createClient(process.argv[2], process.argv[3]);
async function send(task, kwargs) {
  return client.createTask(task).applyAsync([], kwargs).get(60000);
}
(async () => {
  const submitted = await send("agent_radar.goal_control", {
    workspace_id: "ws-results", session_id: "node-1", action: "set",
    objective: "from node", client_submit_id: "node-1",
  });
  let record;
  for (let i = 0; i < 300; i++) {
    record = await send("agent_radar.get_operation", {operation_id: submitted.operation_id});
    if (["completed", "failed", "superseded"].includes(record.status)) break;
    await new Promise((r) => setTimeout(r, 200));
  }
  let refusal = null;
  try {
    await send("agent_radar.get_operation", {operation_id: "no-such-operation"});
  } catch (err) {
    // celery-node's error: the state as its message, the stored exception's fields on it.
    refusal = {state: err.message, type: err.exc_type, args: err.exc_message};
  }
  console.log(JSON.stringify({submitted, record, refusal}));
  await client.disconnect();
  process.exit(0);
})().catch((err) => { console.error(err); process.exit(1); });
"""


def install_celery_node(where) -> None:
    """celery-node installed with npm into `where` (the registry is reachable; a test that
    cannot install it skips, or fails under CI)."""
    if not (shutil.which("node") and shutil.which("npm")):
        skip_or_fail("Node.js and npm are not installed")
    install = subprocess.run(
        ["npm", "install", "--silent", "--no-audit", "--no-fund", CELERY_NODE],
        cwd=where,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if install.returncode != 0:
        skip_or_fail(f"npm could not install {CELERY_NODE}: {install.stderr[-500:]}")


def run_node_producer(tmp_path, broker_url: str, backend_url: str) -> dict:
    """NODE_PRODUCER with celery-node's defaults, against this broker and result backend:
    what it printed."""
    install_celery_node(tmp_path)
    (tmp_path / "producer.js").write_text(NODE_PRODUCER)
    run = subprocess.run(
        ["node", "producer.js", broker_url, backend_url],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def check_node_outcomes(out: dict, sim_control) -> None:
    """What NODE_PRODUCER learnt: its goal's record, completed; a refusal, as a FAILURE."""
    assert set(out["submitted"]) == {"operation_id", "status"}
    assert (out["record"]["status"], out["record"]["session_id"]) == ("completed", "node-1")
    refusal = out["refusal"]
    assert (refusal["state"], refusal["type"], refusal["args"][0]) == (
        "FAILURE",
        "OperationRefused",
        "not_found",
    ), refusal
    eventually(
        lambda: [
            e
            for e in sim_control.effects()
            if e["operation_id"] == out["submitted"]["operation_id"]
        ],
        what="the agent's effect",
    )


def test_a_node_producer_reads_outcomes_with_celery_node(settings, stack, sim_control, tmp_path):
    stack.start_worker(concurrency=1)
    check_node_outcomes(run_node_producer(tmp_path, RESULTS_REDIS, RESULTS_REDIS), sim_control)

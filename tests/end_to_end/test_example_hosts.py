"""The example hosts of docs/hosts.md — the Node.js host of docs/examples/node-host, written
from the docs alone, and the Python host on the host kit (docs/examples/python-host) — behind
real workers and beat, driven by the celery-node producer through every action: a goal set,
the same submit again, a clear, a fence, a compaction, a prompt, a session ensure and a
stop, on Redis and on RabbitMQ. Effects are counted at the host, from its own log. Each host
passes `agent-radar host-check`, its reports included, and keeps its goals, fences and
answers across a restart of its process."""

import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from agent_radar.workflows.adapters.http_runtime import HttpRuntime
from agent_radar.workflows.tools.stack import Stack
from tests.conftest import free_port
from tests.end_to_end.test_results import RESULTS_REDIS, clean_results, install_celery_node

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
EXAMPLE = EXAMPLES / "node-host"
PYTHON_HOST = EXAMPLES / "python-host"
WS = "ws-node"
TOKEN = "node-host-secret"


@pytest.fixture(scope="module")
def node_dir(tmp_path_factory) -> Path:
    """The example's files beside celery-node, installed with npm (the registry is
    reachable; a test that cannot install it skips, or fails under CI)."""
    where = tmp_path_factory.mktemp("node-host")
    install_celery_node(where)
    for name in ("host.js", "producer.js"):
        shutil.copy(EXAMPLE / name, where / name)
    return where


class ExampleHost:
    """An example host as its own process, on a port of its own: `node` (host.js, beside
    celery-node) or `python` (the kit's example, with this interpreter)."""

    def __init__(self, kind: str, node_dir: Path, home: Path, broker_url: str | None) -> None:
        self.kind, self.dir, self.home, self.broker_url = kind, node_dir, home, broker_url
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.effects_file = home / "host-effects.jsonl"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ExampleHost":
        env = {
            **os.environ,
            "HOST_PORT": str(self.port),
            "HOST_ID": "default",
            "HOST_TOKEN": TOKEN,
            "HOST_STATE": str(self.home / "host-state.json"),
            "HOST_EFFECTS": str(self.effects_file),
            "HOST_TEST_HOOKS": "1",
            "TURN_MS": "300",
            "MAINTENANCE_MS": "300",
        }
        if self.broker_url:
            env["BROKER_URL"] = self.broker_url
        if self.kind == "node":
            command, cwd = ["node", "host.js"], self.dir
        else:
            command, cwd = [sys.executable, str(PYTHON_HOST / "host.py")], self.home
        self.log = open(self.home / f"{self.kind}-host.log", "ab")
        self.proc = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=self.log
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode()
        assert line.startswith("listening on"), line + self.logged()
        return self

    def logged(self) -> str:
        return (self.home / f"{self.kind}-host.log").read_text()[-3000:]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()

    def effects(self) -> list[dict]:
        if not self.effects_file.exists():
            return []
        return [json.loads(line) for line in self.effects_file.read_text().splitlines()]


@pytest.fixture(params=["production", "rabbitmq"])
def backend(request):
    """Redis (celery-node's messages carry no key prefix: a database of this module's own) and
    RabbitMQ (celery-node reaches the classic queue `celery`)."""
    return request.param


@pytest.fixture
def settings(settings, backend, tmp_path):
    clean_results()
    port = free_port()
    more = {"runtime_url": f"http://127.0.0.1:{port}", "runtime_token": TOKEN}
    if backend == "production":
        more |= {"broker_url": RESULTS_REDIS, "broker_key_prefix": ""}
    yield replace(settings, result_backend=RESULTS_REDIS, **more)
    clean_results()


@pytest.fixture(params=["node", "python"])
def host_kind(request) -> str:
    return request.param


@pytest.fixture
def example_host(settings, node_dir, tmp_path, host_kind):
    port = int(settings.runtime_url.rsplit(":", 1)[1])
    host = ExampleHost(host_kind, node_dir, tmp_path, settings.broker_url)
    host.port, host.url = port, settings.runtime_url
    yield host.start()
    host.stop()


def run_producer(node_dir: Path, settings) -> dict:
    run = subprocess.run(
        ["node", "producer.js", settings.broker_url, settings.result_backend, WS, "s1"],
        cwd=node_dir,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_every_action_from_node_reaches_the_host_once(settings, node_dir, example_host):
    node_host = example_host
    stack = Stack(settings)
    stack.prepare()
    try:
        stack.start_worker(concurrency=2)
        stack.start_beat()
        out = run_producer(node_dir, settings)
        worker_log = "".join(p.read_text() for p in stack.log_dir.glob("worker*.log"))
    finally:
        stack.kill()

    # The host's signed reports were taken, none refused: its turns' starts and ends.
    reports = re.findall(r"report_activity\[[^\]]+\] (\w+)", worker_log)
    assert reports.count("succeeded") >= 6, reports
    assert reports.count("received") == reports.count("succeeded") == len(reports) / 2, reports

    assert out["set"]["status"] == "completed" and out["set"]["action"] == "set"
    assert out["duplicate"]["operation_id"] == out["set"]["operation_id"]
    assert (out["clear"]["status"], out["clear"]["action"]) == ("completed", "clear")
    assert out["shared"]["status"] == "completed"
    fence = out["fence"]
    assert (fence["status"], fence["target_operation_id"]) == (
        "completed",
        out["shared"]["operation_id"],
    )
    assert out["compaction"]["status"] == "completed"
    assert out["prompt"]["status"] == "completed"
    assert out["ensure"]["live"] is True
    assert out["stop"]["status"] == "completed"

    # Counted at the host: each goal operation applied once (the duplicate submit made
    # none), the fence installed once, one compaction, one prompt's turn.
    effects = node_host.effects()
    goals = [e for e in effects if e["kind"] == "goal"]
    assert [(e["action"], e["revision"]) for e in goals] == [
        ("set", 1),
        ("clear", 2),
        ("set", 3),
        ("clear", 4),
    ]
    assert goals[0]["operation_id"] == out["set"]["operation_id"]
    assert goals[3]["operation_id"] == fence["clear_operation_id"]
    assert len({e["operation_id"] for e in goals}) == 4
    kinds = Counter(e["kind"] for e in effects)
    assert (kinds["fence"], kinds["maintenance"], kinds["prompt"]) == (1, 1, 1)
    (fenced,) = [e for e in effects if e["kind"] == "fence"]
    assert (fenced["target_operation_id"], fenced["target_revision"]) == (
        out["shared"]["operation_id"],
        3,
    )

    # The host's process restarts: its goal, revision, fences and answers are kept, and
    # the epoch moves.
    node_host.stop()
    node_host.start()
    runtime = HttpRuntime(node_host.url, token=TOKEN)
    state = runtime.session_state(WS, "s1")
    assert state.runtime_epoch >= 2 and state.goal is not None and state.goal.revision == 4
    assert state.fences == frozenset({(out["shared"]["operation_id"], 3)})
    # A worker's retry of the fenced generation's call, after the restart: the answer it
    # had, and no second effect.
    runtime.apply_goal(
        WS,
        "s1",
        operation_id=out["shared"]["operation_id"],
        action="set",
        objective="shared goal",
        revision=3,
        client_submit_id="set-2",
        require_live=True,
    )
    assert [e for e in node_host.effects() if e["kind"] == "goal"] == goals


def test_the_example_hosts_pass_host_check(node_dir, tmp_path, host_kind):
    """Each example host keeps every promise host-check asks about, its reports included
    (read from a Redis database no worker reads)."""
    clean_results()
    host = ExampleHost(host_kind, node_dir, tmp_path, broker_url=RESULTS_REDIS).start()
    try:
        check = subprocess.run(
            [
                str(Path(sys.executable).with_name("agent-radar")),
                "host-check",
                host.url,
                "--token",
                TOKEN,
                "--test-hooks",
                "--reports-from",
                RESULTS_REDIS,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        host.stop()
        clean_results()
    lines = check.stdout.strip().splitlines()
    assert check.returncode == 0, check.stdout + check.stderr + host.logged()
    assert len(lines) == 12 and all(line.startswith("PASS ") for line in lines), check.stdout


BAD_CALLS = [
    ("goal", {"operation_id": "op-x", "action": "set", "objective": "x", "revision": "9"}),
    ("goal", {"operation_id": "op-x", "action": "set", "objective": "x"}),
    ("goal", {"action": "set", "objective": "x", "revision": 9}),
    ("goal", {"operation_id": "op-x", "action": "bogus", "revision": 9}),
    ("goal", {"operation_id": "op-f", "action": "set", "objective": "x", "revision": "4"}),
    ("goal", {"operation_id": "constructor", "action": "set", "revision": 9}),
    ("goal", {"operation_id": "x" * 300, "action": "clear", "revision": 9}),
    ("goal-fences", {"target_operation_id": "op-y", "target_revision": 0}),
    ("prompts", {"prompt_id": "toString"}),
    ("maintenance", {"run_id": "r-1", "kind": "rm -rf", "args": {}}),
    ("resume", {"fences": [{"target_operation_id": "a", "target_revision": 3}, {"x": 1}]}),
]


def test_the_example_hosts_refuse_bad_calls_and_change_nothing(node_dir, tmp_path, host_kind):
    """What a hostile caller (with the token) sends: each is refused 4xx, and the host's state
    and effects are as before; the host still answers. Without the token, a 2 MiB body is
    refused before it is read."""
    import http.client

    host = ExampleHost(host_kind, node_dir, tmp_path, broker_url=None).start()
    runtime = HttpRuntime(host.url, token=TOKEN)
    try:
        runtime.install_fence(
            WS, "s1", target_operation_id="op-f", target_revision=4, require_live=True
        )
        before = (runtime.request("GET", f"/v1/workspaces/{WS}/sessions/s1/state"), host.effects())
        for call, body in BAD_CALLS + [("goal", None), ("prompts", [1])]:
            conn = http.client.HTTPConnection("127.0.0.1", host.port, timeout=10)
            conn.request(
                "POST",
                f"/v1/workspaces/{WS}/sessions/s1/{call}",
                json.dumps(body),
                {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
            )
            status = conn.getresponse().status
            conn.close()
            assert 400 <= status < 500, (call, body, status)
        after = (runtime.request("GET", f"/v1/workspaces/{WS}/sessions/s1/state"), host.effects())
        assert after == before
        # Headers that announce 2 MiB and no token: refused before any of the body is sent.
        conn = http.client.HTTPConnection("127.0.0.1", host.port, timeout=10)
        conn.putrequest("POST", f"/v1/workspaces/{WS}/sessions/s1/goal")
        conn.putheader("Content-Length", str(2 << 20))
        conn.endheaders()
        assert conn.getresponse().status == 401
        conn.close()
        assert host.proc is not None and host.proc.poll() is None
    finally:
        host.stop()


@pytest.mark.parametrize("backend", ["production"], indirect=True)
def test_a_goal_the_kit_s_agent_takes_later_completes(settings, tmp_path):
    """A host on the kit whose agent takes goals later: the call answers `accepted`, the
    agent's `goal_applied` reports it, the workers ask the state call, and the operation
    completes `applied`, once, with the goal synced."""
    import threading

    from agent_radar import AgentRadar
    from agent_radar.host import AgentHost, TimerAgent, broker_reporter

    class Later(TimerAgent):
        def takes_goal(self, host, session, goal):
            ws, sid, op = session.workspace_id, session.session_id, goal["operation_id"]
            threading.Timer(0.3, host.goal_applied, (ws, sid, op)).start()
            return False

    settings = replace(settings, runtime_token=TOKEN)
    port = int(settings.runtime_url.rsplit(":", 1)[1])
    kit = AgentHost(
        Later(turn_s=0.2),
        token=TOKEN,
        reporter=broker_reporter(settings),
        effects_log=tmp_path / "effects.jsonl",
    )
    server = kit.serve(port=port).start()
    client = AgentRadar(settings=settings)
    stack = Stack(settings)
    stack.prepare()
    try:
        stack.start_worker(concurrency=1)
        stack.start_beat()
        op = client.set_goal(WS, "later", "taken later", client_submit_id="l-1")
        done = client.wait(op, timeout=60)
        assert (done.status, done.provider_phase) == ("completed", "applied")
        assert client.goal_state(WS, "later").sync_status == "synced"
    finally:
        stack.kill()
        server.stop()
        client.close()
    effects = [json.loads(line) for line in (tmp_path / "effects.jsonl").read_text().splitlines()]
    assert [e["operation_id"] for e in effects if e["kind"] == "goal"] == [op.operation_id]

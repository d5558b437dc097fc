"""The agent-host protocol as documented (docs/protocol.md, docs/protocol/agent-host.openapi.yaml)
is the protocol spoken: the adapter drives every call against the simulator over real HTTP,
and every request it sends and every answer the simulator gives (errors included) is
validated against the OpenAPI document; every report the simulator makes is validated
against its Report schema and accepted by the control plane's own parser, and reports the
schema refuses are refused by that parser too."""

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from agent_radar.models.base import utcnow
from agent_radar.workflows.activity.activity import parse_report
from agent_radar.workflows.adapters.http_runtime import HttpRuntime
from agent_radar.workflows.adapters.runtime import RuntimePort
from agent_radar.workflows.errors import InvalidArgument, RuntimeDisconnected, RuntimeFault
from agent_radar.workflows.tools.simulator import SimControl, SimServer
from agent_radar.workflows.tools.stack import free_port
from tests.helpers import eventually

DOCS = Path(__file__).resolve().parents[2] / "docs"
SPEC = yaml.safe_load((DOCS / "protocol" / "agent-host.openapi.yaml").read_text())
BASE = "urn:agent-radar:protocol"
WS = "ws-protocol"


def _absolute(node: Any) -> Any:
    """The document with its local $refs made absolute, so a piece of it validates alone."""
    if isinstance(node, dict):
        return {
            k: (BASE + v if k == "$ref" and v.startswith("#/") else _absolute(v))
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_absolute(v) for v in node]
    return node


DOC = _absolute(SPEC)
REGISTRY = Registry().with_resource(BASE, Resource.from_contents(DOC, DRAFT202012))


def validator(schema: dict) -> Draft202012Validator:
    return Draft202012Validator(schema, registry=REGISTRY)


def operations() -> dict[str, tuple[str, re.Pattern, dict]]:
    """operationId -> (method, path pattern, operation)."""
    found = {}
    for template, item in DOC["paths"].items():
        pattern = re.compile("^" + re.sub(r"\{[a-z_]+\}", "[^/]+", template) + "$")
        for method in ("get", "post"):
            if method in item:
                found[item[method]["operationId"]] = (method.upper(), pattern, item[method])
    return found


OPERATIONS = operations()
# The runtime port's method for each documented call, where its name differs.
PORT_METHOD = {
    "goal": "apply_goal",
    "goal_fence": "install_fence",
    "prompt": "submit_prompt",
    "turn_cancel": "cancel_turn",
    "maintenance_start": "start_maintenance",
    "maintenance_cancel": "cancel_maintenance",
}


def operation_for(method: str, path: str) -> tuple[str, dict]:
    matches = [
        (name, op)
        for name, (m, pattern, op) in OPERATIONS.items()
        if m == method and pattern.match(path)
    ]
    assert len(matches) == 1, f"{method} {path} is not one documented call: {matches}"
    return matches[0]


def _json_schema(content_holder: dict) -> dict:
    """The JSON schema of a request body or a response (a shared response by its $ref)."""
    if "$ref" in content_holder:
        content_holder = DOC["components"]["responses"][content_holder["$ref"].rsplit("/", 1)[1]]
    return content_holder["content"]["application/json"]["schema"]


@pytest.fixture
def host():
    """The simulator on a port of its own; its reports are kept, not published."""
    reports: list[dict] = []
    server = SimServer("127.0.0.1", free_port(), reporter=reports.append).start()
    server.reports = reports
    yield server
    server.stop()


def _recording(runtime: HttpRuntime) -> list[tuple]:
    calls: list[tuple] = []
    real = runtime.http.request

    def request(method, path, data, headers):
        status, raw = real(method, path, data, headers)
        body = None if data is None else json.loads(data)
        calls.append((method, path, body, status, json.loads(raw or b"{}")))
        return status, raw

    runtime.http.request = request  # type: ignore[method-assign]
    return calls


def _expect_fault(code: str, call, *args, **kwargs) -> None:
    with pytest.raises((RuntimeFault, RuntimeDisconnected)) as raised:
        call(*args, **kwargs)
    assert raised.value.code == code


def test_every_call_request_and_answer_is_as_documented(host):
    control = SimControl(host.url)
    runtime = HttpRuntime(host.url, timeout_s=5)
    calls = _recording(runtime)
    goal = dict(action="set", objective="ship it", client_submit_id="c1", require_live=False)

    # Its goal's turn runs until cancelled, so the state call below finds it running.
    control.session(WS, "s1", turn_duration_ms=0)
    assert runtime.liveness(WS, "s1")["live"] is True
    runtime.resume(WS, "s1", [{"target_operation_id": "old", "target_revision": 1}])
    first = runtime.apply_goal(WS, "s1", operation_id="op-1", revision=1, **goal)
    assert first["phase"] == "applied"
    assert runtime.apply_goal(WS, "s1", operation_id="op-1", revision=1, **goal) == first
    _expect_fault(
        "stale_revision", runtime.apply_goal, WS, "s1", operation_id="op-0", revision=1, **goal
    )
    assert runtime.install_fence(
        WS, "s1", target_operation_id="op-2", target_revision=2, require_live=True
    ) == {"running_turns": []}
    _expect_fault("rejected", runtime.apply_goal, WS, "s1", operation_id="op-2", revision=2, **goal)
    # A prompt waits for the goal's turn (one thing at a time); on an idle session it goes.
    _expect_fault("busy", runtime.submit_prompt, WS, "s1", prompt_id="p-0", text="beside?")
    turn = runtime.submit_prompt(WS, "s6", prompt_id="p-1", text="hello")["turn_id"]
    assert runtime.cancel_turn(
        WS, "s6", turn, operation_id="c-1", reason="a test", require_live=True
    )["result"] in ("canceled", "already_settled", "accepted")
    _expect_fault(
        "not_found",
        runtime.cancel_turn,
        WS,
        "s6",
        "no-such-turn",
        operation_id="c-2",
        reason="a test",
        require_live=True,
    )
    # A run waits for an idle session (the goal's turn runs): refused, nothing started.
    _expect_fault(
        "busy", runtime.start_maintenance, WS, "s1", run_id="r-0", kind="compact", args=None
    )
    # What the host runs now: the goal it applied, its fences, the goal's continuation turn.
    state = runtime.session_state(WS, "s1")
    assert (state.live, state.runtime_epoch) == (True, 1)
    assert (state.goal.operation_id, state.goal.revision, state.goal.objective) == (
        "op-1",
        1,
        "ship it",
    )
    assert state.fences == {("old", 1), ("op-2", 2)}
    assert [t.source_goal_operation_id for t in state.running_turns_of("op-1", 1)] == ["op-1"]
    assert all(t.runtime_epoch == 1 and t.phase in ("submitted", "running") for t in state.turns)
    assert state.maintenance_run_id is None
    # A fence of the running generation answers with its turn still running there.
    (running,) = runtime.install_fence(
        WS, "s1", target_operation_id="op-1", target_revision=1, require_live=True
    )["running_turns"]
    assert running == state.running_turns_of("op-1", 1)[0].turn_id
    # A run on an idle session, the state call naming it; a prompt beside it is refused.
    runtime.start_maintenance(WS, "s5", run_id="r-1", kind="compact", args=None)
    assert runtime.maintenance_status(WS, "s5", "r-1")["state"] == "running"
    assert runtime.session_state(WS, "s5").maintenance_run_id == "r-1"
    _expect_fault("busy", runtime.submit_prompt, WS, "s5", prompt_id="p-2", text="beside it?")
    runtime.cancel_maintenance(WS, "s5", "r-1")
    eventually(lambda: runtime.maintenance_status(WS, "s5", "r-1")["state"] == "done")
    _expect_fault("not_found", runtime.maintenance_status, WS, "s5", "no-such-run")
    # A cancel of a run the host does not know: not_found, and its start is refused after.
    _expect_fault("not_found", runtime.cancel_maintenance, WS, "s5", "r-2")
    _expect_fault(
        "rejected", runtime.start_maintenance, WS, "s5", run_id="r-2", kind="compact", args=None
    )
    # A host that applies later (its report says so), an offline session, a lost one.
    control.session(WS, "s2", goal_mode="accepted", apply_delay_ms=0)
    assert (
        runtime.apply_goal(WS, "s2", operation_id="op-3", revision=1, **goal)["phase"] == "accepted"
    )
    control.session(WS, "s3", live=False)
    assert runtime.liveness(WS, "s3")["live"] is False
    offline = runtime.session_state(WS, "s3")
    assert not offline.live and offline.goal is None and not offline.turns
    _expect_fault(
        "disconnected",
        runtime.install_fence,
        WS,
        "s3",
        target_operation_id="op-1",
        target_revision=1,
        require_live=True,
    )
    control.session(WS, "s4", missing=True)
    _expect_fault("session_not_found", runtime.liveness, WS, "s4")
    _expect_fault("session_not_found", runtime.session_state, WS, "s4")

    answered = set()
    for method, path, body, status, answer in calls:
        name, op = operation_for(method, path)
        if "requestBody" in op:
            validator(_json_schema(op["requestBody"])).validate(body)
        else:
            assert body is None, f"{name} sends no body"
        response = op["responses"]["200"] if status == 200 else op["responses"]["default"]
        validator(_json_schema(response)).validate(answer)
        if status == 200:
            answered.add(name)
    # Every documented call was made and answered, and they are the adapter's calls.
    assert answered == set(OPERATIONS)
    port_calls = {n for n in vars(RuntimePort) if not n.startswith("_") and n != "on_host"}
    documented = {PORT_METHOD.get(name, name) for name in OPERATIONS}
    assert documented == port_calls

    # Its reports: turns of the goal and the prompt, and the accepted goal's application.
    eventually(lambda: any("goal_applied" in r for r in host.reports), what="goal_applied")
    eventually(lambda: any((r.get("turn") or {}).get("phase") == "settled" for r in host.reports))
    report_schema = validator({"$ref": BASE + "#/components/schemas/Report"})
    for report in list(host.reports):
        report_schema.validate(report)
        parse_report(report, utcnow())


def _report(**parts) -> dict:
    return {
        "workspace_id": WS,
        "session_id": "s1",
        "occurred_at_ms": int(time.time() * 1000),
        **parts,
    }


@pytest.mark.parametrize(
    "report",
    [
        _report(extra=1),
        _report(turn={"phase": "running"}),
        _report(turn={"turn_id": "t1", "phase": "paused"}),
        _report(turn={"turn_id": "t1", "phase": "running", "colour": "red"}),
        _report(session={"live": "yes"}),
        _report(goal_applied={"operation_id": "op-1", "revision": 0}),
        {"workspace_id": WS, "session_id": "s1"},
    ],
)
def test_a_report_the_schema_refuses_is_refused(report):
    assert list(validator({"$ref": BASE + "#/components/schemas/Report"}).iter_errors(report))
    with pytest.raises(InvalidArgument):
        parse_report(report, utcnow())


def test_the_protocol_doc_names_exactly_the_documented_calls():
    text = (DOCS / "protocol.md").read_text()
    named = set(re.findall(r"`(GET|POST) (/v1/[^`]+)`", text))
    documented = {
        (method.upper(), template)
        for template, item in SPEC["paths"].items()
        for method in ("get", "post")
        if method in item
    }
    assert named == documented

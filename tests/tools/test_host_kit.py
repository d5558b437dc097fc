"""The host kit (`agent_radar.host`, docs/hosts.md): the protocol's promises kept for the agent,
across a restart of the process too; bad calls refused with nothing changed; every report
signed, as a worker takes it. The example hosts behind real workers are
tests/end_to_end/test_example_hosts.py."""

import json

import pytest

from agent_radar.host import AgentHost, HostError, TimerAgent
from agent_radar.models.base import utcnow
from agent_radar.workflows.activity.activity import parse_report
from agent_radar.workflows.adapters.report_auth import signature_ok
from tests.helpers import eventually

TOKEN = "kit-token"
WS, SID = "ws-kit", "s1"


@pytest.fixture
def backend():
    return "embedded"  # no database or broker: the kit is the host's side


def kit(tmp_path, reports=None):
    return AgentHost(
        TimerAgent(turn_s=0.05, run_s=0.05),
        token=TOKEN,
        host_id="gpu-1",
        state_file=tmp_path / "state.json",
        reporter=None if reports is None else reports.append,
        effects_log=tmp_path / "effects.jsonl",
    )


def goal(host, op, revision, action="set", **more):
    body = {
        "operation_id": op,
        "action": action,
        "objective": f"goal {revision}" if action == "set" else None,
        "revision": revision,
        "client_submit_id": op,
        "require_live": True,
    }
    return host.handle("goal", WS, SID, body | more)


def effects(tmp_path):
    path = tmp_path / "effects.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_restart_keeps_goals_fences_and_answers_and_moves_the_epoch(tmp_path):
    reports: list[dict] = []
    host = kit(tmp_path, reports)
    first = goal(host, "op-1", 1)
    assert first == {
        "phase": "applied",
        "goal": {"objective": "goal 1", "status": "active"},
        "evidence": {"applied_revision": 1},
    }
    host.handle("goal-fences", WS, SID, {"target_operation_id": "op-1", "target_revision": 1})
    assert host.handle("state", WS, SID, {})["turns"]  # the goal's turn runs

    again = kit(tmp_path, reports)  # the process restarts
    state = again.handle("state", WS, SID, {})
    assert (state["runtime_epoch"], state["turns"]) == (2, [])
    assert state["goal"] == {
        "operation_id": "op-1",
        "revision": 1,
        "objective": "goal 1",
        "status": "active",
    }
    assert state["fences"] == [{"target_operation_id": "op-1", "target_revision": 1}]
    assert goal(again, "op-1", 1) == first  # a retry: its answer, no second effect
    with pytest.raises(HostError) as stale:
        goal(again, "op-0", 1)
    assert (stale.value.code, stale.value.extra) == ("stale_revision", {"current_revision": 1})
    assert [e["kind"] for e in effects(tmp_path)] == ["goal", "fence"]
    assert any((r.get("session") or {}).get("runtime_epoch") == 2 for r in reports)


def test_fences_require_live_and_keys_hold(tmp_path):
    host = kit(tmp_path)
    host.handle("goal-fences", WS, SID, {"target_operation_id": "op-5", "target_revision": 5})
    with pytest.raises(HostError) as fenced:
        goal(host, "op-5", 5)
    assert (fenced.value.status, fenced.value.code) == (422, "rejected")
    turn = host.handle("prompts", WS, SID, {"prompt_id": "p-1", "text": "hi"})
    assert host.handle("prompts", WS, SID, {"prompt_id": "p-1", "text": "hi"}) == turn
    cancel = {"operation_id": "c-1", "reason": "test", "require_live": True}
    answer = host.handle(f"turns/{turn['turn_id']}/cancel", WS, SID, cancel)
    assert answer == {"result": "canceled"}
    assert host.handle(f"turns/{turn['turn_id']}/cancel", WS, SID, cancel) == answer
    host.go_offline(WS, SID)
    with pytest.raises(HostError) as offline:
        goal(host, "op-6", 6)
    assert offline.value.code == "disconnected"
    assert host.handle("liveness", WS, SID, {})["live"] is False
    resumed = host.handle("resume", WS, SID, {"fences": []})
    assert resumed == {"live": True, "runtime_epoch": 2}
    run = {"run_id": "r-1", "kind": "compact", "args": {}}
    assert host.handle("maintenance", WS, SID, run) == {"state": "running"}
    assert host.handle("maintenance", WS, SID, run) == {"state": "running"}
    done = eventually(
        lambda: (a := host.handle("maintenance/r-1", WS, SID, {}))["state"] == "done" and a,
        what="the run's end",
    )
    assert done["applied"] is True and done["cancelled"] is False
    kinds = [e["kind"] for e in effects(tmp_path)]
    assert (kinds.count("prompt"), kinds.count("cancel"), kinds.count("maintenance")) == (1, 1, 1)


@pytest.mark.parametrize(
    "call, body",
    [
        ("goal", {"operation_id": "op-1", "action": "set", "revision": "1"}),
        ("goal", {"operation_id": "op-1", "action": "explode", "revision": 1}),
        ("goal", {"operation_id": "", "action": "set", "revision": 1, "objective": "x"}),
        ("goal", {"operation_id": "op-1", "action": "set", "revision": True, "objective": "x"}),
        ("goal-fences", {"target_operation_id": "op-1", "target_revision": -1}),
        ("prompts", {"prompt_id": "p-1", "text": 7}),
        ("maintenance", {"run_id": "r-1", "kind": "compact", "args": [1]}),
        ("resume", {"fences": "all"}),
        ("turns/t-1/cancel", {"reason": "no operation id"}),
    ],
)
def test_a_bad_call_is_refused_and_changes_nothing(tmp_path, call, body):
    host = kit(tmp_path)
    goal(host, "op-0", 1)
    before = (tmp_path / "state.json").read_text(), effects(tmp_path)
    with pytest.raises(HostError) as refused:
        host.handle(call, WS, SID, body)
    assert (refused.value.status, refused.value.code) == (422, "rejected")
    assert ((tmp_path / "state.json").read_text(), effects(tmp_path)) == before


def test_every_report_is_signed_and_taken_as_a_worker_takes_it(tmp_path):
    reports: list[dict] = []
    host = kit(tmp_path, reports)
    goal(host, "op-1", 1)
    eventually(lambda: any(r.get("turn", {}).get("phase") == "settled" for r in reports))
    host.go_offline(WS, SID)
    phases = [r["turn"]["phase"] for r in reports if "turn" in r]
    assert phases == ["running", "settled"]
    for report in reports:
        assert report["signed_by"] == "gpu-1" and signature_ok(report, TOKEN)
        parse_report(report, utcnow())  # refused reports raise
    assert reports[-1]["session"] == {"host_id": "gpu-1", "live": False, "runtime_epoch": 1}

"""Hostile agent-host answers, over real HTTP, on both backends: an answer that is not a JSON
object of the documented shape, or is over 1 MiB, is a `bad_response` fault for that one call
(docs/protocol.md); the rest of the step records normally; a maintenance outcome that cannot be
stored ends the run `failed` and releases the session."""

import json

import pytest

from agent_radar.models.db import run_transaction
from agent_radar.workflows.adapters.answers import MAX_ANSWER_BYTES
from agent_radar.workflows.adapters.http_runtime import HttpRuntime
from agent_radar.workflows.maintenance import runs
from agent_radar.workflows.steps.goals.dispatch import Dispatcher
from agent_radar.workflows.steps.maintenance import MaintenanceExecutor
from tests.hostile import IDLE_STATE, applied

WS = "ws-answers"
BAD_ANSWERS = {
    "null": (200, b"null"),
    "list": (200, b"[]"),
    "string": (200, b'"applied"'),
    "number": (200, b"42"),
    "not-json": (200, b"<html>oops</html>"),
    "no-phase": (200, b'{"goal": null}'),
    "phase-list": (200, b'{"phase": ["applied"]}'),
    "goal-list": (200, b'{"phase": "applied", "goal": [1, 2]}'),
    "goal-nul": (200, b'{"phase": "applied", "goal": {"objective": "a\\u0000b"}}'),
    "goal-nan": (200, b'{"phase": "applied", "goal": {"x": NaN}}'),
    "deep": (200, b'{"phase": "applied", "goal": ' + b'{"a": ' * 2000 + b"1" + b"}" * 2001),
    "huge": (200, b'{"phase": "applied", "pad": "' + b"x" * MAX_ANSWER_BYTES + b'"}'),
    "error-object": (409, b'{"error": {"nested": "code"}, "detail": "\\u0000"}'),
    "error-list": (500, b"[1, 2, 3]"),
}


def test_bad_answers_fault_one_call_and_the_step_records_the_rest(client, settings, host):
    runtime = HttpRuntime(host.url, timeout_s=5.0)
    good = ["good-1", "good-2"]
    for sid in good:
        host.answers[sid] = applied
    host.answers.update(BAD_ANSWERS)
    ops = {
        sid: client.set_goal(WS, sid, f"goal of {sid}", client_submit_id="1")
        for sid in [*good, *BAD_ANSWERS]
    }
    dispatcher = Dispatcher(client.engine, runtime, worker_id="test", lease_s=30.0)
    results = {
        r.operation_id: r.outcome
        for r in dispatcher.dispatch_many([op.operation_id for op in ops.values()])
    }
    for sid in good:
        assert results[ops[sid].operation_id] == "applied", sid
        row = client.get_goal_operation(ops[sid].operation_id)
        assert row.status == "completed" and row.evidence == {"ok": 1}
        assert client.goal_state(WS, sid).sync_status == "synced"
    for sid in BAD_ANSWERS:
        row = client.get_goal_operation(ops[sid].operation_id)
        assert results[row.operation_id] == "retry", (sid, results[row.operation_id])
        assert row.status == "dispatched" and row.lease_token is None, sid
        assert "\x00" not in (row.last_error or "")
        state = client.goal_state(WS, sid)
        assert state.observed is None and state.pending_operation_id == row.operation_id
    assert "bad_response" in client.get_goal_operation(ops["null"].operation_id).last_error
    assert "over 1048576 bytes" in client.get_goal_operation(ops["huge"].operation_id).last_error


def test_the_adapter_turns_every_bad_shape_into_bad_response(host):
    runtime = HttpRuntime(host.url, timeout_s=5.0)
    from agent_radar.workflows.errors import RuntimeFault

    host.answers.update(
        {
            "live-str": (200, b'{"live": "yes"}'),
            "epoch-huge": (200, b'{"live": true, "runtime_epoch": 4294967296}'),
            "cancel-odd": (200, b'{"result": "maybe"}'),
            "turn-nul": (200, b'{"turn_id": "t\\u0000"}'),
            "state-odd": (200, b'{"state": 3}'),
        }
    )
    calls = [
        lambda: runtime.liveness(WS, "live-str"),
        lambda: runtime.liveness(WS, "epoch-huge"),
        lambda: runtime.cancel_turn(
            WS, "cancel-odd", "t1", operation_id="c", reason="", require_live=True
        ),
        lambda: runtime.submit_prompt(WS, "turn-nul", prompt_id="p", text="hi"),
        lambda: runtime.maintenance_status(WS, "state-odd", "r1"),
    ]
    for call in calls:
        with pytest.raises(RuntimeFault) as caught:
            call()
        assert caught.value.code == "bad_response" and caught.value.retryable


@pytest.mark.parametrize(
    "outcome",
    [
        {"input_tokens": 2**31},
        {"summary": "a\x00b"},
        {"result_tokens": -1},
        {"applied": "yes"},
        {"error": {"not": "text"}},
        {"summary": "x" * (runs.MAX_SUMMARY_BYTES + 1)},
    ],
    ids=[
        "tokens-2^31",
        "summary-nul",
        "negative-tokens",
        "applied-str",
        "error-object",
        "summary-huge",
    ],
)
def test_an_unstorable_maintenance_outcome_fails_the_run_and_releases_the_session(
    client, settings, host, outcome
):
    sid = "m1"
    done = {
        "state": "done",
        "applied": True,
        "cancelled": False,
        "error": None,
        "input_tokens": 100,
        "result_tokens": 10,
        "summary": "ok",
        **outcome,
    }
    host.answers[(sid, "maintenance")] = (200, b'{"state": "running"}')
    host.answers[(sid, "state")] = (200, IDLE_STATE)
    host.answers[sid] = (200, json.dumps(done).encode())
    run = client.start_maintenance(WS, sid, client_submit_id="m-1")
    published = []
    executor = MaintenanceExecutor(
        client.engine,
        HttpRuntime(host.url, timeout_s=5.0),
        worker_id="test",
        lease_s=30.0,
        publish=lambda task, kwargs: published.append(task) or True,
        poll_s=0.01,
    )
    assert executor.execute(run.run_id) == "failed"
    final = client.get_maintenance(run.run_id)
    assert final.status == "failed" and final.error_code == "invalid_runtime_answer"
    assert final.summary is None and final.input_tokens is None
    assert not run_transaction(client.engine, lambda s: runs.session_held(s, WS, sid))
    assert "agent_radar.prompt.dispatch" in published  # the session's held work was woken
    # The run's records are stored too: three of them, the last one terminal.
    history = client.history(WS, sid)
    assert [h.payload["record"]["status"] for h in history] == ["failed"]


def test_a_host_s_own_error_codes_make_no_new_metric_series(host):
    """A host answering 418 with a fresh error code each time made a series per code: 200
    series from 200 goals (issue 43). The protocol's codes keep their own label; any other is
    counted as `other`."""
    from itertools import count

    from prometheus_client import REGISTRY

    from agent_radar.workflows.errors import RuntimeDisconnected, RuntimeFault

    runtime = HttpRuntime(host.url, timeout_s=5.0, host_id="teapot")
    codes = count()
    host.answers["brew"] = lambda _body: (
        418,
        json.dumps({"error": f"brew_{next(codes)}"}).encode(),
    )
    host.answers["gone"] = (404, b'{"error": "session_not_found"}')
    for sid in ["brew"] * 50 + ["gone"]:
        with pytest.raises((RuntimeFault, RuntimeDisconnected)):
            runtime.apply_goal(
                "w",
                sid,
                operation_id="o",
                action="set",
                objective="x",
                revision=1,
                client_submit_id="c",
                require_live=False,
            )
    labelled = {
        (sample.labels["code"], sample.value)
        for metric in REGISTRY.collect()
        if metric.name == "agent_radar_runtime_call_errors"
        for sample in metric.samples
        if sample.name.endswith("_total") and sample.labels["host"] == "teapot"
    }
    assert labelled == {("other", 50.0), ("session_not_found", 1.0)}


GOOD_STATE = {
    "live": True,
    "runtime_epoch": 2,
    "goal": {"operation_id": "op", "revision": 3, "objective": "o", "status": "active"},
    "fences": [{"target_operation_id": "old", "target_revision": 1}],
    "turns": [
        {
            "turn_id": "t1",
            "phase": "running",
            "runtime_epoch": 2,
            "origin": "goal_continuation",
            "source_goal_operation_id": "op",
            "source_goal_revision": 3,
            "prompt_id": None,
        }
    ],
    "maintenance": {"run_id": "r1", "state": "running"},
}


@pytest.mark.parametrize(
    "change",
    [
        {"live": "yes"},
        {"runtime_epoch": -1},
        {"goal": {"operation_id": "", "revision": 1}},
        {"goal": {"operation_id": "op", "revision": True}},
        {"goal": {"operation_id": "op", "revision": 1, "status": "sleeping"}},
        {"fences": {"old": 1}},
        {"fences": [{"target_operation_id": "x"}]},
        {"fences": [{"target_operation_id": "x", "target_revision": 1}] * 10_001},
        {"turns": [{"turn_id": "t", "phase": "settled", "runtime_epoch": 1, "origin": "x"}]},
        {
            "turns": [
                {"turn_id": "t\n", "phase": "running", "runtime_epoch": 1, "origin": "user_prompt"}
            ]
        },
        {"turns": [{"turn_id": "t", "phase": "running", "origin": "user_prompt"}]},
        {"turns": ["t1"]},
        {"maintenance": {"run_id": "r1", "state": "done"}},
        {"maintenance": "r1"},
    ],
)
def test_a_session_state_of_another_shape_is_a_bad_response(host, change):
    """The host's state is what the control plane decides from: an answer of another shape
    faults that one call, and never reads as a state (docs/protocol.md: session state)."""
    from agent_radar.workflows.errors import RuntimeFault

    runtime = HttpRuntime(host.url, timeout_s=5.0)
    host.answers["s"] = (200, json.dumps({**GOOD_STATE, **change}).encode())
    with pytest.raises(RuntimeFault) as fault:
        runtime.session_state("w", "s")
    assert fault.value.code == "bad_response"


def test_a_session_state_is_parsed_into_a_typed_value(host):
    runtime = HttpRuntime(host.url, timeout_s=5.0)
    host.answers["s"] = (200, json.dumps({**GOOD_STATE, "newer_field": [1]}).encode())
    state = runtime.session_state("w", "s")
    assert state.live and state.runtime_epoch == 2 and state.goal.revision == 3
    assert state.fences == {("old", 1)} and state.maintenance_run_id == "r1"
    assert [t.turn_id for t in state.running_turns_of("op", 3)] == ["t1"]
    assert state.running_turns_of("op", 2) == ()

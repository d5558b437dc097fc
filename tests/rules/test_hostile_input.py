"""Hostile input at the client and in reports, on both backends: every bad value is a typed
InvalidArgument and writes nothing; reports are scoped to their own workspace and session;
a fence's clear cannot be squatted; by-id calls take the caller's workspace."""

import time

import pytest
from sqlalchemy.exc import DataError, OperationalError

from agent_radar.workflows import ids
from agent_radar.workflows.errors import InvalidArgument, NotFound
from agent_radar.workflows.steps import prompt_dispatch
from agent_radar.workflows.validation import MAX_INT, MAX_REPORT_SKEW_S
from tests.helpers import row_counts

WS, SID = "ws-input", "s1"


def now_ms(offset_s: float = 0.0) -> int:
    return int((time.time() + offset_s) * 1000)


def report(**parts):
    return {"workspace_id": WS, "session_id": SID, "occurred_at_ms": now_ms(), **parts}


BAD_CALLS = {
    "flush timeout as text": lambda c: c.flush("10"),
    "flush timeout negative": lambda c: c.flush(-1),
    "flush timeout NaN": lambda c: c.flush(float("nan")),
    "flush timeout infinite": lambda c: c.flush(float("inf")),
    "flush timeout as a bool": lambda c: c.flush(True),
    "objective with NUL": lambda c: c.set_goal(WS, SID, "a\x00b", client_submit_id="1"),
    "objective with a lone surrogate": lambda c: c.set_goal(
        WS, SID, "a\ud800", client_submit_id="1"
    ),
    "expected revision 2^31": lambda c: c.set_goal(
        WS, SID, "x", client_submit_id="1", expected_revision=MAX_INT + 1
    ),
    "unhashable action": lambda c: c.goal_control(WS, SID, ["set"], "x", client_submit_id="1"),
    "reserved submit id": lambda c: c.clear_goal(
        WS, SID, client_submit_id="goal-generation-fence:x"
    ),
    "unhashable kind": lambda c: c.start_maintenance(WS, SID, ["compact"], client_submit_id="m"),
    "dict kind": lambda c: c.start_maintenance(WS, SID, {"k": 1}, client_submit_id="m"),
    "turn 2^31": lambda c: c.start_maintenance(
        WS, SID, "summarize_up_to", client_submit_id="m", args={"turn": MAX_INT + 1}
    ),
    "prompt with NUL": lambda c: c.submit_prompt(WS, SID, "hi\x00", client_submit_id="p"),
    "prompt with a lone surrogate": lambda c: c.submit_prompt(
        WS, SID, "\udfff", client_submit_id="p"
    ),
    "prompt not text": lambda c: c.submit_prompt(WS, SID, b"bytes", client_submit_id="p"),
    "fence reason with NUL": lambda c: c.fence_goal_generation(
        WS, SID, "op", client_submit_id="f", reason="\x00"
    ),
    "fence reason not text": lambda c: c.fence_goal_generation(
        WS, SID, "op", client_submit_id="f", reason=7
    ),
    "history limit text": lambda c: c.history(WS, SID, limit="abc"),
    "history limit -1": lambda c: c.history(WS, SID, limit=-1),
    "history limit 0": lambda c: c.history(WS, SID, limit=0),
    "history limit huge": lambda c: c.history(WS, SID, limit=10**9),
    "history limit float": lambda c: c.history(WS, SID, limit=1.5),
    "by-id with a bad workspace": lambda c: c.get_goal_operation("x", workspace_id=""),
    "by-id with a list": lambda c: c.get_fence(["x"]),
    "report dated year 9999": lambda c: c.report_activity(
        report(occurred_at_ms=253402300799000, session={"live": False})
    ),
    "report dated 2 minutes ahead": lambda c: c.report_activity(
        report(occurred_at_ms=now_ms(120), session={"live": False})
    ),
    "report timestamp 10^30": lambda c: c.report_activity(report(occurred_at_ms=10**30)),
    "report timestamp negative": lambda c: c.report_activity(report(occurred_at_ms=-1)),
    "report timestamp float": lambda c: c.report_activity(report(occurred_at_ms=1.5)),
    "report epoch 2^31": lambda c: c.report_activity(report(session={"runtime_epoch": 2**31})),
    "report revision 2^31": lambda c: c.report_activity(
        report(goal_applied={"operation_id": "x", "revision": 2**31})
    ),
    "report goal with NUL": lambda c: c.report_activity(
        report(goal_applied={"operation_id": "x", "revision": 1, "goal": {"objective": "\x00"}})
    ),
    "report goal with NaN": lambda c: c.report_activity(
        report(goal_applied={"operation_id": "x", "revision": 1, "goal": {"n": float("nan")}})
    ),
    "report goal with int keys": lambda c: c.report_activity(
        report(goal_applied={"operation_id": "x", "revision": 1, "goal": {1: "a"}})
    ),
    "report goal_applied extra field": lambda c: c.report_activity(
        report(goal_applied={"operation_id": "x", "revision": 1, "pwned": True})
    ),
    "report turn phase unhashable": lambda c: c.report_activity(
        report(turn={"turn_id": "t", "phase": ["running"]})
    ),
    "report provider with NUL": lambda c: c.report_activity(report(session={"provider": "a\x00"})),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_input_is_a_typed_error_and_writes_nothing(client, name):
    client.set_goal(WS, "other", "seed", client_submit_id="seed")
    before = row_counts(client.engine)
    with pytest.raises(InvalidArgument):
        BAD_CALLS[name](client)
    assert row_counts(client.engine) == before


@pytest.mark.parametrize("timeout", ["10", -1, float("nan"), float("inf"), True, None, 86401])
def test_a_bad_wait_timeout_is_a_typed_error_at_once(client, timeout):
    """A NaN deadline would never pass: the wait would poll for ever."""
    op = client.set_goal(WS, SID, "x", client_submit_id="1")
    started = time.monotonic()
    with pytest.raises(InvalidArgument) as caught:
        client.wait(op, timeout=timeout)
    assert caught.value.field == "timeout"
    assert time.monotonic() - started < 1.0


def test_wait_takes_any_number_of_seconds_in_range(client):
    op = client.set_goal(WS, SID, "x", client_submit_id="1")
    with pytest.raises(TimeoutError):
        client.wait(op, timeout=0)  # no worker here: it stays open
    with pytest.raises(TimeoutError):
        client.wait(op, timeout=0.2)


def test_flush_takes_any_number_of_seconds_in_range(client):
    client.set_goal(WS, SID, "x", client_submit_id="1")
    assert client.flush(5) is True
    assert client.flush(0) is True  # nothing waits any more
    assert client.flush(2.5) is True


def test_a_report_slightly_ahead_is_accepted_and_a_rejected_one_freezes_nothing(client):
    with pytest.raises(InvalidArgument):
        client.report_activity(report(occurred_at_ms=253402300799000, session={"live": False}))
    client.report_activity(
        report(
            occurred_at_ms=now_ms(MAX_REPORT_SKEW_S / 2),
            session={"live": True, "provider": "claude-code"},
        )
    )
    info = client.session_info(WS, SID)
    assert info.live is True and info.provider == "claude-code"


def test_a_report_cannot_touch_another_workspaces_prompt(client, sim_control):
    prompt = client.submit_prompt(WS, SID, "hello", client_submit_id="p-1")
    assert prompt_dispatch.dispatch_next(client.engine, client.runtime, WS, SID) == "dispatched"
    turn_id = client.get_prompt(prompt.prompt_id).turn_id
    # Another workspace, then another session of this workspace, name the prompt: neither
    # may touch it.
    for workspace_id, session_id in (("ws-attacker", SID), (WS, "another-session")):
        settle = {
            "turn_id": turn_id,
            "phase": "settled",
            "outcome": "failed",
            "prompt_id": prompt.prompt_id,
        }
        client.report_activity(
            {
                "workspace_id": workspace_id,
                "session_id": session_id,
                "occurred_at_ms": now_ms(),
                "turn": settle,
            }
        )
        assert client.get_prompt(prompt.prompt_id).status == "dispatched"
    client.report_activity(
        report(
            turn={
                "turn_id": turn_id,
                "phase": "settled",
                "outcome": "completed",
                "prompt_id": prompt.prompt_id,
            }
        )
    )
    assert client.get_prompt(prompt.prompt_id).status == "completed"


def test_by_id_calls_take_the_callers_workspace(client):
    op = client.set_goal(WS, SID, "mine", client_submit_id="g-1")
    fence = client.fence_goal_generation(WS, SID, op.operation_id, client_submit_id="f-1")
    prompt = client.submit_prompt(WS, SID, "hi", client_submit_id="p-1")
    run = client.start_maintenance(WS, "s2", client_submit_id="m-1")
    lookups = [
        lambda ws: client.get_goal_operation(op.operation_id, workspace_id=ws),
        lambda ws: client.get_fence(fence.fence_id, workspace_id=ws),
        lambda ws: client.get_prompt(prompt.prompt_id, workspace_id=ws),
        lambda ws: client.get_maintenance(run.run_id, workspace_id=ws),
    ]
    for lookup in lookups:
        assert lookup(WS) is not None
        with pytest.raises(NotFound):
            lookup("ws-other")
    with pytest.raises(NotFound):
        client.cancel_maintenance(run.run_id, workspace_id="ws-other")
    assert client.get_maintenance(run.run_id).status == "running"
    assert client.cancel_maintenance(run.run_id, workspace_id=WS).status == "cancelling"


def test_a_client_cannot_squat_a_fences_clear(client):
    op = client.set_goal(WS, SID, "shared goal", client_submit_id="g-1")
    fence_id = ids.fence_id(WS, SID, "revoke-1")
    squat = f"goal-generation-fence:{fence_id}"
    for call in (
        lambda: client.clear_goal(WS, SID, client_submit_id=squat),
        lambda: client.set_goal(WS, SID, "mine now", client_submit_id=squat),
    ):
        with pytest.raises(InvalidArgument):
            call()
    fence = client.fence_goal_generation(WS, SID, op.operation_id, client_submit_id="revoke-1")
    assert fence.fence_id == fence_id
    clear = client.get_goal_operation(fence.clear_operation_id)
    assert clear.operation_id == ids.fence_clear_operation_id(WS, SID, fence_id)
    assert clear.operation_id != ids.goal_operation_id(WS, SID, squat)
    assert (clear.origin, clear.action, clear.client_submit_id) == ("fence", "clear", squat)
    state = client.goal_state(WS, SID)
    assert state.tombstoned and state.pending_operation_id == clear.operation_id


@pytest.mark.parametrize("backend", ["embedded"])
def test_public_tasks_retry_only_connection_level_database_errors(backend, monkeypatch):
    from celery.exceptions import Reject

    import agent_radar.tasks.goal_tasks  # noqa: F401 - registers the task
    from agent_radar.tasks.app import app
    from agent_radar.tasks.worker_process import WorkerProcess

    def failing(error):
        class Client:
            def goal_control(self, *args, **kwargs):
                raise error

        return property(lambda process: Client())

    task = app.tasks["agent_radar.goal_control"]
    kwargs = dict(
        workspace_id=WS, session_id=SID, action="set", objective="x", client_submit_id="1"
    )
    permanent = DataError("INSERT …", {}, Exception("invalid byte sequence"))
    monkeypatch.setattr(WorkerProcess, "client", failing(permanent))
    with pytest.raises(Reject):
        task(**kwargs)
    down = OperationalError("SELECT 1", {}, Exception("connection refused"))
    monkeypatch.setattr(WorkerProcess, "client", failing(down))
    # Called directly, Celery's retry re-raises the cause instead of publishing a retry.
    with pytest.raises(OperationalError):
        task(**kwargs)
    monkeypatch.setattr(WorkerProcess, "client", failing(ZeroDivisionError("bug")))
    with pytest.raises(Reject):
        task(**kwargs)

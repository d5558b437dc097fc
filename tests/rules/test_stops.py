"""Session stop (docs/lifecycles.md: sessions), on both backends: one idempotent operation that
cancels the running turn (a durable cancel) and the active maintenance run; queued work stays
queued; the record settles when both have ended."""

import time

import pytest

from agent_radar.models.db import run_transaction
from agent_radar.models.operations import CancelOperation
from agent_radar.workflows import ids
from agent_radar.workflows.adapters.http_runtime import HttpRuntime
from agent_radar.workflows.errors import Conflict, InvalidArgument, NotFound
from agent_radar.workflows.steps.maintenance import MaintenanceExecutor
from tests.helpers import row_counts

WS, SID = "ws-stop", "s1"


def report_turn(client, turn_id, phase, outcome=None):
    client.report_activity(
        {
            "workspace_id": WS,
            "session_id": SID,
            "occurred_at_ms": int(time.time() * 1000),
            "turn": {"turn_id": turn_id, "phase": phase, "outcome": outcome},
        }
    )


def test_stop_cancels_the_turn_and_the_run_and_leaves_queued_work(client, sim_control, settings):
    sim_control.session(WS, SID, maintenance_duration_ms=3000)
    run = client.start_maintenance(WS, SID, client_submit_id="m1")
    report_turn(client, "t1", "running")
    prompt = client.submit_prompt(WS, SID, "later", client_submit_id="p1")
    goal = client.set_goal(WS, SID, "held by the run", client_submit_id="g1")

    stop = client.stop_session(WS, SID, client_submit_id="stop-1", reason="user pressed stop")
    assert (stop.status, stop.settled, stop.turn_id, stop.run_id) == (
        "stopping",
        False,
        "t1",
        run.run_id,
    )
    assert stop.cancel_operation_id == ids.cancel_operation_id(WS, SID, "t1")
    cancel = run_transaction(
        client.engine, lambda s: s.get(CancelOperation, stop.cancel_operation_id)
    )
    assert (cancel.status, cancel.reason) == ("prepared", f"session-stop:{stop.stop_id}")
    assert client.get_maintenance(run.run_id).status == "cancelling"
    assert client.get_prompt(prompt.prompt_id).status == "queued"
    assert client.get_goal_operation(goal.operation_id).status == "prepared"

    before = row_counts(client.engine)
    again = client.stop_session(WS, SID, client_submit_id="stop-1", reason="user pressed stop")
    assert again == stop
    with pytest.raises(Conflict):
        client.stop_session(WS, SID, client_submit_id="stop-1", reason="another reason")
    assert row_counts(client.engine) == before

    report_turn(client, "t1", "settled", "canceled")  # the turn's end
    assert not client.get_session_stop(stop.stop_id).settled  # the run is still going
    executor = MaintenanceExecutor(
        client.engine,
        HttpRuntime(settings.runtime_url),
        worker_id="w",
        lease_s=5,
        publish=lambda *a: True,
        poll_s=0.02,
    )
    assert executor.execute(run.run_id) == "cancelled"
    done = client.wait(client.get_session_stop(stop.stop_id), timeout=5)
    assert (done.status, done.settled) == ("completed", True)
    assert client.get_prompt(prompt.prompt_id).status == "queued"
    assert [h.kind for h in client.history(WS, SID)].count("session-stop") == 1


def test_stopping_an_idle_session_is_settled_at_once(client):
    stop = client.stop_session(WS, SID, client_submit_id="stop-1")
    assert (stop.status, stop.settled, stop.turn_id, stop.run_id) == (
        "completed",
        True,
        None,
        None,
    )
    assert client.get_session_stop(stop.stop_id, workspace_id=WS) == stop
    with pytest.raises(NotFound):
        client.get_session_stop(stop.stop_id, workspace_id="ws-other")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"client_submit_id": "s", "reason": "a\x00b"},
        {"client_submit_id": "s", "reason": 7},
        {"client_submit_id": "goal-generation-fence:x"},
        {"client_submit_id": ""},
    ],
)
def test_bad_stop_input_writes_nothing(client, kwargs):
    before = row_counts(client.engine)
    with pytest.raises(InvalidArgument):
        client.stop_session(WS, SID, **kwargs)
    assert row_counts(client.engine) == before


def test_a_prompt_whose_turn_a_stop_cancels_ends_cancelled_and_the_queue_goes_on(
    client, sim_control
):
    """A session stop while a prompt's turn runs: the cancel reaches the host, the turn ends
    `canceled` there, and the prompt ends `cancelled` (it was `completed`, as if its turn had
    done its work); the next prompt is sent. Counted at the simulator host. The session's
    history shows the prompts (it had none of them)."""
    from agent_radar.workflows.steps.prompt_dispatch import dispatch_next
    from tests.helpers import cancel_runner, first_of_two_prompts_sent

    first, second = first_of_two_prompts_sent(client, sim_control, WS, SID)
    t1 = client.get_prompt(first.prompt_id).turn_id
    running = {"turn_id": t1, "prompt_id": first.prompt_id, "origin": "user_prompt"}
    client.report_activity(
        {
            "workspace_id": WS,
            "session_id": SID,
            "occurred_at_ms": int(time.time() * 1000),
            "turn": {**running, "phase": "running"},
        }
    )
    stop = client.stop_session(WS, SID, client_submit_id="stop-1")
    assert cancel_runner(client).apply(stop.cancel_operation_id) == "settled"
    at_host = sim_control.session(WS, SID)["turns"][t1]
    assert (at_host["phase"], at_host["outcome"]) == ("settled", "canceled")
    # The host's answer to the cancel ends it: no report of that end is needed (lost).
    assert client.get_prompt(first.prompt_id).status == "cancelled"

    client.report_activity(  # the host's report of that end, late: it changes nothing
        {
            "workspace_id": WS,
            "session_id": SID,
            "occurred_at_ms": int(time.time() * 1000),
            "turn": {**running, "phase": "settled", "outcome": "canceled"},
        }
    )
    ended = client.wait(client.get_prompt(first.prompt_id), timeout=5)
    assert (ended.status, ended.settled) == ("cancelled", True)
    assert client.wait(client.get_session_stop(stop.stop_id), timeout=5).status == "completed"
    assert dispatch_next(client.engine, client.runtime, WS, SID) == "dispatched"
    sent = client.get_prompt(second.prompt_id)
    assert sent.status == "dispatched"
    at_host = sim_control.session(WS, SID)
    assert at_host["turns"][sent.turn_id]["phase"] == "running"
    assert sorted(at_host["turns"]) == sorted([t1, sent.turn_id])  # one turn a prompt

    # The session's history shows both prompts, once each (a replay adds none).
    assert client.submit_prompt(WS, SID, "first", client_submit_id="p1") == ended
    prompts = [h.record_id for h in client.history(WS, SID) if h.kind == "prompt"]
    assert prompts == [f"prompt:{first.prompt_id}", f"prompt:{second.prompt_id}"]

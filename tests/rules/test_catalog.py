"""Every kind of operation found by id and by client submit ID, and listed by kind, status,
workspace, session and age (docs/operations.md), on both backends."""

from datetime import timedelta

import pytest
from sqlalchemy import update

from agent_radar.models.base import utcnow
from agent_radar.models.db import run_transaction
from agent_radar.models.operations import CancelOperation, GoalFence
from agent_radar.workflows.errors import InvalidArgument, NotFound, WaitTimedOut
from agent_radar.workflows.fences import cancels
from agent_radar.workflows.kinds import cancel as cancel_kind
from agent_radar.workflows.kinds import fence as fence_kind
from agent_radar.workflows.kinds import goal as goal_kind
from agent_radar.workflows.kinds import maintenance as maintenance_kind
from agent_radar.workflows.kinds import prompt as prompt_kind
from agent_radar.workflows.kinds import stop as stop_kind

WS, SID = "ws-catalog", "s1"


def seed(client):
    goal = client.set_goal(WS, SID, "shared", client_submit_id="same-id")
    fence = client.fence_goal_generation(WS, SID, goal.operation_id, client_submit_id="f1")
    prompt = client.submit_prompt(WS, SID, "hello", client_submit_id="same-id")
    run = client.start_maintenance(WS, "s2", client_submit_id="m1")
    stop = client.stop_session(WS, "s3", client_submit_id="stop-1")
    cancel = run_transaction(
        client.engine, lambda s: cancels.prepare(s, WS, SID, "turn-1", "stale", utcnow())
    )
    other = client.set_goal("ws-other", SID, "theirs", client_submit_id="same-id")
    return goal, fence, prompt, run, stop, cancel, other


def test_every_kind_is_found_by_id(client):
    goal, fence, prompt, run, stop, cancel, other = seed(client)
    for op_id, record_type in [
        (goal.operation_id, goal_kind.GoalOperation),
        (fence.fence_id, fence_kind.Fence),
        (fence.clear_operation_id, goal_kind.GoalOperation),
        (prompt.prompt_id, prompt_kind.Prompt),
        (run.run_id, maintenance_kind.MaintenanceRun),
        (stop.stop_id, stop_kind.SessionStop),
        (cancel.operation_id, cancel_kind.TurnCancel),
    ]:
        found = client.get_operation(op_id, workspace_id=WS)
        assert isinstance(found, record_type) and found.workspace_id == WS
    with pytest.raises(NotFound):
        client.get_operation(other.operation_id, workspace_id=WS)  # another workspace
    assert client.get_operation(other.operation_id).workspace_id == "ws-other"
    with pytest.raises(NotFound):
        client.get_operation("no-such-id")
    with pytest.raises(InvalidArgument):
        client.get_operation("")


def test_a_client_submit_id_is_found_in_every_family_that_has_it(client):
    goal, _fence, prompt, *_ = seed(client)
    found = client.find_operations(WS, SID, "same-id")
    assert sorted(type(r).__name__ for r in found) == ["GoalOperation", "Prompt"]
    assert {getattr(r, "operation_id", None) or r.prompt_id for r in found} == {
        goal.operation_id,
        prompt.prompt_id,
    }
    assert client.find_operations(WS, "s2", "same-id") == []
    assert [r.run_id for r in client.find_operations(WS, "s2", "m1")] == [
        client.list_operations(kind="maintenance")[0].id
    ]


def test_operations_are_listed_by_kind_status_place_and_age(client):
    goal, fence, prompt, run, stop, cancel, other = seed(client)
    everything = client.list_operations(limit=100)
    assert {o.kind for o in everything} == {
        "goal",
        "fence",
        "prompt",
        "maintenance",
        "stop",
        "cancel",
    }
    assert [o.created_at for o in everything] == sorted(o.created_at for o in everything)
    assert {o.id for o in client.list_operations(workspace_id="ws-other")} == {other.operation_id}
    assert {o.id for o in client.list_operations(kind="fence")} == {fence.fence_id}
    in_session = client.list_operations(workspace_id=WS, session_id=SID, limit=100)
    assert {o.session_id for o in in_session} == {SID}
    assert {o.id for o in client.list_operations(kind="stop", status="completed")} == {
        stop.stop_id  # nothing ran in s3: it settled at once
    }
    assert client.list_operations(kind="stop", status="stopping") == []
    assert {o.id for o in client.list_operations(kind="maintenance", status="running")} == {
        run.run_id
    }

    # A fence out of budget, an hour old: found by status and age, with its reason.
    an_hour_ago = utcnow() - timedelta(hours=1)
    run_transaction(
        client.engine,
        lambda s: s.execute(
            update(GoalFence).values(
                status="failed",
                last_error="budget_exhausted (24 attempts): 503",
                created_at=an_hour_ago,
            )
        ),
    )
    old_failed = client.list_operations(status="failed", older_than_s=1800)
    assert [(o.kind, o.id, o.last_error) for o in old_failed] == [
        ("fence", fence.fence_id, "budget_exhausted (24 attempts): 503")
    ]
    assert client.list_operations(status="failed", older_than_s=7200) == []
    assert len(client.list_operations(limit=2)) == 2


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kind": "turn"},
        {"kind": 3},
        {"status": ""},
        {"session_id": SID},  # a session needs its workspace
        {"older_than_s": -1},
        {"older_than_s": "1h"},
        {"older_than_s": True},
        {"limit": 0},
        {"limit": 10**6},
        {"workspace_id": "a\x00b"},
    ],
)
def test_bad_list_filters_are_refused(client, kwargs):
    with pytest.raises(InvalidArgument):
        client.list_operations(**kwargs)


@pytest.mark.parametrize(
    "args",
    [("", SID, "x"), (WS, None, "x"), (WS, SID, "a\x00b"), (WS, SID, 7), (WS, SID, "x" * 256)],
)
def test_bad_find_arguments_are_refused(client, args):
    with pytest.raises(InvalidArgument):
        client.find_operations(*args)


def test_wait_takes_a_record_of_every_kind(client):
    """`wait` reads each kind through its declaration (workflows/kinds/): a
    settled record of any kind comes back at once, an open one times out naming it, and
    anything that is no operation's record is refused."""
    goal, fence, prompt, run, stop, cancel_row, _other = seed(client)
    cancel = client.get_operation(cancel_row.operation_id)
    assert stop.settled  # a session with no turn and no run stops at once
    assert client.wait(stop, timeout=0).stop_id == stop.stop_id
    assert client.wait(goal, timeout=0).status == "superseded"  # the fence cleared the goal
    for record in (fence, prompt, run, cancel):
        # The client's own error (docs/packaging.md), and a TimeoutError too.
        with pytest.raises(WaitTimedOut, match=f"is still {record.status} after 0") as ran_out:
            client.wait(record, timeout=0)
        assert isinstance(ran_out.value, TimeoutError) and ran_out.value.code == "timeout"
        assert ran_out.value.status == record.status
    run_transaction(
        client.engine,
        lambda s: s.execute(
            update(CancelOperation)
            .where(CancelOperation.operation_id == cancel.operation_id)
            .values(status="completed")
        ),
    )
    assert client.wait(cancel, timeout=0).status == "completed"
    with pytest.raises(InvalidArgument, match="cannot wait on dict"):
        client.wait({"operation_id": goal.operation_id})

"""Runtime epochs (DESIGN 4.9), on both backends: a newer epoch at the host ends the turns
and the maintenance run of older ones, and every durable fence goes back to the host once,
before any goal call reaches the session again."""

import time

from models.db import run_transaction
from models.tables import AgentSession, GoalFence, Turn
from workflows.adapters.runtime import HttpRuntime
from workflows.goals.dispatch import Dispatcher
from workflows.maintenance import runs

WS, SID = "ws-epochs", "s1"


def report(client, **parts):
    client.report_activity(
        {"workspace_id": WS, "session_id": SID, "occurred_at_ms": int(time.time() * 1000), **parts}
    )


def session_row(client):
    return run_transaction(client.engine, lambda s: s.get(AgentSession, (WS, SID)))


def fence_row(client, fence):
    return run_transaction(client.engine, lambda s: s.get(GoalFence, fence.fence_id))


def turn_row(client, turn_id):
    return run_transaction(client.engine, lambda s: s.get(Turn, (WS, SID, turn_id)))


def calls_of(sim_control):
    return [c["call"] for c in sim_control.calls() if c["session_id"] == SID]


def test_the_first_epoch_learnt_is_no_restart(client):
    report(client, turn={"turn_id": "t0", "phase": "running"})
    assert turn_row(client, "t0").runtime_epoch == 0
    report(client, session={"runtime_epoch": 1})
    assert turn_row(client, "t0").phase == "running"
    assert session_row(client).runtime_epoch == 1
    report(client, session={"runtime_epoch": 1}, turn={"turn_id": "t1", "phase": "running"})
    assert turn_row(client, "t1").runtime_epoch == 1


def test_a_newer_epoch_ends_older_turns_and_the_run_and_brings_the_fences_back(
    client, sim_control, settings
):
    report(client, session={"runtime_epoch": 1})
    target = client.set_goal(WS, SID, "shared goal", client_submit_id="g1")
    fence = client.fence_goal_generation(WS, SID, target.operation_id, client_submit_id="f1")
    run = client.start_maintenance(WS, SID, client_submit_id="m1")
    assert run.runtime_epoch == 1
    prompt = client.submit_prompt(WS, SID, "hello", client_submit_id="p1")
    report(client, turn={"turn_id": "t-old", "phase": "running", "prompt_id": prompt.prompt_id})
    assert turn_row(client, "t-old").runtime_epoch == 1

    report(client, session={"runtime_epoch": 2})  # the host restarted

    old = turn_row(client, "t-old")
    assert (old.phase, old.outcome) == ("settled", "interrupted")
    assert session_row(client).active_turn_id is None
    ended = client.get_maintenance(run.run_id)
    assert (ended.status, ended.error_code) == ("interrupted", "runtime_restarted")
    assert not run_transaction(client.engine, lambda s: runs.session_held(s, WS, SID))
    assert session_row(client).runtime_epoch == 2
    assert fence_row(client, fence).installed_epoch is None  # the fence must go there

    # The next goal call reaches the host only after every durable fence was installed.
    dispatcher = Dispatcher(
        client.engine, HttpRuntime(settings.runtime_url), worker_id="d", lease_s=5
    )
    op = client.set_goal(WS, SID, "the owner's new goal", client_submit_id="g2")
    assert [r.outcome for r in dispatcher.dispatch(op.operation_id)] == ["applied"]
    assert calls_of(sim_control) == ["goal-fences", "goal"]
    assert sim_control.session(WS, SID)["fences"] == [[target.operation_id, 1]]
    assert fence_row(client, fence).installed_epoch == 2
    again = client.set_goal(WS, SID, "and another", client_submit_id="g3")
    dispatcher.dispatch(again.operation_id)
    assert calls_of(sim_control) == ["goal-fences", "goal", "goal"]  # once per epoch
    assert client.get_fence(fence.fence_id).status == "pending"  # its delivery is its own


def test_epochs_only_grow_whatever_order_reports_arrive_in(client):
    report(client, session={"runtime_epoch": 3})
    report(client, session={"runtime_epoch": 2}, turn={"turn_id": "t", "phase": "running"})
    assert session_row(client).runtime_epoch == 3
    assert turn_row(client, "t").runtime_epoch == 3


def test_ensure_session_reinstalls_fences_only_at_a_newer_epoch(client, sim_control, settings):
    from workflows.fences.apply import FenceApplier

    target = client.set_goal(WS, SID, "shared", client_submit_id="g1")
    fence = client.fence_goal_generation(WS, SID, target.operation_id, client_submit_id="f1")
    applier = FenceApplier(
        client.engine,
        HttpRuntime(settings.runtime_url),
        worker_id="a",
        lease_s=5,
        publish=lambda *a: True,
    )
    assert applier.apply(fence.fence_id) == "completed"
    installs = lambda: calls_of(sim_control).count("goal-fences")  # noqa: E731
    assert installs() == 1  # installed while the host's epoch was not known
    assert fence_row(client, fence).installed_epoch == 0
    # The first epoch learnt is no proof the fence is there (the host may have restarted
    # since): it goes there once more.
    assert client.ensure_session(WS, SID).runtime_epoch == 1
    assert installs() == 2
    client.ensure_session(WS, SID)
    assert installs() == 2  # same epoch: nothing reinstalled
    sim_control.session(WS, SID, restart=True)  # the host restarts: its fences are gone
    assert sim_control.session(WS, SID)["fences"] == []
    info = client.ensure_session(WS, SID)
    assert info.runtime_epoch == 2 and info.live is True
    assert installs() == 3
    assert sim_control.session(WS, SID)["fences"] == [[target.operation_id, 1]]
    assert fence_row(client, fence).installed_epoch == 2
    assert "resume" not in calls_of(sim_control)


def test_a_background_liveness_answer_at_a_newer_epoch_counts(client, sim_control, settings):
    from models.base import utcnow
    from workflows.fences import cancels
    from workflows.fences.apply import CancelRunner

    report(client, session={"runtime_epoch": 1})
    report(client, turn={"turn_id": "t-old", "phase": "running"})
    cancel = run_transaction(
        client.engine, lambda s: cancels.prepare(s, WS, SID, "t-old", "stale", utcnow())
    )
    sim_control.session(WS, SID, restart=True)  # the host restarted: epoch 2, no reports yet
    published = []
    runner = CancelRunner(
        client.engine,
        HttpRuntime(settings.runtime_url),
        worker_id="w",
        lease_s=3,
        publish=lambda task, kwargs: published.append((task, kwargs)) or True,
    )
    assert runner.apply(cancel.operation_id) == "interrupted"
    assert session_row(client).runtime_epoch == 2
    old = turn_row(client, "t-old")
    assert (old.phase, old.outcome) == ("settled", "interrupted")
    done = run_transaction(client.engine, lambda s: s.get(type(cancel), cancel.operation_id))
    assert (done.status, done.result) == ("completed", "interrupted")
    assert calls_of(sim_control) == ["liveness"]  # no cancel reached the new process
    assert ("agent_radar.prompt.dispatch", {"workspace_id": WS, "session_id": SID}) in published

"""Runtime epochs (docs/lifecycles.md: sessions), on both backends: a newer epoch at the host ends
the turns and the maintenance run of older ones, and every durable fence goes back to the host once,
before any goal call reaches the session again."""

import time

import pytest

from agent_radar.models.db import run_transaction
from agent_radar.models.operations import GoalFence
from agent_radar.models.tables import AgentSession, Turn
from agent_radar.workflows.adapters.http_runtime import HttpRuntime
from agent_radar.workflows.maintenance import runs
from agent_radar.workflows.steps.goals.dispatch import Dispatcher
from tests.helpers import restorer

WS, SID = "ws-epochs", "s1"


def report(client, **parts):
    client.report_activity(
        {"workspace_id": WS, "session_id": SID, "occurred_at_ms": int(time.time() * 1000), **parts}
    )


def restore(client, settings):
    """What a worker does with the restore a report asked for: confirm the epoch with the
    host (its liveness answer) and put the fences there."""
    return restorer(client).restore(WS, SID)


def session_row(client):
    return run_transaction(client.engine, lambda s: s.get(AgentSession, (WS, SID)))


def fence_row(client, fence):
    return run_transaction(client.engine, lambda s: s.get(GoalFence, fence.fence_id))


def turn_row(client, turn_id):
    return run_transaction(client.engine, lambda s: s.get(Turn, (WS, SID, turn_id)))


def calls_of(sim_control):
    return [c["call"] for c in sim_control.calls() if c["session_id"] == SID]


def test_the_first_epoch_learnt_is_no_restart(client, sim_control, settings):
    sim_control.session(WS, SID, turn={"turn_id": "t0"})  # it runs at the host
    report(client, turn={"turn_id": "t0", "phase": "running"})
    assert turn_row(client, "t0").runtime_epoch == 0
    report(client, session={"runtime_epoch": 1})
    assert session_row(client).runtime_epoch == 0  # a claim, until the host confirms it
    assert restore(client, settings) == "restored"
    assert turn_row(client, "t0").phase == "running"
    assert session_row(client).runtime_epoch == 1
    report(client, session={"runtime_epoch": 1}, turn={"turn_id": "t1", "phase": "running"})
    assert turn_row(client, "t1").runtime_epoch == 1


def test_a_newer_epoch_ends_older_turns_and_the_run_and_brings_the_fences_back(
    client, sim_control, settings
):
    client.ensure_session(WS, SID)  # learnt from the host: epoch 1
    target = client.set_goal(WS, SID, "shared goal", client_submit_id="g1")
    fence = client.fence_goal_generation(WS, SID, target.operation_id, client_submit_id="f1")
    run = client.start_maintenance(WS, SID, client_submit_id="m1")
    assert run.runtime_epoch == 1
    prompt = client.submit_prompt(WS, SID, "hello", client_submit_id="p1")
    report(client, turn={"turn_id": "t-old", "phase": "running", "prompt_id": prompt.prompt_id})
    assert turn_row(client, "t-old").runtime_epoch == 1

    sim_control.session(WS, SID, restart=True)  # the host restarted
    report(client, session={"runtime_epoch": 2})
    assert turn_row(client, "t-old").phase == "running"  # a claim acts on nothing
    seen = len(calls_of(sim_control))
    assert restore(client, settings) == "restored"  # confirmed: the host answers epoch 2

    old = turn_row(client, "t-old")
    assert (old.phase, old.outcome) == ("settled", "interrupted")
    assert session_row(client).active_turn_id is None
    ended = client.get_maintenance(run.run_id)
    assert (ended.status, ended.error_code) == ("interrupted", "runtime_restarted")
    assert not run_transaction(client.engine, lambda s: runs.session_held(s, WS, SID))
    assert session_row(client).runtime_epoch == 2
    # Every durable fence went to the restarted host, before any goal call could.
    # Then the host was asked what it runs.
    assert calls_of(sim_control)[seen:] == ["liveness", "goal-fences", "state"]
    assert sim_control.session(WS, SID)["fences"] == [[target.operation_id, 1]]
    assert fence_row(client, fence).installed_epoch == 2

    dispatcher = Dispatcher(
        client.engine, HttpRuntime(settings.runtime_url), worker_id="d", lease_s=5
    )
    op = client.set_goal(WS, SID, "the owner's new goal", client_submit_id="g2")
    assert [r.outcome for r in dispatcher.dispatch(op.operation_id)] == ["applied"]
    assert calls_of(sim_control)[seen:] == ["liveness", "goal-fences", "state", "goal"]  # once
    assert client.get_fence(fence.fence_id).status == "pending"  # its delivery is its own


def test_a_fence_not_known_at_a_newer_epoch_goes_there_before_a_goal_call(
    client, sim_control, settings
):
    client.ensure_session(WS, SID)
    target = client.set_goal(WS, SID, "shared goal", client_submit_id="g1")
    fence = client.fence_goal_generation(WS, SID, target.operation_id, client_submit_id="f1")
    sim_control.session(WS, SID, restart=True)
    client.ensure_session(WS, SID)  # the user's look: epoch 2, the fence goes there
    assert fence_row(client, fence).installed_epoch == 2
    seen = len(calls_of(sim_control))
    dispatcher = Dispatcher(
        client.engine, HttpRuntime(settings.runtime_url), worker_id="d", lease_s=5
    )
    op = client.set_goal(WS, SID, "the owner's new goal", client_submit_id="g2")
    dispatcher.dispatch(op.operation_id)
    assert calls_of(sim_control)[seen:] == ["goal"]  # known there: no second install
    run_transaction(
        client.engine,
        lambda s: s.get(GoalFence, fence.fence_id).__setattr__("installed_epoch", 1),
    )  # as if it had been installed before the restart only
    again = client.set_goal(WS, SID, "and another", client_submit_id="g3")
    dispatcher.dispatch(again.operation_id)
    assert calls_of(sim_control)[seen:] == ["goal", "goal-fences", "goal"]


def test_epochs_only_grow_whatever_order_reports_arrive_in(client, sim_control, settings):
    sim_control.session(WS, SID, restart=True)
    sim_control.session(WS, SID, restart=True)
    assert client.ensure_session(WS, SID).runtime_epoch == 3
    report(client, session={"runtime_epoch": 2}, turn={"turn_id": "t", "phase": "running"})
    assert session_row(client).runtime_epoch == 3
    # A late report of a turn of an older process: it ended with that process.
    late = turn_row(client, "t")
    assert (late.runtime_epoch, late.phase, late.outcome) == (2, "settled", "interrupted")


def test_a_forged_epoch_changes_nothing(client, sim_control, settings):
    """One report claiming epoch 2^31 - 1 used to pin the session: every real restart after
    it was invisible. A claim is confirmed with the host first; the host says 1."""
    client.ensure_session(WS, SID)
    sim_control.session(WS, SID, turn={"turn_id": "t-old"})
    report(client, turn={"turn_id": "t-old", "phase": "running"})
    report(client, session={"runtime_epoch": 2**31 - 1})
    assert restore(client, settings) == "restored"
    assert session_row(client).runtime_epoch == 1
    assert turn_row(client, "t-old").phase == "running"
    sim_control.session(WS, SID, restart=True)  # a real restart is seen as one
    report(client, session={"runtime_epoch": 2})
    assert restore(client, settings) == "restored"
    assert session_row(client).runtime_epoch == 2
    assert turn_row(client, "t-old").outcome == "interrupted"


def test_ensure_session_reinstalls_fences_only_at_a_newer_epoch(client, sim_control, settings):
    from agent_radar.workflows.steps.fence_apply import FenceApplier

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
    from agent_radar.models.base import utcnow
    from agent_radar.workflows.fences import cancels
    from agent_radar.workflows.steps.cancel import CancelRunner

    client.ensure_session(WS, SID)  # epoch 1
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
    # no cancel reached the new process
    assert calls_of(sim_control) == ["liveness", "liveness"]
    assert ("agent_radar.prompt.dispatch", {"workspace_id": WS, "session_id": SID}) in published


def test_the_users_own_ensure_installs_with_require_live_false(client, sim_control, settings):
    """ensure_session is the user's own call: the fences it installs after a resume (and
    any it finds missing when the session is live) go with require_live false; background
    installs (a fence's delivery, a restore) keep require_live."""
    target = client.set_goal(WS, SID, "shared", client_submit_id="g1")
    fence = client.fence_goal_generation(WS, SID, target.operation_id, client_submit_id="f1")
    sim_control.session(WS, SID, live=False)
    client.ensure_session(WS, SID)  # resumed with the fence preloaded, then reinstalled
    installs = [c for c in sim_control.calls() if c["call"] == "goal-fences"]
    assert [c["require_live"] for c in installs] == [False]
    run_transaction(
        client.engine,
        lambda s: s.get(GoalFence, fence.fence_id).__setattr__("installed_epoch", None),
    )
    assert restorer(client).restore(WS, SID) == "skipped"  # nothing asked for it
    report(client, session={"live": True})  # the host answers for it: a restore is due
    assert restorer(client).restore(WS, SID) == "restored"
    installs = [c for c in sim_control.calls() if c["call"] == "goal-fences"]
    assert [c["require_live"] for c in installs] == [False, True]


def test_a_resume_is_live_from_when_it_answered(client, sim_control, monkeypatch):
    """docs/lifecycles.md: sessions: `ensure_session` resumes an offline session; it is live
    from when the resume answered, so an offline answer asked while it ran (another worker's
    look) and written after it is dropped."""
    from agent_radar.models.base import utcnow
    from agent_radar.workflows.client import sessions
    from agent_radar.workflows.sessions.rows import Heard
    from agent_radar.workflows.steps.cancel import mark_offline

    sim_control.session(WS, SID, live=False)
    looked: list = []
    resume = sessions.resume_if_offline

    def resume_while_another_looks(*args):
        looked.append(utcnow())  # another worker asks now, and is told offline
        return resume(*args)

    monkeypatch.setattr(sessions, "resume_if_offline", resume_while_another_looks)
    assert client.ensure_session(WS, SID).live is True
    run_transaction(client.engine, lambda s: mark_offline(s, WS, SID, Heard(looked[0])))
    assert session_row(client).live is True


def test_a_late_report_without_an_epoch_does_not_settle_a_new_epoch_s_turn_of_its_id(
    client, sim_control
):
    """Epoch 1's `turn-1` (of G1) ended; its settled report, naming no epoch (only the first
    report of an epoch must), came late: after the host restarted and epoch 2's `turn-1` (of
    G2) was reported running. It names G1, not the G2 on record under that key: it tells of
    the older turn and is not applied (the session's restore is asked for). Fencing G2 then
    cancels its turn at the host. Before, the report settled epoch 2's turn on record while
    it ran, and the fence waited for good (found by a review)."""
    from agent_radar.workflows.steps.fence_apply import FenceApplier

    def goal_turn(op, phase, **more):
        return {
            "turn_id": "turn-1",
            "phase": phase,
            "origin": "goal_continuation",
            "source_goal_operation_id": op.operation_id,
            "source_goal_revision": op.goal_revision,
            **more,
        }

    client.ensure_session(WS, SID)  # epoch 1
    sim_control.session(WS, SID, numbered_turns=True, turn_duration_ms=0)
    dispatcher = Dispatcher(client.engine, client.runtime, worker_id="d", lease_s=5)
    g1 = client.set_goal(WS, SID, "G1", client_submit_id="g1")
    assert [r.outcome for r in dispatcher.dispatch(g1.operation_id)] == ["applied"]
    report(client, session={"runtime_epoch": 1}, turn=goal_turn(g1, "running"))
    sim_control.session(WS, SID, settle_turn="turn-1")
    late = {
        "workspace_id": WS,
        "session_id": SID,
        "occurred_at_ms": int(time.time() * 1000),
        "turn": goal_turn(g1, "settled", outcome="completed"),
    }
    sim_control.session(WS, SID, restart=True)
    assert client.ensure_session(WS, SID).runtime_epoch == 2
    g2 = client.set_goal(WS, SID, "G2", client_submit_id="g2")
    assert [r.outcome for r in dispatcher.dispatch(g2.operation_id)] == ["applied"]
    report(client, session={"runtime_epoch": 2}, turn=goal_turn(g2, "running"))
    client.report_activity(late)
    turns = run_transaction(
        client.engine, lambda s: s.query(Turn).filter_by(workspace_id=WS, session_id=SID).all()
    )
    assert sorted((t.runtime_epoch, t.phase) for t in turns) == [(1, "settled"), (2, "running")]
    fence = client.fence_goal_generation(WS, SID, g2.operation_id, client_submit_id="f2")
    applier = FenceApplier(
        client.engine, client.runtime, worker_id="a", lease_s=5, publish=lambda *a: True
    )
    applier.apply(fence.fence_id)
    assert sim_control.session(WS, SID)["turns"]["turn-1"]["phase"] == "settled"
    assert client.get_fence(fence.fence_id).status == "completed"


@pytest.mark.parametrize("names", ["its provenance", "nothing"])
def test_a_late_report_of_a_goal_s_turn_does_not_end_a_new_epoch_s_prompt_of_its_id(
    client, sim_control, names
):
    """The same late report (epoch 1's turn-1, a goal's), landing on epoch 2's turn-1 of a
    prompt: a goal's turn is not a prompt's, and a report naming no epoch made before the
    turn on record started is not of it (as a settled report may, it names nothing but the
    id), so it is not applied. The prompt goes on, and the next prompt waits for its turn: one
    prompt turn at a time at the host (found by reviews of the change above, which had let the
    report end the prompt)."""
    from agent_radar.workflows.steps.prompt_dispatch import dispatch_next

    client.ensure_session(WS, SID)  # epoch 1
    sim_control.session(WS, SID, numbered_turns=True, turn_duration_ms=0)
    g1 = client.set_goal(WS, SID, "G1", client_submit_id="g1")
    dispatcher = Dispatcher(client.engine, client.runtime, worker_id="d", lease_s=5)
    assert [r.outcome for r in dispatcher.dispatch(g1.operation_id)] == ["applied"]
    goal_turn = {
        "turn_id": "turn-1",
        "phase": "running",
        "origin": "goal_continuation",
        "source_goal_operation_id": g1.operation_id,
        "source_goal_revision": 1,
    }
    report(client, session={"runtime_epoch": 1}, turn=goal_turn)
    sim_control.session(WS, SID, settle_turn="turn-1")
    late = {
        "workspace_id": WS,
        "session_id": SID,
        "occurred_at_ms": int(time.time() * 1000),
        "turn": {**goal_turn, "phase": "settled", "outcome": "completed"},
    }
    if names == "nothing":
        late["turn"] = {"turn_id": "turn-1", "phase": "settled", "outcome": "completed"}
    sim_control.session(WS, SID, restart=True)
    assert client.ensure_session(WS, SID).runtime_epoch == 2
    p2 = client.submit_prompt(WS, SID, "second", client_submit_id="p2")
    p3 = client.submit_prompt(WS, SID, "third", client_submit_id="p3")
    assert dispatch_next(client.engine, client.runtime, WS, SID) == "dispatched"
    prompt_turn = {"turn_id": "turn-1", "phase": "running", "origin": "user_prompt"}
    report(client, session={"runtime_epoch": 2}, turn={**prompt_turn, "prompt_id": p2.prompt_id})
    client.report_activity(late)
    assert client.get_prompt(p2.prompt_id).status == "dispatched"
    dispatch_next(client.engine, client.runtime, WS, SID)
    assert client.get_prompt(p3.prompt_id).status == "queued"
    turns = sim_control.session(WS, SID)["turns"].values()
    assert [t["phase"] for t in turns] == ["running"]

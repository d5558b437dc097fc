"""A fenced generation never runs again, whatever order the network, the host and the reports take
(docs/lifecycles.md: fences, sessions): each case on both backends with a real worker and the
simulator over HTTP."""

from agent_radar.models.base import utcnow
from agent_radar.models.db import run_transaction
from agent_radar.models.operations import CancelOperation
from agent_radar.models.tables import Turn
from agent_radar.workflows import ids
from tests.end_to_end.test_fences import calls, fence_while_offline, fenced_turn, goal_actions
from tests.helpers import eventually

WS = "ws-returns"
WAITING = "waiting for the fenced turn to settle"


def cancel_row(client, cancel_id):
    return run_transaction(client.engine, lambda s: s.get(CancelOperation, cancel_id))


def test_a_fence_joins_the_cancel_a_session_stop_made(client, stack, sim_control):
    """The fenced turn already has a cancel, from a session stop: the fence joins it (one
    cancel at the host, its reason the stop's) instead of failing on the conflict and
    holding its lease and the lane until they expire."""
    stack.start_worker()
    stack.start_beat()
    # The host takes the stop's cancel and ends the turn a while later, reporting it.
    sim_control.session(WS, "j1", turn_duration_ms=0, cancel_mode="accepted", cancel_delay_ms=4000)
    target = client.wait(client.set_goal(WS, "j1", "shared", client_submit_id="1"))
    turn = eventually(fenced_turn(client, "j1", target, WS), what="the continuation turn")
    stop = client.stop_session(WS, "j1", client_submit_id="stop", reason="user pressed stop")
    cancel_id = ids.cancel_operation_id(WS, "j1", turn.turn_id)
    eventually(lambda: calls(sim_control, "turns/", "j1"), what="the stop's cancel at the host")
    fence = client.fence_goal_generation(WS, "j1", target.operation_id, client_submit_id="f")
    eventually(
        lambda: (
            (f := client.get_fence(fence.fence_id)).cancel_operation_id == cancel_id
            and f.last_error == WAITING
        ),
        timeout_s=20,
        what="the fence to join the stop's cancel",
    )
    done = client.wait(fence, timeout=60)  # once the host ended the turn
    assert (done.status, done.cancel_operation_id) == ("completed", cancel_id)
    cancel = cancel_row(client, cancel_id)
    assert (cancel.status, cancel.reason) == ("completed", f"session-stop:{stop.stop_id}")
    assert client.wait(stop, timeout=10).status == "completed"
    cancels = [e for e in sim_control.effects(kind=None) if e["kind"] == "cancel"]
    assert {e["operation_id"] for e in cancels} == {cancel_id}
    assert goal_actions(sim_control, "j1") == ["set", "clear"]


def _now_ms() -> int:
    return int(utcnow().timestamp() * 1000)


def sim_turn(sim_control, sid, turn_id):
    return sim_control.session(WS, sid)["turns"].get(turn_id)


def test_a_fenced_turn_whose_report_is_late_is_cancelled_by_the_fence(client, stack, sim_control):
    """The turn's report is in flight while the fence applies: the record holds no turn of
    the generation, the host's state answer does, and the fence cancels it there before it
    completes (docs/lifecycles.md: reconcile); the late report changes nothing."""
    stack.start_worker()
    stack.start_beat()
    sim_control.session(WS, "late", turn_duration_ms=0, report_delay_ms=4000)
    target = client.wait(client.set_goal(WS, "late", "shared", client_submit_id="1"))
    turn_id = next(iter(sim_control.session(WS, "late")["turns"]))
    fence = client.wait(
        client.fence_goal_generation(WS, "late", target.operation_id, client_submit_id="f"),
        timeout=30,
    )
    cancel_id = ids.cancel_operation_id(WS, "late", turn_id)
    assert (fence.status, fence.cancel_operation_id) == ("completed", cancel_id)
    assert sim_turn(sim_control, "late", turn_id)["outcome"] == "canceled"
    eventually(
        lambda: (cancel_row(client, cancel_id) or CancelOperation()).status == "completed",
        what="the cancel to complete",
    )
    assert client.get_fence(fence.fence_id).cancel_operation_id == cancel_id
    assert goal_actions(sim_control, "late") == ["set", "clear"]
    assert calls(sim_control, "resume", "late") == []


def host_report(client, sid, epoch, host_id="default"):
    """What an agent host says when a session is back: it is live, at this epoch."""
    client.report_activity(
        {
            "workspace_id": WS,
            "session_id": sid,
            "occurred_at_ms": _now_ms(),
            "session": {"host_id": host_id, "runtime_epoch": epoch, "live": True},
        }
    )


def fenced_away(sim_control, sid, target, host_view=None):
    """At the host: the fenced generation is installed as a fence and its goal is gone."""
    view = host_view if host_view is not None else sim_control.session(WS, sid)
    return view["fences"] == [[target.operation_id, 1]] and view["goal"] is None


def test_an_offline_settled_fence_reaches_a_session_that_reconnects_at_the_same_epoch(
    client, stack, sim_control
):
    """A network drop (same host process, same epoch): the fence completes locally. When the
    session comes back by itself and reports, nobody resumes it, yet the fence is installed
    and the clear settled locally is delivered."""
    stack.start_worker()
    stack.start_beat()
    target, fence = fence_while_offline(client, sim_control, "c1", WS)
    at_host = sim_control.session(WS, "c1")
    assert at_host["goal"]["objective"] == "shared" and at_host["fences"] == []
    epoch = at_host["runtime_epoch"]

    sim_control.session(WS, "c1", live=True)  # the network is back: same process
    host_report(client, "c1", epoch)
    eventually(lambda: fenced_away(sim_control, "c1", target), what="the fence at the host")
    assert sim_control.session(WS, "c1")["runtime_epoch"] == epoch
    eventually(
        lambda: client.get_goal_operation(fence.clear_operation_id).provider_phase == "applied",
        what="the clear's delivery recorded",
    )
    eventually(lambda: client.goal_state(WS, "c1").sync_status == "synced", what="synced")
    assert goal_actions(sim_control, "c1") == ["set", "clear"]
    assert calls(sim_control, "resume", "c1") == []


def test_a_restart_before_any_epoch_was_known_gets_the_fence_back(client, stack, sim_control):
    """No report named an epoch yet; the fence is installed (at an epoch not known before
    its call; its look at the host's state learns it after); the host restarts and its
    fences are gone. A newer epoch is no proof the fence is there: it goes back."""
    stack.start_worker()
    stack.start_beat()
    sim_control.session(WS, "c2", continuation_turns=False)  # no turn, so no report
    target = client.wait(client.set_goal(WS, "c2", "shared", client_submit_id="1"))
    client.wait(
        client.fence_goal_generation(WS, "c2", target.operation_id, client_submit_id="f"),
        timeout=30,
    )
    assert fenced_away(sim_control, "c2", target)
    assert client.session_info(WS, "c2").runtime_epoch == 1  # the fence's look learnt it
    restarted = sim_control.session(WS, "c2", restart=True)
    assert restarted["fences"] == []
    host_report(client, "c2", restarted["runtime_epoch"])
    eventually(
        lambda: sim_control.session(WS, "c2")["fences"] == [[target.operation_id, 1]],
        what="the fence back at the restarted host",
    )
    assert client.session_info(WS, "c2").runtime_epoch == restarted["runtime_epoch"]
    assert calls(sim_control, "resume", "c2") == []


def test_a_moved_session_gets_its_fences_and_undelivered_clear_at_the_new_host(
    client, stack, sim_control, sim_b
):
    """The fence settled locally while the session was offline at its host; an operator
    moves it to host-b. host-b gets the fence and the clear before anything else."""
    from agent_radar.workflows.tools.simulator import SimControl

    control_b = SimControl(sim_b.url)
    client.add_host("host-b", sim_b.url)
    stack.start_worker()
    stack.start_beat()
    # No turn, so no report from the old host while the session moves.
    target, _fence = fence_while_offline(client, sim_control, "c3", WS, continuation_turns=False)
    client.ensure_session(WS, "c3", host_id="host-b")
    assert control_b.session(WS, "c3")["fences"] == [[target.operation_id, 1]]
    assert [e["action"] for e in control_b.effects() if e["session_id"] == "c3"] == ["clear"]
    assert calls(control_b, "resume", "c3") == []


def test_a_forged_epoch_pins_nothing(client, stack, sim_control):
    """One report claiming epoch 2^31 - 1 made every later real restart invisible: fences
    never went back, the lost turn kept the session busy. A claim is confirmed with the
    session's own host first; the real restart after it is seen, the turn it lost ends and
    the fence goes back."""
    stack.start_worker()
    stack.start_beat()
    sim_control.session(WS, "c5", turn_duration_ms=0)  # the turn runs until it is stopped
    first = client.wait(client.set_goal(WS, "c5", "first", client_submit_id="1"))
    second = client.wait(client.set_goal(WS, "c5", "second", client_submit_id="2"))
    client.wait(
        client.fence_goal_generation(WS, "c5", first.operation_id, client_submit_id="f"),
        timeout=30,
    )
    turn = eventually(fenced_turn(client, "c5", second, WS), what="the second goal's turn")
    turn = turn.turn_id
    eventually(lambda: client.session_info(WS, "c5").runtime_epoch == 1, what="epoch 1")
    host_report(client, "c5", 2**31 - 1)  # forged
    eventually(lambda: calls(sim_control, "liveness", "c5"), what="the claim checked with the host")
    assert client.session_info(WS, "c5").runtime_epoch == 1
    restarted = sim_control.session(WS, "c5", restart=True)  # a real restart: epoch 2
    assert restarted["fences"] == []
    host_report(client, "c5", restarted["runtime_epoch"])
    eventually(
        lambda: sim_control.session(WS, "c5")["fences"] == [[first.operation_id, 1]],
        what="the fence back at the restarted host",
    )
    # The restart is seen: its epoch recorded (which can land a moment after the fence is
    # back; this failed once in a few hundred runs, on the code before this change too).
    eventually(
        lambda: client.session_info(WS, "c5").runtime_epoch == restarted["runtime_epoch"],
        what="the real restart's epoch",
    )
    lost = run_transaction(client.engine, lambda s: s.get(Turn, (WS, "c5", turn)))
    assert (lost.phase, lost.outcome) == ("settled", "interrupted")

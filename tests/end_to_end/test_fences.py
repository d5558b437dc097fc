"""Goal generation fences end to end (docs/lifecycles.md), on both backends, with real worker
and beat processes and the simulator over HTTP."""

from datetime import timedelta

from sqlalchemy import select

from agent_radar.beat.sweeper import REPUBLISH_INTERVAL_S, sweep_once
from agent_radar.models.base import utcnow
from agent_radar.models.db import run_transaction
from agent_radar.models.enums import TurnPhase
from agent_radar.models.operations import CancelOperation
from agent_radar.models.tables import AgentSession, Turn
from agent_radar.workflows import ids
from agent_radar.workflows.fences.restores import OFFLINE_RECHECK_S
from agent_radar.workflows.kinds.cancel import OPEN_CANCEL_STATUSES
from agent_radar.workflows.task_names import RESTORE_TASK
from tests.helpers import eventually

WS = "ws-fences"


def fenced_turn(client, sid, op, ws=WS):
    def find():
        return run_transaction(
            client.engine,
            lambda s: s.execute(
                select(Turn).where(
                    Turn.workspace_id == ws,
                    Turn.session_id == sid,
                    Turn.source_goal_operation_id == op.operation_id,
                )
            ).scalar_one_or_none(),
        )

    return find


def fence_while_offline(client, sim_control, sid, ws=WS, **sim):
    """A goal applied at the host, then the session offline and the goal's fence settled
    locally (its clear never reached the agent): (target, fence)."""
    if sim:
        sim_control.session(ws, sid, **sim)
    target = client.wait(client.set_goal(ws, sid, "shared", client_submit_id="1"))
    sim_control.session(ws, sid, live=False)
    fence = client.wait(
        client.fence_goal_generation(ws, sid, target.operation_id, client_submit_id="f"),
        timeout=60,
    )
    clear = client.get_goal_operation(fence.clear_operation_id)
    assert (clear.status, clear.provider_phase) == ("completed", "unknown")
    return target, fence


def background_done(client, sid, ws=WS) -> bool:
    """No restore of the session due, published or running, none of its cancels open (a
    waiting one is due again later; a running one holds a lease, which a sweep far enough
    ahead would find expired), and none of its turns still running here (its end's report
    would ask for a restore).

    A running restore's stamp (twice the lease ahead) and the sweeper's reservation of one it
    published (REPUBLISH_INTERVAL_S ahead) are in the future too, as the offline recheck is:
    only a time further ahead than both is the recheck. A sweep while a restore runs finds
    that restore's stamp, and its finish moves it under the sweep: nothing to publish then."""
    assert 2 * client.settings.lease_s < REPUBLISH_INTERVAL_S < OFFLINE_RECHECK_S

    def look(s):
        row = s.get(AgentSession, (ws, sid), populate_existing=True)
        open_cancel = s.execute(
            select(CancelOperation.operation_id).where(
                CancelOperation.workspace_id == ws,
                CancelOperation.session_id == sid,
                CancelOperation.status.in_(OPEN_CANCEL_STATUSES),
            )
        ).first()
        running = s.execute(
            select(Turn.turn_id).where(
                Turn.workspace_id == ws, Turn.session_id == sid, Turn.phase != TurnPhase.SETTLED
            )
        ).first()
        # An offline session with a fence to deliver keeps one look due (OFFLINE_RECHECK_S).
        recheck_after = utcnow() + timedelta(seconds=REPUBLISH_INTERVAL_S)
        restore_waits = row is not None and (
            row.restore_due_at is None or (row.live is False and row.restore_due_at > recheck_after)
        )
        return restore_waits and not open_cancel and not running

    return run_transaction(client.engine, look)


def turns_reported(client, sim_control, sid, ws=WS) -> bool:
    """The host settled a turn of the session, and every one it settled is settled here too
    (its report came)."""
    settled = [
        e["turn_id"]
        for e in sim_control.effects(kind="turn_settled")
        if (e["workspace_id"], e["session_id"]) == (ws, sid)
    ]

    def look(s):
        return bool(settled) and all(
            (turn := s.get(Turn, (ws, sid, t), populate_existing=True)) is not None
            and turn.phase == TurnPhase.SETTLED
            for t in settled
        )

    return run_transaction(client.engine, look)


def goal_actions(sim_control, sid):
    return [e["action"] for e in sim_control.effects() if e["session_id"] == sid]


def calls(sim_control, kind, sid):
    return [c for c in sim_control.calls() if c["call"].startswith(kind) and c["session_id"] == sid]


def test_fence_clears_only_its_generation(client, stack, sim_control):
    stack.start_worker()
    stack.start_beat()
    target = client.wait(client.set_goal(WS, "s1", "shared goal", client_submit_id="1"))
    fence = client.fence_goal_generation(WS, "s1", target.operation_id, client_submit_id="f")
    assert fence.intent_accepted and not fence.settled
    fence = client.wait(fence, timeout=60)
    state = client.goal_state(WS, "s1")
    assert (state.revision, state.tombstoned, state.sync_status) == (2, True, "synced")
    assert goal_actions(sim_control, "s1") == ["set", "clear"]
    # the host restarts; the user brings the session back: the fence comes with it
    sim_control.session(WS, "s1", live=False)
    client.ensure_session(WS, "s1")
    resume = [e for e in sim_control.effects(kind=None) if e["kind"] == "resume"]
    assert resume[-1]["fences"] == [
        {"target_operation_id": target.operation_id, "target_revision": 1}
    ]


def test_fence_never_clears_a_newer_owner_goal(client, stack, sim_control):
    stack.start_worker()
    shared = client.wait(client.set_goal(WS, "s2", "shared goal", client_submit_id="1"))
    client.wait(client.set_goal(WS, "s2", "owner goal", client_submit_id="2"))
    fence = client.wait(
        client.fence_goal_generation(WS, "s2", shared.operation_id, client_submit_id="f"),
        timeout=60,
    )
    assert fence.clear_operation_id is None
    state = client.goal_state(WS, "s2")
    assert state.revision == 2 and state.desired["objective"] == "owner goal"
    assert goal_actions(sim_control, "s2") == ["set", "set"]


def test_acceptance_survives_an_agent_failure(client, stack, sim_control):
    stack.start_worker()
    stack.start_beat()
    target = client.wait(client.set_goal(WS, "s3", "shared", client_submit_id="1"))
    # The host refuses every fence install until the fault is lifted: the fence's own
    # attempts and any restore of the session (a turn report that finds the fence not
    # installed) alike, so the fence's attempt must meet one, whichever runs first.
    sim_control.fault("goal-fences", status=503, count=1_000, session_id="s3")
    fence = client.fence_goal_generation(WS, "s3", target.operation_id, client_submit_id="f")
    assert fence.intent_accepted and not fence.settled
    eventually(lambda: client.get_fence(fence.fence_id).last_error, what="a failed attempt")
    assert not client.get_fence(fence.fence_id).settled
    sim_control.clear_faults()
    done = client.wait(fence, timeout=90)
    # At least one failed install, then one that got through: the fence's own next attempt,
    # or the session's restore before it.
    assert done.attempt >= 1
    assert sim_control.session(WS, "s3")["fences"] == [[target.operation_id, 1]]
    assert goal_actions(sim_control, "s3") == ["set", "clear"]


def test_a_prepared_target_fenced_before_dispatch_never_reaches_the_agent(
    client, stack, sim_control
):
    target = client.set_goal(WS, "s4", "never sent", client_submit_id="1")
    fence = client.fence_goal_generation(WS, "s4", target.operation_id, client_submit_id="f")
    stack.start_worker()
    client.wait(fence, timeout=60)
    assert client.get_goal_operation(target.operation_id).status == "superseded"
    assert goal_actions(sim_control, "s4") == ["clear"]


def test_an_offline_session_settles_locally_and_resumes_with_the_fence(client, stack, sim_control):
    stack.start_worker()
    stack.start_beat()
    target, _fence = fence_while_offline(client, sim_control, "s5")
    state = client.goal_state(WS, "s5")
    assert state.sync_status == "unknown" and state.observed["objective"] == "shared"
    assert calls(sim_control, "resume", "s5") == []
    # Once the background work the fence set going has run (a restore that finds the
    # session offline, a cancel settled locally), only the look whether the session is back
    # stays due (it may come back without a report): the sweeper publishes that, nothing else.
    # The goal's continuation turn ends at the host 200 ms after it began, offline or not,
    # and its reports (running, then settled) may come after the fence settled.
    eventually(lambda: turns_reported(client, sim_control, "s5"), what="the turn's end")
    eventually(lambda: background_done(client, "s5"), what="the background work to end")
    later = utcnow() + timedelta(seconds=60)
    published = []
    sweep_once(client.engine, lambda *a: published.append(a) or True, later, owner="t")
    assert published == [(RESTORE_TASK, {"workspace_id": WS, "session_id": "s5"})]
    client.ensure_session(WS, "s5")
    resume = [e for e in sim_control.effects(kind=None) if e["kind"] == "resume"]
    assert resume[-1]["fences"][0]["target_operation_id"] == target.operation_id
    new = client.wait(client.set_goal(WS, "s5", "fresh goal", client_submit_id="2"))
    assert (new.status, client.goal_state(WS, "s5").sync_status) == ("completed", "synced")
    assert calls(sim_control, "resume", "s5") and len(calls(sim_control, "resume", "s5")) == 1


def test_the_fenced_turn_is_cancelled_and_a_vanished_host_settles_it_as_interrupted(
    client, stack, sim_control
):
    """The host loses the session (session_not_found) while the fence waits on the turn: the
    session is gone, an authoritative end; the turn ends interrupted and the fence records
    the cancel it caused."""
    stack.start_worker()
    stack.start_beat()
    sim_control.session(WS, "s6", turn_duration_ms=0, cancel_mode="ignore")
    target = client.wait(client.set_goal(WS, "s6", "shared", client_submit_id="1"))
    turn = eventually(fenced_turn(client, "s6", target), what="the continuation turn")
    fence = client.fence_goal_generation(WS, "s6", target.operation_id, client_submit_id="f")
    eventually(
        lambda: (
            client.get_fence(fence.fence_id).last_error == "waiting for the fenced turn to settle"
        ),
        what="the fence to wait",
    )
    sim_control.session(WS, "s6", missing=True)  # the agent host lost the session
    done = client.wait(fence, timeout=90)
    cancel_id = ids.cancel_operation_id(WS, "s6", turn.turn_id)
    assert (done.status, done.cancel_operation_id) == ("completed", cancel_id)
    cancel = run_transaction(client.engine, lambda s: s.get(CancelOperation, cancel_id))
    assert (cancel.status, cancel.result) == ("completed", "interrupted")
    settled = fenced_turn(client, "s6", target)()
    assert (settled.phase, settled.outcome) == ("settled", "interrupted")
    assert len(calls(sim_control, "turns/", "s6")) == 1
    assert calls(sim_control, "resume", "s6") == []


def test_an_offline_host_is_no_end_for_the_fenced_turn(client, stack, sim_control):
    """docs/lifecycles.md: cancels: a disconnected session is not an end, the turn may still run
    behind the network fault. The fence keeps waiting and nothing settles the turn locally; once the
    host is back and reports the turn's end, the fence completes. Nothing resumes it."""
    stack.start_worker()
    stack.start_beat()
    sim_control.session(WS, "s10", turn_duration_ms=0, cancel_mode="ignore")
    target = client.wait(client.set_goal(WS, "s10", "shared", client_submit_id="1"))
    turn = eventually(fenced_turn(client, "s10", target), what="the continuation turn")
    fence = client.fence_goal_generation(WS, "s10", target.operation_id, client_submit_id="f")
    cancel_id = ids.cancel_operation_id(WS, "s10", turn.turn_id)
    eventually(
        lambda: client.get_fence(fence.fence_id).cancel_operation_id == cancel_id,
        what="the fence to wait on its cancel",
    )
    sim_control.session(WS, "s10", live=False)
    # Past the accepted cancel's deadline the stale-cancel path looks at the session and finds
    # it offline: it waits, and the turn stays running.
    eventually(
        lambda: (
            run_transaction(client.engine, lambda s: s.get(CancelOperation, cancel_id)).last_error
            == "waiting for the session to come back"
        ),
        timeout_s=60,
        what="the cancel to wait for the session",
    )
    assert client.get_fence(fence.fence_id).status in ("pending", "processing")
    assert fenced_turn(client, "s10", target)().phase == "running"
    # Back, and the turn ends on its own there (its report goes out).
    sim_control.session(WS, "s10", live=True, settle_turn=turn.turn_id)
    done = client.wait(fence, timeout=60)
    assert (done.status, done.cancel_operation_id) == ("completed", cancel_id)
    assert fenced_turn(client, "s10", target)().outcome == "completed"
    assert goal_actions(sim_control, "s10") == ["set", "clear"]
    assert calls(sim_control, "resume", "s10") == []


def test_the_fence_waits_for_the_cancelled_turn_to_settle(client, stack, sim_control):
    stack.start_worker()
    sim_control.session(WS, "s7", turn_duration_ms=0, cancel_mode="accepted", cancel_delay_ms=300)
    target = client.wait(client.set_goal(WS, "s7", "shared", client_submit_id="1"))
    eventually(fenced_turn(client, "s7", target), what="the continuation turn")
    fence = client.wait(
        client.fence_goal_generation(WS, "s7", target.operation_id, client_submit_id="f"),
        timeout=60,
    )
    turn = fenced_turn(client, "s7", target)()
    assert (turn.phase, turn.outcome) == ("settled", "canceled")
    assert fence.cancel_operation_id == ids.cancel_operation_id(WS, "s7", turn.turn_id)
    assert goal_actions(sim_control, "s7") == ["set", "clear"]


def test_a_turn_of_another_generation_is_never_cancelled(client, stack, sim_control):
    stack.start_worker()
    old = client.wait(client.set_goal(WS, "s8", "old", client_submit_id="1"))
    eventually(
        lambda: (fenced_turn(client, "s8", old)() or Turn()).phase == "settled",
        what="the old generation's turn to end",
    )
    sim_control.session(WS, "s8", turn_duration_ms=0)
    new = client.wait(client.set_goal(WS, "s8", "new", client_submit_id="2"))
    eventually(fenced_turn(client, "s8", new), what="the new generation's turn")
    client.wait(
        client.fence_goal_generation(WS, "s8", old.operation_id, client_submit_id="f"), timeout=60
    )
    assert calls(sim_control, "turns/", "s8") == []
    assert fenced_turn(client, "s8", new)().phase == "running"


def test_a_disconnect_between_install_and_cancel(client, stack, sim_control):
    """The fence installs, then the session drops just before the cancel goes out. The turn is
    not abandoned: its cancel is written durably, delivered once the session answers again,
    and only then does the fence complete (issue: a fenced turn could be abandoned)."""
    stack.start_worker()
    stack.start_beat()
    sim_control.session(WS, "s9", turn_duration_ms=0)
    target = client.wait(client.set_goal(WS, "s9", "shared", client_submit_id="1"))
    turn = eventually(fenced_turn(client, "s9", target), what="the continuation turn")
    sim_control.fault("liveness", status=409, error="disconnected", count=1, session_id="s9")
    fence = client.wait(
        client.fence_goal_generation(WS, "s9", target.operation_id, client_submit_id="f"),
        timeout=90,
    )
    cancel_id = ids.cancel_operation_id(WS, "s9", turn.turn_id)
    assert (fence.status, fence.cancel_operation_id) == ("completed", cancel_id)
    cancel = run_transaction(client.engine, lambda s: s.get(CancelOperation, cancel_id))
    assert (cancel.status, cancel.result) == ("completed", "canceled")
    assert fenced_turn(client, "s9", target)().outcome == "canceled"
    assert len(calls(sim_control, "turns/", "s9")) == 1
    assert calls(sim_control, "resume", "s9") == []
    assert client.session_info(WS, "s9").live is True
    clear = client.get_goal_operation(fence.clear_operation_id)
    assert (clear.status, clear.provider_phase) == ("completed", "applied")


def test_worker_killed_while_applying_a_fence(client, stack, sim_control):
    victim = stack.start_worker(concurrency=1)
    stack.start_beat()
    target = client.wait(client.set_goal(WS, "s10", "shared", client_submit_id="1"))
    sim_control.latency("goal", 1500)
    fence = client.fence_goal_generation(WS, "s10", target.operation_id, client_submit_id="f")
    eventually(
        lambda: client.get_goal_operation(fence.clear_operation_id).lease_token,
        what="the clear to be in flight",
    )
    victim.kill()
    sim_control.latency("goal", 0)
    stack.start_worker(concurrency=1)
    client.wait(fence, timeout=120)
    clears = [e for e in sim_control.effects() if e["operation_id"] == fence.clear_operation_id]
    assert len(clears) == 1
    assert client.get_goal_operation(fence.clear_operation_id).status == "completed"

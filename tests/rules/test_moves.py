"""A move is a stop at the old host and a start at the new one (docs/lifecycles.md: sessions), on
both backends: what ran at the host a session left is cancelled there (durably: while that host
is offline, once it is seen again), and the new host gets the fences, then the current goal.
Effects are counted at the hosts."""

import time

import pytest

from agent_radar.models.db import run_transaction
from agent_radar.models.operations import CancelOperation
from agent_radar.workflows import ids
from agent_radar.workflows.steps.cancel import CancelRunner
from agent_radar.workflows.steps.goals.dispatch import Dispatcher
from agent_radar.workflows.tools.simulator import SimControl
from tests.helpers import maintenance_executor

WS, SID = "ws-moves", "s1"


@pytest.fixture
def host_b(client, sim_b):
    client.add_host("host-b", sim_b.url)
    return SimControl(sim_b.url)


def report(client, **parts):
    client.report_activity(
        {"workspace_id": WS, "session_id": SID, "occurred_at_ms": int(time.time() * 1000), **parts}
    )


def runner(client):
    return CancelRunner(
        client.engine, client.runtime, worker_id="c", lease_s=5, publish=lambda *a: True
    )


def dispatch(client, op):
    d = Dispatcher(client.engine, client.runtime, worker_id="d", lease_s=5)
    return [r.outcome for r in d.dispatch(op.operation_id)]


def open_cancels(client):
    """The session's cancels not yet delivered."""
    return run_transaction(
        client.engine,
        lambda s: [
            c.operation_id
            for c in s.query(CancelOperation).filter_by(workspace_id=WS, session_id=SID)
            if c.status in ("prepared", "leased")
        ],
    )


def turn_at(control, turn_id):
    return control.session(WS, SID)["turns"][turn_id]["phase"]


def test_a_move_cancels_the_old_host_s_turn_there_even_after_it_was_offline(
    client, sim_control, host_b
):
    """Row 2: a turn of G1 ran at A; the session moved to B; G1 was fenced (completing at B);
    it moved back to A. The move had marked A's turn `interrupted` and told A nothing: A ran
    G1 unfenced the whole time, and after the move back it still ran. Now the move owes A a
    cancel of the turn, delivered once A answers."""
    client.ensure_session(WS, SID)
    sim_control.session(WS, SID, continuation_turns=False)
    g1 = client.set_goal(WS, SID, "G1", client_submit_id="g1")
    assert dispatch(client, g1) == ["applied"]
    sim_control.session(
        WS,
        SID,
        turn={
            "turn_id": "t-g1",
            "origin": "goal_continuation",
            "source_goal_operation_id": g1.operation_id,
            "source_goal_revision": 1,
        },
    )
    report(
        client,
        turn={
            "turn_id": "t-g1",
            "phase": "running",
            "origin": "goal_continuation",
            "source_goal_operation_id": g1.operation_id,
            "source_goal_revision": 1,
        },
    )
    sim_control.session(WS, SID, live=False)  # A is offline when the session leaves it
    client.ensure_session(WS, SID, host_id="host-b")
    cancel_id = ids.cancel_operation_id(WS, SID, "t-g1")
    owed = run_transaction(client.engine, lambda s: s.get(CancelOperation, cancel_id))
    assert (owed.host_id, owed.status) == ("default", "prepared")
    assert runner(client).apply(cancel_id) == "waiting_offline"  # no budget spent
    assert turn_at(sim_control, "t-g1") == "running"
    fence = client.fence_goal_generation(WS, SID, g1.operation_id, client_submit_id="f1")
    from agent_radar.workflows.steps.fence_apply import FenceApplier

    applier = FenceApplier(
        client.engine, client.runtime, worker_id="a", lease_s=5, publish=lambda *a: True
    )
    assert applier.apply(fence.fence_id) == "completed"  # at B, where nothing of G1 runs
    sim_control.session(WS, SID, live=True)  # A is seen again
    run_transaction(
        client.engine,
        lambda s: s.get(CancelOperation, cancel_id).__setattr__("next_attempt_at", None),
    )
    assert runner(client).apply(cancel_id) == "settled"
    assert turn_at(sim_control, "t-g1") == "settled"  # cancelled at A
    done = client.get_operation(cancel_id)
    assert done.status == "completed"
    client.ensure_session(WS, SID, host_id="default")  # back to A: nothing of G1 runs there
    assert [
        t for t, v in sim_control.session(WS, SID)["turns"].items() if v["phase"] != "settled"
    ] == []


def test_a_move_stops_the_old_host_s_maintenance_run_there(client, sim_control, host_b):
    """Row 3: a maintenance run at A; a move to B and back within the run. The run was ended
    `interrupted` locally and never cancelled at A; a second run was admitted: two runs of one
    session at A at once. Now the move owes A the run's cancel; and a run asks A before it
    starts there."""
    client.ensure_session(WS, SID)
    sim_control.session(WS, SID, maintenance_duration_ms=60_000)
    first = client.start_maintenance(WS, SID, client_submit_id="m1")
    executor = maintenance_executor(client, max_wait_s=0.1)
    assert executor.execute(first.run_id) == "handed_back"  # started at A, runs on
    client.ensure_session(WS, SID, host_id="host-b")
    ended = client.get_maintenance(first.run_id)
    assert (ended.status, ended.error_code) == ("interrupted", "runtime_restarted")
    stop_id = ids.run_stop_id(WS, SID, first.run_id)
    assert runner(client).apply(stop_id) == "settled"
    assert client.runtime.on_host("default", None).session_state(WS, SID).maintenance_run_id is None
    client.ensure_session(WS, SID, host_id="default")  # back within what was the run's time
    second = client.start_maintenance(WS, SID, client_submit_id="m2")
    assert executor.execute(second.run_id) == "handed_back"  # it started: A runs it alone
    state = client.runtime.session_state(WS, SID)
    assert state.maintenance_run_id == second.run_id


def test_the_new_host_gets_the_current_goal_and_a_move_back_does_not_revive_a_stale_one(
    client, sim_control, host_b
):
    """Row 8: `ensure_session(host_id=B)` left B without the session's current goal, yet the
    goal state said `synced`; moving back revived A's stale goal."""
    client.ensure_session(WS, SID)
    first = client.set_goal(WS, SID, "first", client_submit_id="g1")
    assert dispatch(client, first) == ["applied"]
    client.ensure_session(WS, SID, host_id="host-b")
    assert host_b.session(WS, SID)["goal"] == {"objective": "first", "status": "active"}
    assert client.goal_state(WS, SID).sync_status == "synced"
    second = client.set_goal(WS, SID, "second", client_submit_id="g2")
    assert dispatch(client, second) == ["applied"]
    client.ensure_session(WS, SID, host_id="default")
    assert sim_control.session(WS, SID)["goal"] == {"objective": "second", "status": "active"}
    state = client.goal_state(WS, SID)
    assert (state.sync_status, state.revision) == ("synced", 2)
    # Once each: the goal went to each host by its operation id.
    assert [e["operation_id"] for e in host_b.effects()] == [
        first.operation_id,
        second.operation_id,
    ]
    assert [e["operation_id"] for e in sim_control.effects()] == [
        first.operation_id,
        second.operation_id,
    ]


class MoveWhileAsked:
    """A runtime whose state call moves the session to `target` while the host it asked is
    answering (a slow, or hostile, old host)."""

    def __init__(self, client, target):
        self.client, self.inner, self.target = client, client.runtime, target

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def on_host(self, *address):
        host, outer = self.inner.on_host(*address), self

        class Answering:
            def __getattr__(self, name):
                return getattr(host, name)

            def session_state(self, ws, sid):
                state = host.session_state(ws, sid)
                outer.client.ensure_session(ws, sid, host_id=outer.target)
                return state

        return Answering()


def test_an_answer_of_the_host_a_session_left_is_not_applied_to_the_new_one(
    client, sim_control, host_b
):
    """A state answer is applied only while the session is at the host that gave it: the old
    host's epoch, goal and turns said nothing of the new host (found by a hostile review)."""
    from agent_radar.models.tables import AgentSession
    from tests.helpers import restorer

    for _ in range(4):
        sim_control.session(WS, SID, restart=True)  # the old host is at epoch 5
    client.ensure_session(WS, SID)
    sim_control.session(WS, SID, turn={"turn_id": "a-turn"})
    done = restorer(client, runtime=MoveWhileAsked(client, "host-b")).reconcile(WS, SID)
    assert (done.ended, done.recorded, done.completed) == ([], [], [])
    row = run_transaction(client.engine, lambda s: s.get(AgentSession, (WS, SID)))
    assert (row.host_id, row.runtime_epoch) == ("host-b", 1)  # host-b's own epoch
    assert row.active_turn_id is None


def test_a_cancel_owed_to_a_host_that_restarted_since_reaches_no_new_turn(
    client, sim_control, host_b
):
    """The old host restarted after the session left it and numbers its turns again: the
    cancel owed for its old `turn-1` ends `interrupted` (it ended with that process) instead
    of cancelling the new `turn-1` there (found by a hostile review)."""
    client.ensure_session(WS, SID)  # epoch 1
    sim_control.session(WS, SID, turn={"turn_id": "turn-1"})
    report(client, session={"runtime_epoch": 1}, turn={"turn_id": "turn-1", "phase": "running"})
    sim_control.session(WS, SID, live=False)
    client.ensure_session(WS, SID, host_id="host-b")
    owed = ids.cancel_operation_id(WS, SID, "turn-1")
    assert runner(client).apply(owed) == "waiting_offline"
    sim_control.session(WS, SID, restart=True, live=True)  # epoch 2
    sim_control.session(WS, SID, turn={"turn_id": "turn-1"})  # a new turn, the same id
    client.ensure_session(WS, SID, host_id="default")  # the owed cancel goes first
    assert client.get_operation(owed).result == "interrupted"
    assert turn_at(sim_control, "turn-1") == "running"  # the new one runs on


def test_a_host_cannot_plant_a_record_where_another_turn_s_would_go(client, sim_control):
    """A host's turn id that reads as a derived record key is kept under a key of its own
    (found by a hostile review: a planted record swallowed another host's turn)."""
    from agent_radar.models.tables import AgentSession, Turn

    planted = ids.reused_turn_key(WS, SID, "host-b", 1, "turn-1")
    client.ensure_session(WS, SID)
    report(client, turn={"turn_id": planted, "phase": "running"})
    assert run_transaction(client.engine, lambda s: s.get(Turn, (WS, SID, planted))) is None
    key = run_transaction(client.engine, lambda s: s.get(AgentSession, (WS, SID)).active_turn_id)
    row = run_transaction(client.engine, lambda s: s.get(Turn, (WS, SID, key)))
    assert (row.host_turn_id, row.phase) == (planted, "running")


def test_a_turn_id_a_restarted_host_gives_again_after_a_move_back_is_a_new_turn(
    client, sim_control, host_b
):
    """A prompt's turn `turn-1` at A went on record with no known epoch (the prompt's answer
    tells none) and was ended by a move to B before any report. A restarted (numbering its
    turns from `turn-1` again), the session came back, and a goal started a new `turn-1`
    there. That turn is a new one: its report records it, and fencing its generation cancels
    it at A. Before, the old settled record absorbed it (an unknown epoch matched any): its
    reports were dropped and the fence waited for good while the turn ran (found by a
    review)."""
    from agent_radar.workflows.steps.fence_apply import FenceApplier
    from agent_radar.workflows.steps.prompt_dispatch import dispatch_next

    client.ensure_session(WS, SID)  # at A, epoch 1
    sim_control.session(WS, SID, numbered_turns=True, turn_duration_ms=0)
    prompt = client.submit_prompt(WS, SID, "hello", client_submit_id="p1")
    assert dispatch_next(client.engine, client.runtime, WS, SID) == "dispatched"
    assert client.get_prompt(prompt.prompt_id).turn_id == "turn-1"
    client.ensure_session(WS, SID, host_id="host-b")  # its reports are late: it moves on
    assert runner(client).apply(ids.cancel_operation_id(WS, SID, "turn-1")) == "settled"
    sim_control.session(WS, SID, restart=True)  # epoch 2, turn-1 again
    client.ensure_session(WS, SID, host_id="default")
    goal = client.set_goal(WS, SID, "G", client_submit_id="g1")
    assert dispatch(client, goal) == ["applied"]
    assert turn_at(sim_control, "turn-1") == "running"
    report(
        client,
        session={"runtime_epoch": sim_control.session(WS, SID)["runtime_epoch"]},
        turn={
            "turn_id": "turn-1",
            "phase": "running",
            "origin": "goal_continuation",
            "source_goal_operation_id": goal.operation_id,
            "source_goal_revision": 1,
        },
    )
    fence = client.fence_goal_generation(WS, SID, goal.operation_id, client_submit_id="f1")
    applier = FenceApplier(
        client.engine, client.runtime, worker_id="a", lease_s=5, publish=lambda *a: True
    )
    applier.apply(fence.fence_id)
    assert turn_at(sim_control, "turn-1") == "settled"
    assert client.get_fence(fence.fence_id).status == "completed"
    # At A: the prompt's turn cancelled once (by the move), the goal's once (by the fence).
    cancels = [e for e in sim_control.effects(kind=None) if e["kind"] == "cancel"]
    assert len(cancels) == 2


def test_a_second_prompt_s_turn_of_a_reused_id_is_stopped_by_the_next_move(
    client, sim_control, host_b
):
    """The first prompt's unreported turn-1 was stopped at A by a move; A restarted and gave
    turn-1 again to a second prompt, and the session moved again before any report of it.
    That turn is another: the move stops it at A too. Before, it was taken for the first
    prompt's ended turn, whose cancel was long done, and ran on at A (found by a review)."""
    from agent_radar.workflows.steps.prompt_dispatch import dispatch_next

    client.ensure_session(WS, SID)  # at A, epoch 1
    sim_control.session(WS, SID, numbered_turns=True, turn_duration_ms=0)
    client.submit_prompt(WS, SID, "first", client_submit_id="p1")
    assert dispatch_next(client.engine, client.runtime, WS, SID) == "dispatched"
    client.ensure_session(WS, SID, host_id="host-b")  # no report of its turn yet
    assert [runner(client).apply(c) for c in open_cancels(client)] == ["settled"]
    sim_control.session(WS, SID, restart=True)  # epoch 2: turn-1 again
    client.ensure_session(WS, SID, host_id="default")
    second = client.submit_prompt(WS, SID, "second", client_submit_id="p2")
    assert dispatch_next(client.engine, client.runtime, WS, SID) == "dispatched"
    assert client.get_prompt(second.prompt_id).turn_id == "turn-1"
    client.ensure_session(WS, SID, host_id="host-b")  # again before any report of it
    assert [runner(client).apply(c) for c in open_cancels(client)] == ["settled"]
    assert turn_at(sim_control, "turn-1") == "settled"
    cancels = [e for e in sim_control.effects(kind=None) if e["kind"] == "cancel"]
    assert len(cancels) == 2  # at A: each prompt's turn once


def test_a_move_cancels_a_renumbered_prompt_turn_reported_without_its_prompt_once(
    client, sim_control, host_b
):
    """The first prompt's turn-1 was reported and ended; A restarted and gave turn-1 to the
    second prompt, whose running report named no prompt (as docs/protocol.md's example does).
    A move then owes A one cancel of that turn: the move finds it on record as reported, not
    as a turn apart (found by a review of the change above, which made it two)."""
    from agent_radar.workflows.steps.prompt_dispatch import dispatch_next

    client.ensure_session(WS, SID)  # at A, epoch 1
    sim_control.session(WS, SID, numbered_turns=True, turn_duration_ms=0, cancel_mode="accepted")
    p1 = client.submit_prompt(WS, SID, "first", client_submit_id="p1")
    assert dispatch_next(client.engine, client.runtime, WS, SID) == "dispatched"
    turn = {"turn_id": "turn-1", "origin": "user_prompt", "prompt_id": p1.prompt_id}
    report(client, session={"runtime_epoch": 1}, turn={**turn, "phase": "running"})
    sim_control.session(WS, SID, settle_turn="turn-1")
    report(client, turn={**turn, "phase": "settled", "outcome": "completed"})
    sim_control.session(WS, SID, restart=True)  # epoch 2: turn-1 again
    assert client.ensure_session(WS, SID).runtime_epoch == 2
    client.submit_prompt(WS, SID, "second", client_submit_id="p2")
    assert dispatch_next(client.engine, client.runtime, WS, SID) == "dispatched"
    running = {"turn_id": "turn-1", "phase": "running", "origin": "user_prompt"}
    report(client, session={"runtime_epoch": 2}, turn=running)
    client.ensure_session(WS, SID, host_id="host-b")
    owed = open_cancels(client)
    for cancel_id in owed:
        runner(client).apply(cancel_id)
    cancels = [e for e in sim_control.effects(kind=None) if e["kind"] == "cancel"]
    assert len(owed) == 1 and len(cancels) == 1


def test_a_move_stops_a_prompt_s_new_turn_of_the_id_its_settled_turn_had(
    client, sim_control, host_b
):
    """p1's first send landed at A; its turn-1 ran, was reported naming p1 and settled while p1
    was queued. A restarts; p1 goes again and A's new process runs a new turn for it, turn-1
    too. Before any report of it, the session moves to B: the move owes A a stop of that turn.
    It took the settled turn-1 of epoch 1 for it and owed nothing, and p2 later ran at B
    beside p1's turn at A (found by a review)."""
    from datetime import timedelta

    from agent_radar.models.base import utcnow
    from agent_radar.models.operations import Prompt
    from agent_radar.workflows.steps.prompt_dispatch import dispatch_next
    from tests.helpers import first_send_lands_and_settles_while_queued, restorer

    client.ensure_session(WS, SID)
    sim_control.session(WS, SID, turn_duration_ms=0, numbered_turns=True)
    host_b.session(WS, SID, turn_duration_ms=0)
    p1, p2, t1, epoch = first_send_lands_and_settles_while_queued(client, sim_control, WS, SID)
    sim_control.session(WS, SID, restart=True)
    restorer(client).cancels.require_live(WS, SID)
    assert dispatch_next(client.engine, client.runtime, WS, SID) == "dispatched"
    assert turn_at(sim_control, t1) == "running"  # p1's new turn-1
    client.ensure_session(WS, SID, host_id="host-b")  # the move: a stop owed to A
    owed = open_cancels(client)
    assert len(owed) == 1
    runner(client).apply(owed[0])
    assert turn_at(sim_control, t1) == "settled"  # stopped at A
    # At B: p1's look ends it (B lists no turn of it) and p2 goes there, alone.
    run_transaction(
        client.engine,
        lambda s: s.get(Prompt, p1.prompt_id).__setattr__(
            "dispatched_at", utcnow() - timedelta(minutes=3)
        ),
    )
    restorer(client).reconcile(WS, SID)
    assert dispatch_next(client.engine, client.runtime, WS, SID) == "dispatched"
    assert [e["prompt_id"] for e in host_b.effects("prompt")] == [p2.prompt_id]


def test_a_move_back_delivers_the_stop_that_waited_offline_before_the_next_prompt(
    client, sim_control, host_b
):
    """A run runs at A; the session moves to B: a stop of the run is owed to A. A network
    fault at A: the session is offline there (the same process: the run goes on), and the
    stop waits for it to come back. The fault goes, the run still running at A at the same
    epoch, and the user moves the session back to A: the move delivers the owed stop first,
    and the queued prompt then runs at A alone. It ran beside the run (found by a review)."""
    from agent_radar.workflows.steps.prompt_dispatch import dispatch_next

    client.ensure_session(WS, SID)
    sim_control.session(WS, SID, maintenance_duration_ms=60_000, turn_duration_ms=0)
    run = client.start_maintenance(WS, SID, client_submit_id="m1")
    assert maintenance_executor(client, max_wait_s=0.1).execute(run.run_id) == "handed_back"
    client.ensure_session(WS, SID, host_id="host-b")
    sim_control.session(WS, SID, live=False)  # a network fault: the run goes on
    owed = open_cancels(client)
    assert [runner(client).apply(c) for c in owed] == ["waiting_offline"]
    sim_control.session(WS, SID, live=True)  # the fault is gone: same epoch, same run
    assert sim_control.session(WS, SID)["runs"][run.run_id]["running"]
    client.ensure_session(WS, SID, host_id="default")  # back to A: the stop goes first
    assert not sim_control.session(WS, SID)["runs"][run.run_id]["running"]
    assert open_cancels(client) == []
    prompt = client.submit_prompt(WS, SID, "after the run", client_submit_id="p1")
    assert dispatch_next(client.engine, client.runtime, WS, SID) == "dispatched"
    assert [e["prompt_id"] for e in sim_control.effects("prompt")] == [prompt.prompt_id]

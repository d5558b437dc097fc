"""A host's answer written after the session moved on (docs/lifecycles.md: sessions): a client
moved it to another host, or its host restarted, while a worker's call was in flight. Each test
lets that happen at the exact point between the call and its write, and counts at the hosts."""

import time

import pytest

from agent_radar.models.db import run_transaction
from agent_radar.models.tables import AgentSession, Turn
from agent_radar.workflows.steps.cancel import CancelRunner
from agent_radar.workflows.tools.simulator import SimControl
from tests.helpers import first_of_two_prompts_sent, restorer

WS, SID = "ws-stale", "s1"


@pytest.fixture
def host_b(client, sim_b):
    client.add_host("host-b", sim_b.url)
    return SimControl(sim_b.url)


def row(client):
    return run_transaction(client.engine, lambda s: s.get(AgentSession, (WS, SID)))


def report(client, **parts):
    client.report_activity(
        {"workspace_id": WS, "session_id": SID, "occurred_at_ms": int(time.time() * 1000), **parts}
    )


class Meanwhile:
    """The runtime port, whose `call` runs `meanwhile()` after the host answered it (a worker
    slowed between its call and its write) or, `before`, just before it is made; on the
    router and on the port of any host it names."""

    def __init__(self, runtime, call, meanwhile, before=False):
        self.inner, self.call, self.meanwhile, self.before = runtime, call, meanwhile, before

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name != self.call:
            return attr

        def call(*args, **kwargs):
            if self.before:
                self.meanwhile()
            answer = attr(*args, **kwargs)
            if not self.before:
                self.meanwhile()
            return answer

        return call

    def on_host(self, *address):
        return Meanwhile(self.inner.on_host(*address), self.call, self.meanwhile, self.before)


def moving_to_b(client):
    """What another client does meanwhile: it moves the session to host B."""
    return lambda: client.ensure_session(WS, SID, host_id="host-b")


def step(kind, client, runtime, publish=lambda *a: True, **more):
    """A step of `kind` (a Step) for one worker, on the client's database and `runtime`."""
    return kind(client.engine, runtime, worker_id="w", lease_s=5, publish=publish, **more)


def runner(client, runtime):
    return step(CancelRunner, client, runtime)


def test_an_old_host_s_epoch_answered_before_a_move_is_not_the_new_host_s(
    client, sim_control, host_b
):
    """A liveness look asks host A (epoch 4 there); a client moves the session to B (epoch 1
    there); A's epoch is not written onto the session that lives on B, whose turns, reported at
    B's epoch 1, then run on record as they do at B."""
    client.ensure_session(WS, SID)
    for _ in range(3):
        sim_control.session(WS, SID, restart=True)  # A's process is at epoch 4 now
    move = moving_to_b(client)
    runner(client, Meanwhile(client.runtime, "liveness", move)).require_live(WS, SID)
    assert (row(client).host_id, row(client).runtime_epoch) == ("host-b", 1)
    report(
        client,
        signed_by="host-b",
        session={"runtime_epoch": 1},
        turn={"turn_id": "t-b", "phase": "running"},
    )
    turn = run_transaction(client.engine, lambda s: s.get(Turn, (WS, SID, "t-b")))
    assert turn.phase == "running"


def test_a_resume_answered_by_the_host_a_session_left_is_not_the_new_host_s(
    client, sim_control, host_b, monkeypatch
):
    """A user's ensure resumes the session at A (epoch 5 there, its fences preloaded); another
    client moves it to B meanwhile: nothing of A's answer is recorded for B."""
    from agent_radar.workflows.client import sessions

    client.ensure_session(WS, SID)  # at A, epoch 1
    sim_control.session(WS, SID, live=False)
    for _ in range(3):
        sim_control.session(WS, SID, restart=True)
    resume, moved = sessions.resume_if_offline, []

    def resume_then_moved(*args):
        answer = resume(*args)
        if not moved:
            moved.append(True)
            client.ensure_session(WS, SID, host_id="host-b")
        return answer

    monkeypatch.setattr(sessions, "resume_if_offline", resume_then_moved)
    client.ensure_session(WS, SID)
    assert row(client).host_id == "host-b"
    assert row(client).runtime_epoch == host_b.session(WS, SID)["runtime_epoch"] == 1


def _running_turn_at_a(client, sim_control):
    client.ensure_session(WS, SID)
    sim_control.session(WS, SID, turn={"turn_id": "t-a"})  # runs at A
    report(client, session={"runtime_epoch": 1}, turn={"turn_id": "t-a", "phase": "running"})


def test_a_cancel_in_flight_across_a_move_reaches_the_old_host(client, sim_control, host_b):
    """The cancel is asked of the host named before the call: a move just before the call
    leaves it owed to A, and A, where the turn runs, gets it."""
    _running_turn_at_a(client, sim_control)
    move = moving_to_b(client)
    cancels = runner(client, Meanwhile(client.runtime, "cancel_turn", move, before=True))
    assert cancels.request(WS, SID, "t-a", reason="session-stop:x") == "settled"
    assert row(client).host_id == "host-b"
    assert sim_control.session(WS, SID)["turns"]["t-a"]["phase"] == "settled"


def test_a_cancel_the_new_host_answers_after_a_move_is_not_ended_by_it(
    client, sim_control, host_b, monkeypatch
):
    """The cancel was claimed before a move, its call named the host after it (B): B's
    `not_found` does not end the cancel owed to A; it goes again, to A, and A's turn ends."""
    from agent_radar.models.operations import CancelOperation
    from agent_radar.workflows import ids, steps

    _running_turn_at_a(client, sim_control)
    published = []
    cancels = step(
        CancelRunner,
        client,
        client.runtime,
        publish=lambda task, kwargs: published.append((task, kwargs)) or True,
    )
    monkeypatch.setattr(cancels, "require_live", lambda *a, **k: False)
    read, moved = steps.run_read, []

    def moved_first(*args):  # the first naming of the host after the claim (steps.pin)
        if not moved:
            moved.append(True)  # (before: the move names the host too)
            client.ensure_session(WS, SID, host_id="host-b")
        return read(*args)

    monkeypatch.setattr(steps, "run_read", moved_first)
    assert cancels.request(WS, SID, "t-a", reason="session-stop:x") == "waiting"
    assert sim_control.session(WS, SID)["turns"]["t-a"]["phase"] == "running"
    cancel_id = ids.cancel_operation_id(WS, SID, "t-a")
    cancel = run_transaction(client.engine, lambda s: s.get(CancelOperation, cancel_id))
    assert (cancel.status, cancel.host_id) != ("completed", "default")
    assert published == [("agent_radar.cancel.apply", {"operation_id": cancel_id})]
    monkeypatch.undo()
    assert runner(client, client.runtime).apply(cancel_id) == "settled"
    assert sim_control.session(WS, SID)["turns"]["t-a"]["phase"] == "settled"


def test_a_state_answer_of_an_older_epoch_records_no_turn_as_running(client, sim_control):
    """An answer of epoch 1 listing a turn no report told of, written after epoch 2 was
    confirmed: the turn ended with its process, and nothing of it is recorded."""
    client.ensure_session(WS, SID)  # epoch 1
    sim_control.session(WS, SID, turn={"turn_id": "t-old"})  # runs at epoch 1, unreported

    def restart_and_confirm():
        sim_control.session(WS, SID, restart=True)  # epoch 2: t-old ended with its process
        client.ensure_session(WS, SID)  # another look confirms epoch 2

    slow = Meanwhile(client.runtime, "session_state", restart_and_confirm)
    restorer(client, runtime=slow).reconcile(WS, SID)
    assert (row(client).runtime_epoch, row(client).active_turn_id) == (2, None)
    assert run_transaction(client.engine, lambda s: s.get(Turn, (WS, SID, "t-old"))) is None


def test_a_prompt_sent_to_the_host_a_session_left_does_not_wedge_the_queue(
    client, sim_control, host_b
):
    """The prompt goes to A and its turn starts there; a client moves the session to B before
    the answer is written (A's report of the turn would be refused: A no longer serves the
    session). The turn is stopped at A, as the move stops the turns it finds, and the queue
    goes on at B."""
    from agent_radar.workflows.steps.prompt_dispatch import dispatch_next

    client.ensure_session(WS, SID)
    first = client.submit_prompt(WS, SID, "first", client_submit_id="p1")
    second = client.submit_prompt(WS, SID, "second", client_submit_id="p2")
    move = moving_to_b(client)
    published = []
    slow = Meanwhile(client.runtime, "submit_prompt", move)
    publish = lambda task, kwargs: published.append((task, kwargs)) or True  # noqa: E731
    assert dispatch_next(client.engine, slow, WS, SID, publish=publish) == "dispatched"
    assert row(client).host_id == "host-b"
    turn_id = client.get_prompt(first.prompt_id).turn_id
    [(task, kwargs)] = published
    assert task == "agent_radar.cancel.apply"
    assert runner(client, client.runtime).apply(kwargs["operation_id"]) == "settled"
    assert sim_control.session(WS, SID)["turns"][turn_id]["phase"] == "settled"  # stopped at A
    assert client.get_prompt(first.prompt_id).status != "dispatched"
    assert dispatch_next(client.engine, client.runtime, WS, SID) == "dispatched"
    assert client.get_prompt(second.prompt_id).turn_id in host_b.session(WS, SID)["turns"]


def test_a_maintenance_run_ended_by_a_move_is_started_nowhere_else_and_stopped(
    client, sim_control, host_b
):
    """The executor found A idle; a move to B ends the run (`interrupted`) just before the
    start call: the run starts where it was found idle, A, never at B, and the executor,
    finding it ended, stops it there."""
    from agent_radar.workflows.steps.maintenance import MaintenanceExecutor

    client.ensure_session(WS, SID)
    sim_control.session(WS, SID, maintenance_duration_ms=60_000)
    run = client.start_maintenance(WS, SID, client_submit_id="m1")
    move = moving_to_b(client)
    meanwhile = Meanwhile(client.runtime, "start_maintenance", move, before=True)
    executor = step(MaintenanceExecutor, client, meanwhile, poll_s=0.02, max_wait_s=0.1)
    executor.execute(run.run_id)
    assert client.get_maintenance(run.run_id).status == "interrupted"
    assert host_b.session(WS, SID).get("runs", {}) == {}
    running = [r for r, v in sim_control.session(WS, SID)["runs"].items() if v["running"]]
    assert running == []


def test_a_goal_applied_at_the_host_a_session_left_still_goes_to_the_new_one(
    client, sim_control, host_b
):
    """A goal operation in flight to A while a client moves the session to B: A's `applied`
    completes the operation, and the goal state stays `unknown` (B holds no goal): the
    session's restore, due at once, delivers it to B, whose answer syncs it."""
    from agent_radar.workflows.steps.goals.dispatch import Dispatcher

    client.ensure_session(WS, SID)
    op = client.set_goal(WS, SID, "first", client_submit_id="g1")
    move = moving_to_b(client)
    slow = Meanwhile(client.runtime, "apply_goal", move)
    dispatcher = Dispatcher(client.engine, slow, worker_id="d", lease_s=5)
    assert [r.outcome for r in dispatcher.dispatch(op.operation_id)] == ["applied"]
    assert row(client).host_id == "host-b"
    assert client.goal_state(WS, SID).sync_status == "unknown"
    assert restorer(client).restore(WS, SID) == "restored"
    assert host_b.session(WS, SID)["goal"] == {"objective": "first", "status": "active"}
    assert client.goal_state(WS, SID).sync_status == "synced"


def test_a_redelivered_goal_answered_by_the_host_a_session_left_does_not_sync_the_new_one(
    client, sim_control, host_b
):
    """A restore redelivers the current goal to B (unknown there after a move whose own
    delivery failed); a client moves the session back to A meanwhile (with that delivery on
    its way, the move leaves the goal to the next restore). B's `applied` is not what the
    goal state observes: the next restore delivers it to A."""
    from agent_radar.models.base import utcnow
    from agent_radar.workflows.errors import RuntimeFault
    from agent_radar.workflows.fences import restores
    from agent_radar.workflows.steps.goals.dispatch import Dispatcher

    def move(host_id, control):
        control.fault("goal", status=503, count=1, session_id=SID)  # its delivery fails
        with pytest.raises(RuntimeFault):
            client.ensure_session(WS, SID, host_id=host_id)

    def reconcile_due():  # what the sweeper does for a goal `unknown`
        now = utcnow()
        run_transaction(
            client.engine, lambda s: restores.request_reconcile(s, [(WS, SID)], now, now)
        )

    client.ensure_session(WS, SID)
    op = client.set_goal(WS, SID, "first", client_submit_id="g1")
    dispatcher = Dispatcher(client.engine, client.runtime, worker_id="d", lease_s=5)
    assert [r.outcome for r in dispatcher.dispatch(op.operation_id)] == ["applied"]
    move("host-b", host_b)
    sim_control.session(WS, SID, fresh=True)  # A holds nothing of the session now
    reconcile_due()
    back = lambda: client.ensure_session(WS, SID, host_id="default")  # noqa: E731
    restorer(client, runtime=Meanwhile(client.runtime, "apply_goal", back)).restore(WS, SID)
    assert row(client).host_id == "default"
    assert client.goal_state(WS, SID).sync_status == "unknown"
    reconcile_due()
    goal_calls = len(sim_control.calls("goal"))
    assert restorer(client).restore(WS, SID) == "restored"
    assert len(sim_control.calls("goal")) == goal_calls + 1  # the goal went to A
    assert client.goal_state(WS, SID).sync_status == "synced"


def test_a_prompt_sent_after_a_restart_not_yet_seen_holds_the_queue(client, sim_control):
    """The host restarted (epoch 2, not yet seen) before the prompt went: learning the epoch
    does not end the prompt's turn, which runs at it; the next prompt waits."""
    from agent_radar.workflows.steps.prompt_dispatch import dispatch_next

    client.ensure_session(WS, SID)  # epoch 1
    sim_control.session(WS, SID, turn_duration_ms=0)  # turns run until they are ended
    sim_control.session(WS, SID, restart=True)
    first = client.submit_prompt(WS, SID, "first", client_submit_id="p1")
    client.submit_prompt(WS, SID, "second", client_submit_id="p2")
    assert dispatch_next(client.engine, client.runtime, WS, SID) == "dispatched"
    client.ensure_session(WS, SID)  # epoch 2 learnt
    assert client.get_prompt(first.prompt_id).status == "dispatched"
    assert dispatch_next(client.engine, client.runtime, WS, SID) == "busy"
    running = [
        t for t, v in sim_control.session(WS, SID)["turns"].items() if v["phase"] != "settled"
    ]
    assert len(running) == 1


def test_session_not_found_from_the_host_a_session_left_ends_nothing_at_the_new_one(
    client, sim_control, host_b
):
    """A cancel's call named A; the session moves to B (a turn runs there) and A drops it just
    before the call: A's `session_not_found` ends nothing of B's, and the cancel, owed to A,
    goes again."""
    from agent_radar.models.base import utcnow
    from agent_radar.workflows.fences import cancels

    _running_turn_at_a(client, sim_control)
    cancel_id = run_transaction(
        client.engine, lambda s: cancels.prepare(s, WS, SID, "t-a", "user", utcnow()).operation_id
    )

    def meanwhile():
        client.ensure_session(WS, SID, host_id="host-b")
        host_b.session(WS, SID, turn={"turn_id": "t-b"})
        b = {"runtime_epoch": 1}
        report(client, signed_by="host-b", session=b, turn={"turn_id": "t-b", "phase": "running"})
        sim_control.session(WS, SID, missing=True)  # A drops the session it no longer serves

    slow = Meanwhile(client.runtime, "cancel_turn", meanwhile, before=True)
    assert runner(client, slow).apply(cancel_id) == "retry"
    t_b = run_transaction(client.engine, lambda s: s.get(Turn, (WS, SID, "t-b")))
    assert (t_b.phase, row(client).active_turn_id) == ("running", "t-b")
    assert runner(client, client.runtime).apply(cancel_id) == "settled"  # at A: not there


def test_a_move_stops_a_prompt_s_turn_no_report_told_of_yet(client, sim_control, host_b):
    """The prompt went to A and its turn runs there; no report of it has come when a client
    moves the session to B: the move stops that turn at A too, and the queue goes on at B."""
    from agent_radar.workflows import ids
    from agent_radar.workflows.steps.prompt_dispatch import dispatch_next

    first, second = first_of_two_prompts_sent(client, sim_control, WS, SID)
    turn_id = client.get_prompt(first.prompt_id).turn_id
    client.ensure_session(WS, SID, host_id="host-b")
    assert client.get_prompt(first.prompt_id).status == "completed"
    cancel_id = ids.cancel_operation_id(WS, SID, turn_id)  # owed to A
    assert runner(client, client.runtime).apply(cancel_id) == "settled"
    assert sim_control.session(WS, SID)["turns"][turn_id]["phase"] == "settled"  # stopped at A
    assert dispatch_next(client.engine, client.runtime, WS, SID) == "dispatched"
    assert client.get_prompt(second.prompt_id).turn_id in host_b.session(WS, SID)["turns"]


def test_a_move_stops_a_prompt_s_turn_sent_after_a_restart_not_yet_seen(
    client, sim_control, host_b
):
    """A restarted (epoch 2, not yet seen) before the prompt went: the move records the turn at
    no known epoch, so the cancel owed to A is delivered there rather than taken for a turn of
    an older process."""
    from agent_radar.workflows import ids
    from agent_radar.workflows.steps.prompt_dispatch import dispatch_next

    client.ensure_session(WS, SID)  # epoch 1
    sim_control.session(WS, SID, turn_duration_ms=0)  # turns run until they are ended
    sim_control.session(WS, SID, restart=True)
    first = client.submit_prompt(WS, SID, "first", client_submit_id="p1")
    assert dispatch_next(client.engine, client.runtime, WS, SID) == "dispatched"
    turn_id = client.get_prompt(first.prompt_id).turn_id
    client.ensure_session(WS, SID, host_id="host-b")
    cancel_id = ids.cancel_operation_id(WS, SID, turn_id)
    assert runner(client, client.runtime).apply(cancel_id) == "settled"
    assert sim_control.session(WS, SID)["turns"][turn_id]["phase"] == "settled"  # stopped at A


def test_a_fence_s_clear_goes_to_the_host_it_was_claimed_for_and_then_to_the_new_one(
    client, sim_control, host_b
):
    """A fence's clear is claimed for A; a move to B comes just before its call: the clear goes
    to A (where the fenced generation ran), the goal stays `unknown`, and the restore the
    completion makes due delivers it to B."""
    from agent_radar.workflows.steps.fence_apply import FenceApplier

    client.ensure_session(WS, SID)
    target = client.set_goal(WS, SID, "shared", client_submit_id="g1")
    fence = client.fence_goal_generation(WS, SID, target.operation_id, client_submit_id="f")
    move = moving_to_b(client)
    applier = step(FenceApplier, client, Meanwhile(client.runtime, "apply_goal", move, before=True))
    assert applier.apply(fence.fence_id) == "completed"
    clears_at_a = [e for e in sim_control.effects() if e["action"] == "clear"]
    assert [e["operation_id"] for e in clears_at_a] == [fence.clear_operation_id]
    assert client.goal_state(WS, SID).sync_status == "unknown"
    assert restorer(client).restore(WS, SID) == "restored"
    assert [e["operation_id"] for e in host_b.effects()] == [fence.clear_operation_id]
    assert client.goal_state(WS, SID).sync_status == "synced"


def test_fences_found_missing_at_a_host_are_installed_there_across_a_move(
    client, sim_control, host_b
):
    """A fence settled while its session was offline at A is installed at A's return; a move
    to B comes just before that call, and a move back to A (the same process) after it. The
    fence went to A, where it was found missing and is recorded installed: A holds it. (Sent
    through the router it reached B, was recorded installed at A, and A never got it.)"""
    from agent_radar.workflows.steps.fence_apply import FenceApplier
    from agent_radar.workflows.steps.fence_install import ensure_fences_installed

    client.ensure_session(WS, SID)
    target = client.set_goal(WS, SID, "shared", client_submit_id="g1")
    sim_control.session(WS, SID, live=False)
    fence = client.fence_goal_generation(WS, SID, target.operation_id, client_submit_id="f")
    applier = step(FenceApplier, client, client.runtime)
    assert applier.apply(fence.fence_id) == "completed_offline"
    sim_control.session(WS, SID, live=True)
    assert sim_control.session(WS, SID)["fences"] == []
    move = moving_to_b(client)
    runtime = Meanwhile(client.runtime, "install_fence", move, before=True)
    assert ensure_fences_installed(client.engine, runtime, WS, SID)
    client.ensure_session(WS, SID, host_id="default")
    ensure_fences_installed(client.engine, client.runtime, WS, SID)
    assert sim_control.session(WS, SID)["fences"] == [[target.operation_id, 1]]

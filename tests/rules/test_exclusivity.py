"""A maintenance run is exclusive, and a prompt queue moves, under hosts and reports that cannot
be trusted (docs/lifecycles.md: maintenance, prompts, reconcile): what may still reach the host
(a call on the wire, a goal it accepted, a prompt send that timed out) keeps a run out; a report
of another turn ends no prompt; a prompt sent again whose turn settled meanwhile ends; a restore
sends no goal into a run; a move back waits for the stop owed there; a start or a prompt that
comes late is refused at the host. Effects are counted at the host."""

import threading
import time

import pytest

from agent_radar.workflows.errors import RuntimeFault, SessionBusy
from agent_radar.workflows.steps.goals.dispatch import Dispatcher
from tests.helpers import (
    eventually,
    first_send_lands_and_settles_while_queued,
    maintenance_executor,
)

WS, SID = "ws-exclusive", "s1"


def effects_at_host(sim_control):
    return [
        e
        for e in sim_control.effects(kind=None)
        if e["session_id"] == SID and e["kind"] in ("goal", "prompt", "maintenance")
    ]


def run_running_at_host(sim_control, run_id):
    return sim_control.session(WS, SID)["runs"].get(run_id, {}).get("running", False)


def test_a_run_is_refused_while_a_goal_call_is_on_the_wire(client, sim_control):
    """A worker has claimed a goal operation and its call is on the wire (the host is slow to
    take it). The mirror shows no turn, but the call may land at any moment: a run admitted
    now would meet it at the host. Admission refuses (session_busy, naming the operation)
    until the call's outcome is recorded; then the run goes, after the goal, never beside it."""
    client.ensure_session(WS, SID)
    # The goal starts no turn of its own: the run's only obstacle is the call.
    sim_control.session(WS, SID, maintenance_duration_ms=60_000, continuation_turns=False)
    op = client.set_goal(WS, SID, "during maintenance?", client_submit_id="g1")
    sim_control.hold("goal")
    d = Dispatcher(client.engine, client.runtime, worker_id="d", lease_s=5)
    result = {}
    worker = threading.Thread(
        target=lambda: result.setdefault("r", [r.outcome for r in d.dispatch(op.operation_id)])
    )
    worker.start()
    eventually(lambda: sim_control.holding() >= 1, what="the goal call to be on its way")
    with pytest.raises(SessionBusy) as busy:
        client.start_maintenance(WS, SID, client_submit_id="m1")
    assert busy.value.operation_id == op.operation_id
    sim_control.hold("goal", hold=False)
    worker.join(15)
    assert result["r"] == ["applied"]
    run = client.start_maintenance(WS, SID, client_submit_id="m1")  # the call is done
    assert maintenance_executor(client, max_wait_s=0.1).execute(run.run_id) == "handed_back"
    assert [e["kind"] for e in effects_at_host(sim_control)] == ["goal", "maintenance"]


def test_a_run_is_refused_while_a_goal_the_host_accepted_is_not_applied(client, sim_control):
    """The host answered a goal call `accepted` (it applies it later: docs/protocol.md) and its
    state lists nothing running yet. A run admitted now would meet the goal's turn when the
    host applies it: admission refuses until the host's word says it is applied."""
    from tests.helpers import restorer

    client.ensure_session(WS, SID)
    sim_control.session(
        WS,
        SID,
        goal_mode="accepted",
        apply_delay_ms=700,
        maintenance_duration_ms=60_000,
        continuation_turns=False,
    )
    op = client.set_goal(WS, SID, "later", client_submit_id="g1")
    d = Dispatcher(client.engine, client.runtime, worker_id="d", lease_s=5)
    assert [r.outcome for r in d.dispatch(op.operation_id)] == ["accepted"]
    with pytest.raises(SessionBusy) as busy:
        client.start_maintenance(WS, SID, client_submit_id="m1")
    assert busy.value.operation_id == op.operation_id
    eventually(lambda: sim_control.effects("goal"), what="the host to apply the goal")
    restorer(client).reconcile(WS, SID)  # the host's state answer completes it
    assert client.get_goal_operation(op.operation_id).status == "completed"
    run = client.start_maintenance(WS, SID, client_submit_id="m1")
    assert maintenance_executor(client, max_wait_s=0.1).execute(run.run_id) == "handed_back"
    assert [e["kind"] for e in effects_at_host(sim_control)] == ["goal", "maintenance"]


def test_a_run_is_refused_while_a_prompt_send_that_timed_out_may_land(client, sim_control):
    """A prompt's call times out at the worker while the host is still taking it (a slow
    host: docs/protocol.md, the deadline). The prompt goes back to the queue to be sent
    again, but it may have reached the host: admission refuses, as for a prompt in flight,
    and the host sees no run while the prompt's turn may start."""
    from agent_radar.workflows.steps.prompt_dispatch import dispatch_next

    client.ensure_session(WS, SID)
    sim_control.session(WS, SID, maintenance_duration_ms=60_000, turn_duration_ms=0)
    prompt = client.submit_prompt(WS, SID, "hello", client_submit_id="p1")
    sim_control.hold("prompts")
    outcome = dispatch_next(client.engine, client.runtime, WS, SID)
    assert outcome.startswith("retry: "), outcome  # the call timed out: not known to be sent
    assert client.get_prompt(prompt.prompt_id).status == "queued"
    with pytest.raises(SessionBusy) as busy:
        client.start_maintenance(WS, SID, client_submit_id="m1")
    assert busy.value.prompt_id == prompt.prompt_id
    sim_control.hold("prompts", hold=False)  # the host takes the call it was given
    eventually(lambda: sim_control.effects("prompt"), what="the prompt to land")
    # Sent again, the host answers with the turn it gave it: still in flight, still refused.
    assert dispatch_next(client.engine, client.runtime, WS, SID) == "dispatched"
    assert len(sim_control.effects("prompt")) == 1
    with pytest.raises(SessionBusy):
        client.start_maintenance(WS, SID, client_submit_id="m1")
    assert [e["kind"] for e in effects_at_host(sim_control)] == ["prompt"]


def report(client, **parts):
    client.report_activity(
        {"workspace_id": WS, "session_id": SID, "occurred_at_ms": int(time.time() * 1000), **parts}
    )


def test_a_false_settled_report_of_the_prompt_s_own_turn_starts_no_second_turn(client, sim_control):
    """A report says p1's own turn T1 settled while it still runs at the host (a report
    forged, or a buggy host's, or one of a turn's reports reordered). The record believes it:
    p1 ends and p2 goes. The host refuses p2 `busy` (docs/protocol.md: one thing at a time):
    no second turn starts beside T1. p2 stays queued, and goes once T1 has really ended.
    Counted at the host."""
    from datetime import timedelta

    from agent_radar.models.base import utcnow
    from agent_radar.workflows.steps.prompt_dispatch import dispatch_next
    from tests.helpers import first_of_two_prompts_sent

    first, second = first_of_two_prompts_sent(client, sim_control, WS, SID)
    t1 = client.get_prompt(first.prompt_id).turn_id
    settled = {"phase": "settled", "outcome": "completed", "origin": "user_prompt"}
    report(client, turn={"turn_id": t1, "prompt_id": first.prompt_id, **settled})
    assert client.get_prompt(first.prompt_id).status == "completed"  # the record believed it
    assert dispatch_next(client.engine, client.runtime, WS, SID) == "retry: busy"
    assert client.get_prompt(second.prompt_id).status == "queued"
    assert [e["prompt_id"] for e in sim_control.effects("prompt")] == [first.prompt_id]
    assert sim_control.session(WS, SID)["turns"][t1]["phase"] == "running"
    sim_control.session(WS, SID, settle_turn=t1)  # T1 really ends
    eventually(
        lambda: sim_control.session(WS, SID)["turns"][t1]["phase"] == "settled",
        what="T1 to end at the host",
    )
    later = lambda: utcnow() + timedelta(minutes=1)  # noqa: E731 - past the send's backoff
    assert dispatch_next(client.engine, client.runtime, WS, SID, clock=later) == "dispatched"
    assert [e["prompt_id"] for e in sim_control.effects("prompt")] == [
        first.prompt_id,
        second.prompt_id,
    ]


def test_a_turn_no_report_told_of_holds_the_prompt_and_costs_it_no_budget(client, sim_control):
    """The host runs a turn the mirror never saw (its reports lost). The prompt is sent and
    refused `busy`; the host is asked what it runs, the mirror records the turn, and the
    prompt waits for its end with its budget untouched (a hold, not a failure). Once the
    host no longer lists the turn (the sweeper's reconcile of a stale turn), the prompt
    goes: one turn at a time, counted at the host."""
    from datetime import timedelta

    from agent_radar.models.base import utcnow
    from agent_radar.workflows.activity.reconcile import RECONCILE_INTERVAL_S, STALE_TURN_S
    from agent_radar.workflows.steps.prompt_dispatch import dispatch_next
    from agent_radar.workflows.task_names import RESTORE_TASK
    from tests.helpers import restorer

    client.ensure_session(WS, SID)
    sim_control.session(WS, SID, turn={"turn_id": "unseen"})
    prompt = client.submit_prompt(WS, SID, "hello", client_submit_id="p1")
    assert dispatch_next(client.engine, client.runtime, WS, SID) == "retry: busy"
    queued = client.get_prompt(prompt.prompt_id)
    assert (queued.status, queued.attempt) == ("queued", 0)
    assert client.session_info(WS, SID).active_turn_id == "unseen"  # learnt from the host
    assert dispatch_next(client.engine, client.runtime, WS, SID) == "busy"  # nothing sent
    sim_control.session(WS, SID, settle_turn="unseen")
    eventually(
        lambda: sim_control.session(WS, SID)["turns"]["unseen"]["phase"] == "settled",
        what="the turn to end at the host",
    )
    # A turn running past the bound, its session not asked since long enough: asked again.
    later = utcnow() + timedelta(seconds=max(STALE_TURN_S, RECONCILE_INTERVAL_S) + 1)
    assert (RESTORE_TASK, {"workspace_id": WS, "session_id": SID}) in sweep(client, later)
    assert restorer(client).restore(WS, SID) == "restored"  # the host asked: it has ended
    assert client.session_info(WS, SID).active_turn_id is None
    assert dispatch_next(client.engine, client.runtime, WS, SID) == "dispatched"
    assert [e["prompt_id"] for e in sim_control.effects("prompt")] == [prompt.prompt_id]


def test_a_settled_report_of_another_turn_naming_the_prompt_ends_nothing(client, sim_control):
    """The host answered prompt p1 with its turn id T1 (on the prompt's record). A report then
    says a turn of another id, naming p1, settled (forged, or a buggy host's). p1 is not
    ended by it (p2 was sent at once, beside T1 still running: two prompt turns at the
    host); T1's own settle ends it, and then p2 goes."""
    from agent_radar.workflows.steps.prompt_dispatch import dispatch_next
    from tests.helpers import first_of_two_prompts_sent

    first, second = first_of_two_prompts_sent(client, sim_control, WS, SID)
    t1 = client.get_prompt(first.prompt_id).turn_id
    report(
        client,
        turn={
            "turn_id": "not-" + t1,
            "phase": "settled",
            "outcome": "completed",
            "origin": "user_prompt",
            "prompt_id": first.prompt_id,
        },
    )
    assert dispatch_next(client.engine, client.runtime, WS, SID) == "busy"
    assert client.get_prompt(first.prompt_id).status == "dispatched"
    assert len(sim_control.effects("prompt")) == 1
    sim_control.session(WS, SID, settle_turn=t1)  # T1 ends at the host, its report below
    eventually(
        lambda: sim_control.session(WS, SID)["turns"][t1]["phase"] == "settled",
        what="T1 to end at the host",
    )
    report(
        client,
        turn={
            "turn_id": t1,
            "phase": "settled",
            "outcome": "completed",
            "origin": "user_prompt",
            "prompt_id": first.prompt_id,
        },
    )
    assert client.get_prompt(first.prompt_id).status == "completed"
    assert dispatch_next(client.engine, client.runtime, WS, SID) == "dispatched"
    assert [e["prompt_id"] for e in sim_control.effects("prompt")] == [
        first.prompt_id,
        second.prompt_id,
    ]


def test_a_move_back_waits_for_the_stop_owed_to_that_host(client, sim_control, sim_b):
    """A run runs at A; the session moves to B (the run ends `interrupted` in the record, a
    durable stop is owed to A) and A refuses that stop for now (503, retried later). A move
    back to A is refused (session_busy, naming the stop) and writes nothing: the queued
    prompt would go to A at once, beside the run the stop never reached. Once the stop is
    delivered the move goes, and the prompt runs at A alone."""
    from agent_radar.workflows import ids
    from agent_radar.workflows.steps.cancel import CancelRunner
    from agent_radar.workflows.steps.prompt_dispatch import dispatch_next

    client.add_host("host-b", sim_b.url)
    client.ensure_session(WS, SID)
    sim_control.session(WS, SID, maintenance_duration_ms=60_000, turn_duration_ms=0)
    run = client.start_maintenance(WS, SID, client_submit_id="m1")
    assert maintenance_executor(client, max_wait_s=0.1).execute(run.run_id) == "handed_back"
    prompt = client.submit_prompt(WS, SID, "after the run", client_submit_id="p1")
    assert dispatch_next(client.engine, client.runtime, WS, SID) == "held"
    client.ensure_session(WS, SID, host_id="host-b")
    assert client.get_maintenance(run.run_id).status == "interrupted"
    sim_control.fault(f"maintenance/{run.run_id}/cancel", status=503, count=100)
    runner = CancelRunner(
        client.engine, client.runtime, worker_id="c", lease_s=5, publish=lambda *a: True
    )
    stop_id = ids.run_stop_id(WS, SID, run.run_id)
    assert runner.apply(stop_id) == "retry"  # owed, due later
    with pytest.raises(SessionBusy) as busy:
        client.ensure_session(WS, SID, host_id="default")  # back to A
    assert busy.value.operation_id == stop_id
    assert client.session_info(WS, SID).host_id == "host-b"  # not moved
    sim_control.clear_faults()
    assert runner.apply(stop_id) == "settled"
    assert not run_running_at_host(sim_control, run.run_id)
    client.ensure_session(WS, SID, host_id="default")
    assert dispatch_next(client.engine, client.runtime, WS, SID) == "dispatched"
    assert [e["prompt_id"] for e in sim_control.effects("prompt")] == [prompt.prompt_id]


def sweep(client, at):
    from agent_radar.beat.sweeper import sweep_once

    published = []
    sweep_once(client.engine, lambda task, kw: published.append((task, kw)) or True, at, owner="t")
    return published


def test_a_prompt_sent_again_whose_turn_settled_meanwhile_ends_and_the_queue_moves(
    client, sim_control
):
    """p1's call times out at the worker but the host took it: p1 goes back to the queue while
    its turn T1 runs, is reported (naming p1) and settles. p1 is sent again; the host answers
    with T1 (it takes a prompt once), whose settle is on record already: no report of it will
    come again. p1 stayed `dispatched` for good, and the queue and maintenance with it. Now
    the sweeper's look at a prompt with no turn of it running on record asks the host, which
    runs no turn of p1: p1 ends and p2 goes, each reaching the host once. (The host's word
    decides, not the settled record: a host that restarted may give p1's new turn that id.)"""
    from datetime import timedelta

    from agent_radar.models.base import utcnow
    from agent_radar.models.db import run_transaction
    from agent_radar.models.operations import Prompt
    from agent_radar.workflows.steps.prompt_dispatch import dispatch_next
    from agent_radar.workflows.task_names import PROMPT_TASK, RESTORE_TASK
    from tests.helpers import restorer

    client.ensure_session(WS, SID)
    sim_control.session(WS, SID, turn_duration_ms=0)
    p1, p2, t1, epoch = first_send_lands_and_settles_while_queued(client, sim_control, WS, SID)
    assert client.get_prompt(p1.prompt_id).status == "queued"  # not known to be sent
    assert dispatch_next(client.engine, client.runtime, WS, SID) == "dispatched"
    assert client.get_prompt(p1.prompt_id).turn_id == t1
    # Three minutes on (the look waits two: a report may be on its way).
    sent_before = utcnow() - timedelta(minutes=3)
    run_transaction(
        client.engine,
        lambda s: s.get(Prompt, p1.prompt_id).__setattr__("dispatched_at", sent_before),
    )
    published = sweep(client, utcnow())
    assert (RESTORE_TASK, {"workspace_id": WS, "session_id": SID}) in published
    woken: list = []
    assert restorer(client, published=woken).restore(WS, SID) == "restored"
    assert PROMPT_TASK in woken
    assert client.get_prompt(p1.prompt_id).status == "completed"
    assert dispatch_next(client.engine, client.runtime, WS, SID) == "dispatched"
    assert client.get_prompt(p2.prompt_id).status == "dispatched"
    assert [e["text"] for e in sim_control.effects("prompt")] == ["first", "second"]


def test_a_prompt_sent_again_after_a_restart_is_not_ended_by_its_old_turn_of_the_same_id(
    client, sim_control
):
    """A host that numbers its turns gives `turn-1` again after a restart. p1's send timed out
    but landed: its turn-1 ran, was reported naming p1 and settled while p1 was queued. The
    host restarts; p1 goes again and the new process starts a new turn for it, `turn-1` too.
    The settled record of the old one ends nothing: p2 waits, and the host's word keeps p1
    in flight while its new turn runs, then ends it (found by a review of the first fix,
    which ended p1 by the record and sent p2 beside its turn)."""
    from datetime import timedelta

    from agent_radar.models.base import utcnow
    from agent_radar.models.db import run_transaction
    from agent_radar.models.operations import Prompt
    from agent_radar.workflows.steps.prompt_dispatch import dispatch_next
    from tests.helpers import restorer

    client.ensure_session(WS, SID)
    sim_control.session(WS, SID, turn_duration_ms=0, numbered_turns=True)
    p1, p2, t1, epoch = first_send_lands_and_settles_while_queued(client, sim_control, WS, SID)
    sim_control.session(WS, SID, restart=True)
    restorer(client).cancels.require_live(WS, SID)
    assert client.session_info(WS, SID).runtime_epoch == epoch + 1
    assert dispatch_next(client.engine, client.runtime, WS, SID) == "dispatched"
    again = sim_control.effects("prompt")[1]
    assert (again["prompt_id"], again["turn_id"]) == (p1.prompt_id, t1)
    assert client.get_prompt(p1.prompt_id).status == "dispatched"
    # The look at a prompt with no turn of it running on record: the host lists it running.
    sent_before = utcnow() - timedelta(minutes=3)
    run_transaction(
        client.engine,
        lambda s: s.get(Prompt, p1.prompt_id).__setattr__("dispatched_at", sent_before),
    )
    restorer(client).reconcile(WS, SID)
    assert client.get_prompt(p1.prompt_id).status == "dispatched"
    assert dispatch_next(client.engine, client.runtime, WS, SID) == "busy"
    assert [e["prompt_id"] for e in sim_control.effects("prompt")] == [p1.prompt_id] * 2
    assert client.get_prompt(p2.prompt_id).status == "queued"
    # Its new turn ends unreported: the next look ends p1, and p2 goes, alone.
    sim_control.session(WS, SID, settle_turn=t1)
    eventually(lambda: sim_control.session(WS, SID)["turns"][t1]["phase"] == "settled")
    restorer(client).reconcile(WS, SID)
    assert client.get_prompt(p1.prompt_id).status == "completed"
    assert dispatch_next(client.engine, client.runtime, WS, SID) == "dispatched"
    assert [e["prompt_id"] for e in sim_control.effects("prompt")][2:] == [p2.prompt_id]


def test_an_offline_answer_does_not_forget_a_prompt_send_that_may_still_land(client, sim_control):
    """p1's first send is slow at the host (past the worker's timeout): it may still land,
    and admission refuses. The session drops offline; p1's next send is answered
    `disconnected` (a wait, no budget), which says nothing of the first send: admission still
    refuses after the session reconnects at the same epoch, and no run meets p1's turn
    (found by a review: the offline answer cleared what the refusal rested on)."""
    from agent_radar.workflows.steps.prompt_dispatch import dispatch_next

    client.ensure_session(WS, SID)
    sim_control.session(WS, SID, maintenance_duration_ms=60_000, turn_duration_ms=0)
    p1 = client.submit_prompt(WS, SID, "hello", client_submit_id="p1")
    sim_control.latency("prompts", 4000)
    assert dispatch_next(client.engine, client.runtime, WS, SID).startswith("retry: ")
    sim_control.latency("prompts", 0)
    with pytest.raises(SessionBusy):
        client.start_maintenance(WS, SID, client_submit_id="m0")
    sim_control.session(WS, SID, live=False)  # a network fault: offline at the host
    assert dispatch_next(client.engine, client.runtime, WS, SID) == "retry: disconnected"
    sim_control.session(WS, SID, live=True)  # reconnected, same epoch
    with pytest.raises(SessionBusy) as busy:
        client.start_maintenance(WS, SID, client_submit_id="m1")
    assert busy.value.prompt_id == p1.prompt_id
    eventually(lambda: sim_control.effects("prompt"), what="the first send to land")
    assert not sim_control.effects("maintenance")


def moved_to_b_with_its_goal_unknown(client, sim_control, sim_b):
    """A goal applied at A; the session moves to B, whose delivery of it fails once (503):
    the goal is `unknown` there, for the restore to deliver. B runs a run for a minute.
    Returns B's control."""
    from agent_radar.workflows.errors import RuntimeFault
    from agent_radar.workflows.tools.simulator import SimControl

    client.add_host("host-b", sim_b.url)
    b = SimControl(sim_b.url)
    client.ensure_session(WS, SID)
    sim_control.session(WS, SID, continuation_turns=False)
    goal = client.set_goal(WS, SID, "G", client_submit_id="g1")
    d = Dispatcher(client.engine, client.runtime, worker_id="d", lease_s=5)
    assert [r.outcome for r in d.dispatch(goal.operation_id)] == ["applied"]
    b.session(WS, SID, maintenance_duration_ms=60_000, continuation_turns=False)
    b.fault("goal", status=503, count=1)
    with pytest.raises(RuntimeFault):
        client.ensure_session(WS, SID, host_id="host-b")  # moved; the goal not yet there
    assert client.goal_state(WS, SID).sync_status == "unknown"
    return b


def test_the_restore_holds_the_owed_goal_back_during_a_run_and_delivers_it_after(
    client, sim_control, sim_b
):
    """The session moves to B, which fails the goal the move owes it (one 503): the goal is
    `unknown` there, the restore is to deliver it. Meanwhile a run is admitted at B (idle)
    and started. The restore installs fences but sends no goal into the run; the run's end
    asks for a restore again, which delivers the goal: B gets it once, after the run."""
    from datetime import timedelta

    from agent_radar.models.base import utcnow
    from agent_radar.workflows.task_names import RESTORE_TASK
    from tests.helpers import restorer

    b = moved_to_b_with_its_goal_unknown(client, sim_control, sim_b)
    run = client.start_maintenance(WS, SID, client_submit_id="m1")
    assert maintenance_executor(client, max_wait_s=0.1).execute(run.run_id) == "handed_back"
    assert b.session(WS, SID)["runs"][run.run_id]["running"]
    published = sweep(client, utcnow() + timedelta(minutes=6))
    assert (RESTORE_TASK, {"workspace_id": WS, "session_id": SID}) in published
    restorer(client).restore(WS, SID)

    def at_b():
        return [e["kind"] for e in b.effects(kind=None) if e["kind"] in ("goal", "maintenance")]

    assert at_b() == ["maintenance"]  # nothing sent into the run
    assert client.goal_state(WS, SID).sync_status == "unknown"
    # The run ends (cancelled); its release asks for the restore that delivers the goal.
    client.cancel_maintenance(run.run_id)
    woken: list = []
    assert maintenance_executor(client, woken).execute(run.run_id) == "cancelled"
    assert (RESTORE_TASK, {"workspace_id": WS, "session_id": SID}) in woken
    assert restorer(client).restore(WS, SID) == "restored"
    assert at_b() == ["maintenance", "goal"]
    assert client.goal_state(WS, SID).sync_status != "unknown"


def test_a_run_is_refused_while_a_restore_s_goal_is_on_its_way(client, sim_control, sim_b):
    """The session moved to B, whose goal call failed: the goal is `unknown` there and the
    restore delivers it. B is slow to take the call; meanwhile a run asks to be admitted: it
    is refused while the restore's delivery is on its way (the restore's call holds no
    operation's lease, so nothing showed it: the goal landed inside the run), and goes once
    it is done, after the goal (found by a review of the morning's fixes)."""

    from datetime import timedelta

    from agent_radar.models.base import utcnow
    from tests.helpers import restorer

    b = moved_to_b_with_its_goal_unknown(client, sim_control, sim_b)
    sweep(client, utcnow() + timedelta(minutes=6))  # the restore comes due
    b.hold("goal")
    result: dict = {}
    worker = threading.Thread(
        target=lambda: result.setdefault("r", restorer(client).restore(WS, SID))
    )
    worker.start()
    eventually(lambda: b.holding() >= 1, what="the restore's goal call on its way to B")
    with pytest.raises(SessionBusy):
        client.start_maintenance(WS, SID, client_submit_id="m1")
    b.hold("goal", hold=False)
    worker.join(15)
    assert result["r"] == "restored"
    run = client.start_maintenance(WS, SID, client_submit_id="m1")
    assert maintenance_executor(client, max_wait_s=0.1).execute(run.run_id) == "handed_back"
    at_b = [e["kind"] for e in b.effects(kind=None) if e["kind"] in ("goal", "maintenance")]
    assert at_b == ["goal", "maintenance"]


def test_a_start_still_on_its_way_when_recovery_asks_never_lands(client, sim_control):
    """The executor's start call is slow to reach the host (its claim's lease runs out: the
    fences, the state look and the start are made back to back with no heartbeat, each up to
    the runtime timeout). The sweeper sends the run through recovery (worker_lost); recovery
    asks the host, which does not know the run yet (404), and asks it to stop the run it does
    not know: the host refuses that run's start from then on. The run ends `interrupted`,
    the session is released, a prompt goes and its turn runs. Then the start lands: refused,
    the run never starts at the host."""
    from datetime import timedelta

    from agent_radar.models.base import utcnow
    from agent_radar.workflows.steps.prompt_dispatch import dispatch_next

    client.ensure_session(WS, SID)
    sim_control.session(WS, SID, maintenance_duration_ms=60_000, turn_duration_ms=0)
    run = client.start_maintenance(WS, SID, client_submit_id="m1")
    sim_control.hold("maintenance")  # the start call (not the status call)
    first = maintenance_executor(client, max_wait_s=0.5)
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("r", first.execute(run.run_id)))
    worker.start()
    eventually(lambda: sim_control.holding() >= 1, what="the start call on its way")
    sweep(client, utcnow() + timedelta(minutes=1))  # its lease ran out meanwhile
    assert client.get_maintenance(run.run_id).status == "recovery_required"
    later = maintenance_executor(client, clock=lambda: utcnow() + timedelta(minutes=1))
    assert later.execute(run.run_id) == "interrupted"  # the host: 404 not_found
    refused = sim_control.session(WS, SID)["runs"][run.run_id]
    assert refused["state"] == "refused" and not refused["running"]
    prompt = client.submit_prompt(WS, SID, "after the run", client_submit_id="p1")
    assert dispatch_next(client.engine, client.runtime, WS, SID) == "dispatched"
    worker.join(15)  # its call timed out: it lets go, and stops nothing
    assert result["r"] == "runtime_unavailable"
    sim_control.hold("maintenance", hold=False)  # the start reaches the host now
    eventually(lambda: sim_control.holding() == 0, what="the start to be let go")
    eventually(
        lambda: len([c for c in sim_control.calls() if c["call"] == "maintenance"]) == 1,
        what="the start to reach the host",
    )
    time.sleep(0.3)  # the host answers it (to nobody)
    turn = client.get_prompt(prompt.prompt_id).turn_id
    assert sim_control.session(WS, SID)["turns"][turn]["phase"] == "running"
    assert [e["kind"] for e in effects_at_host(sim_control)] == ["prompt"]
    assert sim_control.session(WS, SID)["runs"][run.run_id]["state"] == "refused"
    assert client.get_maintenance(run.run_id).status == "interrupted"


def test_a_prompt_that_comes_late_is_refused_beside_a_run(client, sim_control):
    """A prompt's send was slow to reach the host; meanwhile the control plane gave up on it
    (its budget spent) and a run started there. When the late send lands, the host refuses
    it `busy`: no turn starts beside the run. Counted at the host."""
    client.ensure_session(WS, SID)
    sim_control.session(WS, SID, maintenance_duration_ms=60_000, turn_duration_ms=0)
    run = client.start_maintenance(WS, SID, client_submit_id="m1")
    assert maintenance_executor(client, max_wait_s=0.1).execute(run.run_id) == "handed_back"
    assert run_running_at_host(sim_control, run.run_id)
    with pytest.raises(RuntimeFault) as busy:  # the late send, as it lands
        client.runtime.submit_prompt(WS, SID, prompt_id="p-late", text="beside the run?")
    assert busy.value.code == "busy" and busy.value.retryable
    assert [e["kind"] for e in effects_at_host(sim_control)] == ["maintenance"]
    assert not [t for t in sim_control.session(WS, SID)["turns"].values()]

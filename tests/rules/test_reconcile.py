"""The host is the truth (docs/lifecycles.md: reconcile), on both backends: the turns on record
are a mirror built from reports, which get lost or forged; what the host answers to the state
call decides. Each test holds one sequence of issue 44's table that left a session wedged."""

import time
from datetime import timedelta

import pytest

from agent_radar.beat.sweeper import sweep_once
from agent_radar.models.base import utcnow
from agent_radar.models.db import run_transaction
from agent_radar.models.tables import AgentSession, Turn
from agent_radar.workflows.activity.reconcile import RECONCILE_INTERVAL_S, STALE_TURN_S
from agent_radar.workflows.errors import SessionBusy
from agent_radar.workflows.task_names import PROMPT_TASK, RESTORE_TASK
from tests.helpers import first_of_two_prompts_sent, maintenance_executor, restorer

WS, SID = "ws-reconcile", "s1"


def report(client, **parts):
    client.report_activity(
        {"workspace_id": WS, "session_id": SID, "occurred_at_ms": int(time.time() * 1000), **parts}
    )


def turn_row(client, turn_id):
    return run_transaction(client.engine, lambda s: s.get(Turn, (WS, SID, turn_id)))


def session_row(client):
    return run_transaction(client.engine, lambda s: s.get(AgentSession, (WS, SID)))


def sweep(client, at):
    published = []
    sweep_once(client.engine, lambda task, kw: published.append((task, kw)) or True, at, owner="t")
    return published


def test_a_first_confirmed_epoch_ends_the_turns_of_an_older_claimed_one(client, sim_control):
    """Row 5: reports said epoch 1, never confirmed; the host restarted and epoch 2 was the
    first confirmed. 0 -> 2 was taken as the first epoch learnt, and the epoch-1 turn stayed
    running for good: prompts queued, maintenance `session_busy`."""
    sim_control.session(WS, SID, turn={"turn_id": "t1"})
    report(client, session={"runtime_epoch": 1}, turn={"turn_id": "t1", "phase": "running"})
    assert (session_row(client).runtime_epoch, turn_row(client, "t1").runtime_epoch) == (0, 1)
    sim_control.session(WS, SID, restart=True)  # epoch 2; t1 ended with the old process
    assert client.ensure_session(WS, SID).runtime_epoch == 2
    ended = turn_row(client, "t1")
    assert (ended.phase, ended.outcome) == ("settled", "interrupted")
    assert session_row(client).active_turn_id is None
    assert client.start_maintenance(WS, SID, client_submit_id="m1").status == "running"


def test_a_ghost_turn_is_ended_by_the_host_s_answer(client, sim_control):
    """Row 6: a report of a running turn the host never ran (forged, or a real turn whose
    settled report was lost) wedged the session for good. Once it has been on record past
    STALE_TURN_S, the sweeper has the host asked, and its answer ends it."""
    client.ensure_session(WS, SID)
    report(client, turn={"turn_id": "ghost", "phase": "running"})
    prompt = client.submit_prompt(WS, SID, "hello", client_submit_id="p1")
    with pytest.raises(SessionBusy):
        client.start_maintenance(WS, SID, client_submit_id="m1")
    now = utcnow()
    assert sweep(client, now) == []  # seen just now: a turn may run for long
    later = now + timedelta(seconds=STALE_TURN_S + 1)
    assert (RESTORE_TASK, {"workspace_id": WS, "session_id": SID}) in sweep(client, later)
    published = []
    assert restorer(client, published=published).restore(WS, SID) == "restored"
    ghost = turn_row(client, "ghost")
    assert (ghost.phase, ghost.outcome) == ("settled", "interrupted")
    assert session_row(client).active_turn_id is None
    assert PROMPT_TASK in published  # the queue moves on
    assert client.get_prompt(prompt.prompt_id).status == "queued"
    assert client.start_maintenance(WS, SID, client_submit_id="m2").status == "running"
    # Asked once: not again before RECONCILE_INTERVAL_S, whatever the mirror holds.
    report(client, turn={"turn_id": "ghost-2", "phase": "running"})
    run_transaction(
        client.engine,
        lambda s: s.get(Turn, (WS, SID, "ghost-2")).__setattr__("seen_at", later),
    )
    again = later + timedelta(seconds=STALE_TURN_S + 1)
    assert RESTORE_TASK not in [task for task, _kw in sweep(client, again)]
    asked = session_row(client).reconciled_at
    assert RESTORE_TASK in [
        task for task, _kw in sweep(client, asked + timedelta(seconds=RECONCILE_INTERVAL_S + 1))
    ]


def test_a_turn_the_host_runs_stays_and_one_it_started_unseen_is_recorded(client, sim_control):
    """The host's answer never ends a turn it lists, nor one first seen after it was asked;
    a turn it lists that no report told of is recorded (and the session is busy)."""
    client.ensure_session(WS, SID)
    sim_control.session(WS, SID, turn={"turn_id": "real"})
    sim_control.session(WS, SID, turn={"turn_id": "unreported"})
    report(client, turn={"turn_id": "real", "phase": "running"})
    report(client, turn={"turn_id": "late", "phase": "running"})
    future = utcnow() + timedelta(seconds=60)
    run_transaction(
        client.engine,
        lambda s: s.get(Turn, (WS, SID, "late")).__setattr__("seen_at", future),
    )  # as if its report landed while the host was being asked
    done = restorer(client).reconcile(WS, SID)
    assert (done.ended, done.recorded) == ([], ["unreported"])
    assert turn_row(client, "real").phase == "running"
    assert turn_row(client, "late").phase == "running"
    assert turn_row(client, "unreported").phase == "running"
    with pytest.raises(SessionBusy):
        client.start_maintenance(WS, SID, client_submit_id="m1")


def test_a_restore_meeting_faults_stops_at_its_budget_and_shows(client, sim_control, monkeypatch):
    """Row 14: a restore that met a runtime fault was retried every 10 s for ever, and
    nothing showed it. Each fault uses one attempt of the budget; past it the restore
    stops, its error stays on the session, and the next restore that succeeds clears it.
    (The host's circuit, open after the failures, lets its trial through at once here.)"""
    from agent_radar.workflows import budgets
    from agent_radar.workflows.adapters import bulkhead

    monkeypatch.setattr(bulkhead, "BREAKER_OPEN_S", 0.0)
    from agent_radar.workflows.fences.restores import request as request_restore

    client.ensure_session(WS, SID)
    sim_control.fault("liveness", status=500, count=budgets.MAX_ATTEMPTS + 5, session_id=SID)
    for attempt in range(1, budgets.MAX_ATTEMPTS + 1):
        run_transaction(
            client.engine,
            lambda s: s.get(AgentSession, (WS, SID)).__setattr__("restore_due_at", utcnow()),
        )
        assert restorer(client).restore(WS, SID) == "retry"
        assert session_row(client).restore_attempt == attempt
    row = session_row(client)
    assert row.restore_due_at is None  # spent: not tried again on its own
    assert row.restore_error.startswith("budget_exhausted")
    sim_control.clear_faults()
    run_transaction(
        client.engine, lambda s: request_restore(s.get(AgentSession, (WS, SID)), utcnow())
    )
    assert restorer(client).restore(WS, SID) == "restored"
    row = session_row(client)
    assert (row.restore_attempt, row.restore_error, row.restore_failing_since) == (0, None, None)


def test_diverged_goals_out_of_budget_restores_and_wedged_sessions_show_in_status(client, host):
    """Row 15: a host whose goal answer had one key more than `{objective, status}` left
    the goal `diverged`, and `status`, `--check` and the metrics never said. They say so now,
    as they do a restore out of budget and a session whose stale turn nobody could ask about."""
    from agent_radar.workflows.adapters.http_runtime import HttpRuntime
    from agent_radar.workflows.steps.goals.dispatch import Dispatcher
    from agent_radar.workflows.tools.metrics import FleetCollector
    from agent_radar.workflows.tools.status import fleet_status, problems

    host.answers[(SID, "liveness")] = (200, b'{"live": true, "runtime_epoch": 1}')
    host.answers[(SID, "goal")] = (
        200,
        b'{"phase": "applied", "goal": {"objective": "mine", "status": "active", "x": 1},'
        b' "evidence": {"applied_revision": 1}}',
    )
    op = client.set_goal(WS, SID, "mine", client_submit_id="g1")
    dispatcher = Dispatcher(client.engine, HttpRuntime(host.url), worker_id="d", lease_s=5)
    assert [r.outcome for r in dispatcher.dispatch(op.operation_id)] == ["applied"]
    assert client.goal_state(WS, SID).sync_status == "diverged"
    report(client, turn={"turn_id": "stale", "phase": "running"})

    def age(s):
        s.get(Turn, (WS, SID, "stale")).seen_at = utcnow() - timedelta(hours=1)
        row = s.get(AgentSession, (WS, SID))
        row.restore_attempt, row.restore_error = 24, "budget_exhausted (24 attempts): 500"

    run_transaction(client.engine, age)
    status = fleet_status(client.engine)
    assert (
        status["goals_diverged"],
        status["restores_out_of_budget"],
        status["wedged_sessions"],
    ) == (1, 1, 1)
    assert status["worst"]["wedged_sessions"] == [f"{WS}/{SID}"]
    found = problems(status, sweep_interval_s=2.0)
    assert any("1 goal(s) diverged" in p for p in found)
    assert any("1 session restore(s) out of budget" in p for p in found)
    assert any("1 session(s) wedged" in p for p in found)
    gauges = {m.name: m.samples[0].value for m in FleetCollector(client.engine).collect()}
    assert gauges["agent_radar_goals_diverged"] == 1
    assert gauges["agent_radar_restores_out_of_budget"] == 1
    assert gauges["agent_radar_sessions_wedged"] == 1
    # Asked (the host answers that nothing runs): no longer wedged.
    run_transaction(
        client.engine,
        lambda s: s.get(AgentSession, (WS, SID)).__setattr__("reconciled_at", utcnow()),
    )
    assert fleet_status(client.engine)["wedged_sessions"] == 0


def starts_at_host(sim_control):
    return [c for c in sim_control.calls() if c["call"] == "maintenance" and c["session_id"] == SID]


def test_a_prompt_in_flight_keeps_maintenance_out(client, sim_control):
    """Row 4: a prompt was sent (its turn id known) and its `running` report was still in
    the broker; maintenance was admitted beside the user's turn. A prompt in flight is busy."""
    from agent_radar.workflows.steps.prompt_dispatch import dispatch_next

    client.ensure_session(WS, SID)
    prompt = client.submit_prompt(WS, SID, "hello", client_submit_id="p1")
    assert dispatch_next(client.engine, client.runtime, WS, SID) == "dispatched"
    assert session_row(client).active_turn_id is None  # no report yet
    with pytest.raises(SessionBusy, match=prompt.prompt_id):
        client.start_maintenance(WS, SID, client_submit_id="m1")


def test_a_turn_the_mirror_never_saw_keeps_a_run_from_starting_at_the_host(client, sim_control):
    """The mirror says idle, the host runs a turn no report told of: the run is asked about
    before it starts there, ends `failed` (session_busy), and the host never starts it."""
    client.ensure_session(WS, SID)
    sim_control.session(WS, SID, turn={"turn_id": "unseen"})
    run = client.start_maintenance(WS, SID, client_submit_id="m1")  # the mirror is idle
    assert maintenance_executor(client).execute(run.run_id) == "failed"
    ended = client.get_maintenance(run.run_id)
    assert (ended.status, ended.error_code) == ("failed", "session_busy")
    assert "unseen" in ended.detail
    assert starts_at_host(sim_control) == []
    assert turn_row(client, "unseen").phase == "running"  # recorded from the answer
    assert (
        client.get_maintenance(
            client.start_maintenance(WS, SID, client_submit_id="m1").run_id
        ).status
        == "failed"
    )  # a replay is the same run


def test_a_turn_that_starts_while_the_run_s_start_is_on_the_wire_keeps_it_out(client, sim_control):
    """The host was idle when asked; a turn starts there (no report of it) while the run's
    start is on its way. The host refuses the start `busy` (docs/protocol.md: one thing at a
    time): the run ends `failed` (session_busy, in the host's words), never started there,
    and the session is released."""
    import threading

    from tests.helpers import eventually

    client.ensure_session(WS, SID)
    run = client.start_maintenance(WS, SID, client_submit_id="m1")
    sim_control.hold("maintenance")
    result: dict = {}
    executor = maintenance_executor(client)
    worker = threading.Thread(target=lambda: result.setdefault("r", executor.execute(run.run_id)))
    worker.start()
    eventually(lambda: sim_control.holding() >= 1, what="the start on its way")
    sim_control.session(WS, SID, turn={"turn_id": "meanwhile"})
    sim_control.hold("maintenance", hold=False)
    worker.join(15)
    assert result["r"] == "failed"
    ended = client.get_maintenance(run.run_id)
    assert (ended.status, ended.error_code) == ("failed", "session_busy")
    assert "meanwhile" in ended.detail
    assert len(starts_at_host(sim_control)) == 1  # it reached the host,
    assert sim_control.effects("maintenance") == []  # which ran nothing
    assert sim_control.session(WS, SID)["runs"] == {}


def test_a_run_admitted_against_an_epoch_the_host_left_never_starts(client, sim_control):
    """Row 11: a report claimed epoch 3 (the host really is at 3); right after,
    start_maintenance(expected_runtime_epoch=2) was admitted and started. The host's answer
    before the start confirms 3, which ends the run of epoch 2 before it reaches the host."""
    sim_control.session(WS, SID, restart=True)  # epoch 2
    assert client.ensure_session(WS, SID).runtime_epoch == 2
    sim_control.session(WS, SID, restart=True)  # epoch 3
    report(client, session={"runtime_epoch": 3})  # a claim, not yet confirmed
    run = client.start_maintenance(WS, SID, client_submit_id="m1", expected_runtime_epoch=2)
    assert maintenance_executor(client).execute(run.run_id) == "interrupted"
    ended = client.get_maintenance(run.run_id)
    assert (ended.status, ended.error_code) == ("interrupted", "runtime_restarted")
    assert starts_at_host(sim_control) == []
    assert session_row(client).runtime_epoch == 3


def test_a_turn_id_the_host_gives_again_after_a_restart_is_another_turn(client, sim_control):
    """Row 7: a host that numbers its turns gave an id again after a restart; the new turn
    landed on the old (settled) record: invisible, its prompt never ended, maintenance was
    admitted beside it and a stop did not cancel it. A turn is (host, epoch, turn id)."""
    from agent_radar.workflows.steps.cancel import CancelRunner

    client.ensure_session(WS, SID)  # epoch 1
    sim_control.session(WS, SID, turn={"turn_id": "t-1"})
    report(client, session={"runtime_epoch": 1}, turn={"turn_id": "t-1", "phase": "running"})
    report(
        client,
        session={"runtime_epoch": 1},
        turn={"turn_id": "t-1", "phase": "settled", "outcome": "completed"},
    )
    sim_control.session(WS, SID, restart=True)  # epoch 2: the host numbers from 1 again
    assert client.ensure_session(WS, SID).runtime_epoch == 2
    sim_control.session(WS, SID, turn={"turn_id": "t-1"})
    report(client, session={"runtime_epoch": 2}, turn={"turn_id": "t-1", "phase": "running"})
    key = session_row(client).active_turn_id
    assert key not in (None, "t-1")
    again = turn_row(client, key)
    assert (again.host_turn_id, again.runtime_epoch, again.phase) == ("t-1", 2, "running")
    assert turn_row(client, "t-1").outcome == "completed"  # the first one, as it was
    with pytest.raises(SessionBusy):
        client.start_maintenance(WS, SID, client_submit_id="m1")
    stop = client.stop_session(WS, SID, client_submit_id="stop-1")
    assert stop.turn_id == key
    runner = CancelRunner(
        client.engine, client.runtime, worker_id="c", lease_s=5, publish=lambda *a: True
    )
    assert runner.apply(stop.cancel_operation_id) == "settled"
    at_host = sim_control.session(WS, SID)["turns"]["t-1"]
    assert (at_host["phase"], at_host["outcome"]) == ("settled", "canceled")  # counted there
    assert turn_row(client, key).outcome == "canceled"
    assert session_row(client).active_turn_id is None
    assert client.start_maintenance(WS, SID, client_submit_id="m1").status == "running"


def test_a_run_handed_back_is_re_attached_whatever_else_the_host_runs_by_then(client, sim_control):
    """The look before the start stops a run the host never started; one it started (and
    handed back to another worker) is the host's own: it is polled to its end, even with a
    turn running there by then."""
    client.ensure_session(WS, SID)
    sim_control.session(WS, SID, maintenance_duration_ms=200)
    run = client.start_maintenance(WS, SID, client_submit_id="m1")
    executor = maintenance_executor(client, max_wait_s=0.05)
    assert executor.execute(run.run_id) == "handed_back"
    sim_control.session(WS, SID, turn={"turn_id": "after"})
    time.sleep(0.3)  # the run is done at the host
    assert executor.execute(run.run_id) == "completed"
    # Started once there (the second start call is the idempotent re-attach).
    assert len(sim_control.effects(kind="maintenance")) == 1


def _prompt_sent_long_ago_unreported(client, sim_control):
    """Two prompts; the first went STALE_TURN_S ago, to a host whose turns run until they are
    ended, and no report of its turn came."""
    from agent_radar.models.operations import Prompt
    from agent_radar.workflows.steps.prompt_dispatch import dispatch_next

    first, second = first_of_two_prompts_sent(client, sim_control, WS, SID)
    assert dispatch_next(client.engine, client.runtime, WS, SID) == "busy"
    sent = utcnow() - timedelta(seconds=STALE_TURN_S + 1)
    run_transaction(
        client.engine, lambda s: s.get(Prompt, first.prompt_id).__setattr__("dispatched_at", sent)
    )
    return first, second


def test_a_prompt_whose_reports_were_lost_ends_once_its_host_lists_it_no_more(client, sim_control):
    """The prompt's turn ran and ended at the host, and neither report of it came: the queue
    was busy for good. Sent STALE_TURN_S ago, it has the sweeper ask the host; a turn the host
    does not list ended there, so the prompt ends and the next one goes."""
    from agent_radar.workflows.steps.prompt_dispatch import dispatch_next

    first, second = _prompt_sent_long_ago_unreported(client, sim_control)
    turn_id = client.get_prompt(first.prompt_id).turn_id
    client.runtime.cancel_turn(WS, SID, turn_id, operation_id="c", reason="test", require_live=True)
    assert sim_control.session(WS, SID)["turns"][turn_id]["phase"] == "settled"  # unreported
    assert (RESTORE_TASK, {"workspace_id": WS, "session_id": SID}) in sweep(client, utcnow())
    published = []
    assert restorer(client, published=published).restore(WS, SID) == "restored"
    assert client.get_prompt(first.prompt_id).status == "completed"
    assert PROMPT_TASK in published
    assert dispatch_next(client.engine, client.runtime, WS, SID) == "dispatched"
    assert client.get_prompt(second.prompt_id).status == "dispatched"


def test_a_prompt_whose_reports_were_lost_and_that_still_runs_is_recorded(client, sim_control):
    """The same, but the host still runs the prompt's turn: it is recorded from the host's
    answer (its end is then the stale turns' business), and the prompt goes on running."""
    first, _second = _prompt_sent_long_ago_unreported(client, sim_control)
    assert (RESTORE_TASK, {"workspace_id": WS, "session_id": SID}) in sweep(client, utcnow())
    assert restorer(client).restore(WS, SID) == "restored"
    assert client.get_prompt(first.prompt_id).status == "dispatched"
    turn = turn_row(client, client.get_prompt(first.prompt_id).turn_id)
    assert (turn.phase, turn.prompt_id) == ("running", first.prompt_id)
    assert session_row(client).active_turn_id == turn.turn_id


def test_a_prompt_s_turn_settled_by_a_report_that_does_not_name_it_ends_the_prompt(
    client, sim_control
):
    """The prompt's turn was reported running with its prompt, and settled by a report that
    does not name the prompt again (the protocol does not ask it to): the prompt of the turn
    on record ends, and the queue moves on. Before, the report's own prompt_id was read; the
    prompt stayed dispatched for good, and nothing asked the host (found by a review)."""
    from agent_radar.workflows.steps.prompt_dispatch import dispatch_next

    first, second = first_of_two_prompts_sent(client, sim_control, WS, SID)
    turn_id = client.get_prompt(first.prompt_id).turn_id
    epoch = sim_control.session(WS, SID)["runtime_epoch"]
    running = {"turn_id": turn_id, "phase": "running", "origin": "user_prompt"}
    report(client, session={"runtime_epoch": epoch}, turn={**running, "prompt_id": first.prompt_id})
    sim_control.session(WS, SID, settle_turn=turn_id)
    settled = {**running, "phase": "settled", "outcome": "completed"}
    report(client, session={"runtime_epoch": epoch}, turn=settled)
    assert turn_row(client, turn_id).phase == "settled"
    assert client.get_prompt(first.prompt_id).status == "completed"
    assert dispatch_next(client.engine, client.runtime, WS, SID) == "dispatched"
    assert client.get_prompt(second.prompt_id).status == "dispatched"
    # At the host: each prompt delivered once.
    assert [e["text"] for e in sim_control.effects("prompt")] == ["first", "second"]

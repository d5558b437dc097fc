"""A run's stop owed to a host is delivered only once the run has stopped there, and a move
back to that host waits for it. While the host says the run still runs, the stop waits
without spending its budget (the host's run, not a fault of ours): however long the agent
takes to wind down, or however often the user retries the move back, the move is refused
(session_busy, naming the stop) and never lands beside the run. Found by a review; counted
at the simulator host, on both backends."""

from datetime import timedelta

from tests.helpers import cancel_runner, maintenance_executor

WS, SID = "ws-review3", "s1"


def run_at_a_then_moved_to_b(client, sim_control, sim_b):
    """Run R at host A whose agent ignores cancels (an hour long); the session moves to B:
    R ends `interrupted` here and its stop is owed to A. Returns R and the stop's id."""
    from agent_radar.workflows import ids

    client.add_host("host-b", sim_b.url)
    client.ensure_session(WS, SID)
    sim_control.session(
        WS, SID, maintenance_duration_ms=3_600_000, ignore_cancel=True, continuation_turns=0
    )
    run = client.start_maintenance(WS, SID, client_submit_id="m1")
    assert maintenance_executor(client, max_wait_s=0.3).execute(run.run_id) == "handed_back"
    client.ensure_session(WS, SID, host_id="host-b")
    assert client.get_maintenance(run.run_id).status == "interrupted"
    return run, ids.run_stop_id(WS, SID, run.run_id)


def goal_after_move_back(client, sim_control):
    """The user's next goal at A, dispatched once: its outcomes and the host's effects."""
    from agent_radar.workflows.steps.goals.dispatch import Dispatcher

    op = client.set_goal(WS, SID, "after the move back", client_submit_id="g1")
    d = Dispatcher(client.engine, client.runtime, worker_id="d", lease_s=5)
    outcomes = [r.outcome for r in d.dispatch(op.operation_id)]
    kinds = [e["kind"] for e in sim_control.effects(kind=None) if e["session_id"] == SID]
    return outcomes, kinds


def test_a_move_back_waits_for_the_run_stopping_there_and_the_goal_after_it_applies(
    client, sim_control, sim_b
):
    """Run R runs at host A; the session moves to B (R ends `interrupted`, its stop owed to
    A). A takes the stop (200) but its agent is slow to end R. The stop is delivered only
    once R has stopped there: until then it is owed, and a move back to A is refused
    (session_busy, naming it) — before, it was let through with R running, and a goal set
    then was refused `busy` until its budget ended it `failed`. Once R has stopped, the move
    back goes and the goal applies, after R, never beside it."""
    import pytest

    from agent_radar.workflows.errors import SessionBusy
    from tests.helpers import eventually

    run, stop_id = run_at_a_then_moved_to_b(client, sim_control, sim_b)
    runner = cancel_runner(client)
    assert runner.apply(stop_id) == "waiting"  # A took it; R still stopping there
    with pytest.raises(SessionBusy) as busy:
        client.ensure_session(WS, SID, host_id="default")
    assert busy.value.operation_id == stop_id
    sim_control.session(WS, SID, finish_run=run.run_id)  # R stops at A
    eventually(lambda: not sim_control.session(WS, SID)["runs"][run.run_id]["running"])
    assert runner.apply(stop_id) == "settled"
    client.ensure_session(WS, SID, host_id="default")  # back to A
    outcomes, kinds = goal_after_move_back(client, sim_control)
    assert outcomes == ["applied"]
    assert kinds.index("goal") > kinds.index("maintenance")


def test_a_stop_waits_for_a_run_slow_to_stop_and_status_names_it(client, sim_control, sim_b):
    """The stop owed to A is tried again as the sweeper does, over 11 minutes (past a
    budget's age, MAX_FAILING_S), while R still runs at A. It waits, spending nothing, and
    stays owed: the move back to A is refused, not let through beside R (before, the stop
    ended `failed` and nothing was owed any more)."""
    from agent_radar.models.base import utcnow
    from agent_radar.workflows.errors import SessionBusy
    from agent_radar.workflows.tools.status import fleet_status, problems

    run, stop_id = run_at_a_then_moved_to_b(client, sim_control, sim_b)
    start = utcnow()
    outcomes = []
    for minutes in (0, 1, 3, 6, 9, 11):  # the sweeper's retries, with backoff, over 11 minutes
        at = start + timedelta(minutes=minutes)
        runner = cancel_runner(client, clock=lambda at=at: at)
        outcomes.append(runner.apply(stop_id))
    assert sim_control.session(WS, SID)["runs"][run.run_id]["running"]
    found = [
        p
        for p in problems(fleet_status(client.engine, start + timedelta(minutes=11)), 2.0)
        if "sweeper" not in p
    ]
    # ... and `status --check` names it (a run that ignores its stop for 10 minutes).
    assert found == ["1 maintenance run(s) still running at a host asked to stop them"], found
    moved_back = None
    try:
        client.ensure_session(WS, SID, host_id="default")
        moved_back = "let through"
    except SessionBusy as exc:
        moved_back = f"refused ({exc.operation_id})"
    still_running = sim_control.session(WS, SID)["runs"][run.run_id]["running"]
    let_through = moved_back == "let through"
    outcomes_g, kinds = goal_after_move_back(client, sim_control) if let_through else ([], [])
    assert not (let_through and still_running), (
        f"the stop's attempts {outcomes}: it ended {client_cancel_status(client, stop_id)}; "
        f"the move back to A was {moved_back} while run {run.run_id} still runs there; the "
        f"goal after it: {outcomes_g} (host effects {kinds}); status --check problems: {found}"
    )


def test_retrying_the_refused_move_back_spends_nothing_and_never_meets_the_run(
    client, sim_control, sim_b
):
    """The move back to A is refused `session_busy` while the stop of R is owed ("try again
    once it is"). The user retries, as told, 30 times in a second: each ensure_session
    delivers the stops owed first (client._deliver_stops_owed), and each finds R running and
    waits, spending nothing (before, 24 tries spent the stop's budget and the 25th moved the
    session back onto R)."""
    from agent_radar.workflows.errors import SessionBusy

    run, stop_id = run_at_a_then_moved_to_b(client, sim_control, sim_b)
    tries, moved = 0, False
    while not moved and tries < 30:
        tries += 1
        try:
            client.ensure_session(WS, SID, host_id="default")
            moved = True
        except SessionBusy:
            pass
    still_running = sim_control.session(WS, SID)["runs"][run.run_id]["running"]
    outcomes, kinds = goal_after_move_back(client, sim_control) if moved else ([], [])
    assert not (moved and still_running), (
        f"try {tries} of the move back to A went through while run {run.run_id} still runs "
        f"there (the stop {client_cancel_status(client, stop_id)}); the goal after it: "
        f"{outcomes}, host effects {kinds}"
    )


def client_cancel_status(client, operation_id):
    from agent_radar.models.db import run_read
    from agent_radar.models.operations import CancelOperation

    def read(s):
        c = s.get(CancelOperation, operation_id)
        return None if c is None else (c.status, c.attempt, c.last_error)

    return run_read(client.engine, read)


def test_retrying_the_move_back_spends_nothing_of_a_stop_in_its_backoff(client, sim_control, sim_b):
    """A refuses R's stop (503) for now: the stop is owed, due again after its backoff. The
    user retries the move back to A, as the refusal says, 30 times in a second. Each is
    refused (session_busy, naming the stop) and none delivers the stop before it is due:
    its budget is untouched by the retries (found by a review: each retry was an attempt)."""
    import pytest

    from agent_radar.workflows.errors import SessionBusy

    run, stop_id = run_at_a_then_moved_to_b(client, sim_control, sim_b)
    sim_control.fault(f"maintenance/{run.run_id}/cancel", status=503, count=100)
    assert cancel_runner(client).apply(stop_id) == "retry"
    for _ in range(30):
        with pytest.raises(SessionBusy) as busy:
            client.ensure_session(WS, SID, host_id="default")
        assert busy.value.operation_id == stop_id
    (status, attempt, _error) = client_cancel_status(client, stop_id)
    assert status in ("prepared", "leased") and attempt == 1  # open, its one attempt
    cancels_at_a = [c for c in sim_control.calls() if c["call"].endswith("/cancel")]
    assert len(cancels_at_a) == 1

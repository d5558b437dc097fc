"""A prompt or a goal that a host refuses `busy` (docs/protocol.md: one thing at a time) waits
at no cost only for what the record shows: a turn or a run the host runs that the mirror
cannot record spends the prompt's budget and ends it `failed`, in sight, instead of holding
the queue for good. Found by a review; counted at the simulator host, on both backends."""

import time
from datetime import timedelta

from tests.helpers import first_of_two_prompts_sent, maintenance_executor

WS, SID = "ws-review2", "s1"


def report(client, **parts):
    client.report_activity(
        {"workspace_id": WS, "session_id": SID, "occurred_at_ms": int(time.time() * 1000), **parts}
    )


def busy_for_a_day(client, prompt_id):
    """The sweeper pushes the queued prompt again and again over a day (its republish), and
    each send is refused busy. What the prompt and `status --check` say then."""
    from agent_radar.models.base import utcnow
    from agent_radar.workflows.steps.prompt_dispatch import dispatch_next
    from agent_radar.workflows.tools.status import fleet_status, problems

    start = utcnow()
    answers = set()
    for hour in range(1, 25):
        at = start + timedelta(hours=hour)
        answers.add(dispatch_next(client.engine, client.runtime, WS, SID, clock=lambda at=at: at))
    prompt = client.get_prompt(prompt_id)
    found = problems(fleet_status(client.engine, start + timedelta(hours=24)), 2.0)
    found = [p for p in found if "sweeper" not in p]  # no beat runs in these tests
    return answers, prompt, found


def test_a_turn_the_mirror_holds_settled_holds_the_queue_forever_and_unseen(client, sim_control):
    """A report says p1's turn T1 settled while it still runs at the host (forged, a buggy
    host's, reordered: ea55b77's own case). p2 is refused `busy`; the host is asked and lists
    T1, so p2 is held at no cost (b4500ed). But the mirror cannot learn T1: it has T1's row,
    settled, and apply_state records only turns it never saw. So nothing on record runs: no
    active turn to wait on or cancel, no stale turn for the reconcile sweep or the `wedged`
    check. T1 never ends at the host (a stuck agent): p2 is sent and refused every sweep for
    a day, costs no budget, never fails, and `status --check` finds nothing. docs/lifecycles.md
    says the mirror learns what the host runs and the queue waits for its end."""
    first, second = first_of_two_prompts_sent(client, sim_control, WS, SID)
    t1 = client.get_prompt(first.prompt_id).turn_id
    settled = {"phase": "settled", "outcome": "completed", "origin": "user_prompt"}
    report(client, turn={"turn_id": t1, "prompt_id": first.prompt_id, **settled})
    answers, prompt, found = busy_for_a_day(client, second.prompt_id)
    assert sim_control.session(WS, SID)["turns"][t1]["phase"] == "running"
    assert "retry: busy" in answers and prompt.status == "failed"
    learnt = client.session_info(WS, SID).active_turn_id
    assert prompt.status == "failed" or found or learnt is not None, (
        f"p2 refused busy all day ({prompt.status}, attempt {prompt.attempt}, "
        f"last_error {prompt.last_error!r}); the mirror's active turn {learnt!r} although the "
        f"host runs {t1}; status --check problems: {found}"
    )


def test_a_run_the_host_still_runs_after_an_operator_resolved_it_holds_the_queue_unseen(
    client, sim_control
):
    """A run whose agent does not stop when cancelled (AgentRadarRunsInRecovery: cancel_timeout)
    is resolved `failed` by an operator, as the runbook says; the session is released. The
    run still runs at the host. The next prompt is refused `busy`; the host lists the run, so
    the prompt is held at no cost. But reconcile never records a run the host lists
    (apply_state ignores `maintenance`): nothing on record holds the session, nothing ends the
    hold, and nothing signals it. A day later the prompt is still queued, attempt 0, and
    `status --check` is clean."""
    from sqlalchemy import update

    from agent_radar.models.db import run_transaction
    from agent_radar.models.operations import MaintenanceRun

    client.ensure_session(WS, SID)
    sim_control.session(WS, SID, maintenance_duration_ms=3_600_000, ignore_cancel=True)
    run = client.start_maintenance(WS, SID, client_submit_id="m1")
    assert maintenance_executor(client, max_wait_s=0.3).execute(run.run_id) == "handed_back"
    client.cancel_maintenance(run.run_id)
    assert maintenance_executor(client, max_wait_s=0.3).execute(run.run_id) == "handed_back"
    run_transaction(  # its cancel grace passed (the sweeper's cancel_timeout)
        client.engine,
        lambda s: s.execute(
            update(MaintenanceRun)
            .where(MaintenanceRun.run_id == run.run_id)
            .values(
                status="recovery_required",
                error_code="cancel_timeout",
                lease_owner=None,
                lease_token=None,
                lease_expires_at=None,
            )
        ),
    )
    client.resolve_maintenance(run.run_id, to="failed", reason="the agent looked stuck")
    assert sim_control.session(WS, SID)["runs"][run.run_id]["running"]
    prompt = client.submit_prompt(WS, SID, "after the run", client_submit_id="p1")
    answers, prompt, found = busy_for_a_day(client, prompt.prompt_id)
    assert "retry: busy" in answers and prompt.status == "failed"
    assert sim_control.session(WS, SID)["runs"][run.run_id]["running"]
    assert prompt.status == "failed" or found, (
        f"the prompt refused busy all day ({prompt.status}, attempt {prompt.attempt}, "
        f"last_error {prompt.last_error!r}) behind run {run.run_id}, which the record has "
        f"{client.get_maintenance(run.run_id).status}; status --check problems: {found}"
    )


def test_a_turn_reported_submitted_holds_the_prompt_at_no_cost(client, sim_control):
    """A host reports its own turn's start as `submitted` (docs/protocol.md allows it; its next
    report is the end). The record has the turn unsettled, though not as the session's
    active turn. The next prompt, refused `busy`, waits at no cost for it (found by a review:
    it spent its budget and failed in 10 minutes while the turn ran as reported), and goes
    once the turn's end is reported."""
    from agent_radar.models.base import utcnow
    from agent_radar.workflows.steps.prompt_dispatch import dispatch_next

    client.ensure_session(WS, SID)
    sim_control.session(WS, SID, turn={"turn_id": "t-host", "origin": "provider_initiated"})
    turn = {"turn_id": "t-host", "origin": "provider_initiated"}
    report(client, turn={**turn, "phase": "submitted"})
    prompt = client.submit_prompt(WS, SID, "after T", client_submit_id="p1")
    start = utcnow()
    for minute in range(0, 13):  # the sweeper's pushes of the queued prompt, 12 minutes
        at = start + timedelta(minutes=minute)
        dispatch_next(client.engine, client.runtime, WS, SID, clock=lambda at=at: at)
    waiting = client.get_prompt(prompt.prompt_id)
    assert (waiting.status, waiting.attempt) == ("queued", 0), waiting.last_error
    sim_control.session(WS, SID, settle_turn="t-host")
    report(client, turn={**turn, "phase": "settled", "outcome": "completed"})
    later = start + timedelta(minutes=13)
    assert dispatch_next(client.engine, client.runtime, WS, SID, clock=lambda: later) == (
        "dispatched"
    )
    assert [e["prompt_id"] for e in sim_control.effects("prompt")] == [prompt.prompt_id]


def test_the_queue_s_wake_from_a_busy_answer_comes_once_the_prompt_is_back(client, sim_control):
    """The host refuses the prompt `busy`, and the look that follows finds the turn on record
    already ended there: the mirror ends it, which wakes the session's queue. That wake went
    out while the prompt was still out, so it found nothing to send and was lost until the
    sweeper's next push. It now goes once the prompt is back in the queue, and sends it."""
    from agent_radar.workflows.steps.prompt_dispatch import dispatch_next
    from agent_radar.workflows.task_names import PROMPT_TASK

    client.ensure_session(WS, SID)
    sim_control.session(WS, SID, turn={"turn_id": "t-host", "origin": "provider_initiated"})
    # Reported `submitted`: unsettled on record, though not the session's active turn.
    report(client, turn={"turn_id": "t-host", "origin": "provider_initiated", "phase": "submitted"})
    prompt = client.submit_prompt(WS, SID, "after T", client_submit_id="p1")
    sim_control.session(WS, SID, settle_turn="t-host")  # its end's report is lost
    sim_control.fault("prompts", status=409, error="busy", count=1, session_id=SID)
    woken = []

    def publish(task, kwargs):
        if task == PROMPT_TASK:
            woken.append(client.get_prompt(prompt.prompt_id).status)
        return True

    assert dispatch_next(client.engine, client.runtime, WS, SID, publish=publish) == "retry: busy"
    assert woken == ["queued"]
    assert dispatch_next(client.engine, client.runtime, WS, SID, publish=publish) == "dispatched"
    assert [e["prompt_id"] for e in sim_control.effects("prompt")] == [prompt.prompt_id]


def test_a_host_that_lists_a_new_turn_at_each_look_makes_no_loop(client, host):
    """A hostile (or buggy) host refuses every prompt `busy` and, each time it is asked what
    it runs, lists a new `submitted` turn in place of the one it listed before. Each look
    ends the turn on record it no longer lists (which wakes the queue) and records the new
    one, so the prompt is held at no cost. The wake is dropped while the prompt is held: the
    held-for turn's end wakes the queue. Found by a review: each wake sent the prompt into
    `busy` again at once, a loop with no budget spent and no backoff."""
    import json

    from agent_radar.workflows.adapters.http_runtime import HttpRuntime
    from agent_radar.workflows.steps.prompt_dispatch import dispatch_next
    from agent_radar.workflows.task_names import PROMPT_TASK

    sends, looks = [], []

    def busy(body):
        sends.append(body.get("prompt_id"))
        return 409, b'{"error": "busy", "detail": "a turn runs"}'

    def state(_body):
        looks.append(1)
        turn = {
            "turn_id": f"t-{len(looks)}",
            "phase": "submitted",
            "runtime_epoch": 1,
            "origin": "provider_initiated",
        }
        answer = {"live": True, "runtime_epoch": 1, "goal": None, "fences": [], "turns": [turn]}
        return 200, json.dumps(answer).encode()

    host.answers[(SID, "prompts")] = busy
    host.answers[(SID, "state")] = state
    host.answers[SID] = (200, b'{"live": true, "runtime_epoch": 1}')
    runtime = HttpRuntime(host.url)
    prompt = client.submit_prompt(WS, SID, "hello", client_submit_id="p1")
    queue = [PROMPT_TASK]

    def publish(task, kwargs):
        if task == PROMPT_TASK:
            queue.append(task)
        return True

    runs = 0
    while queue and runs < 30:  # the broker: each wake runs the dispatch task again
        queue.pop()
        runs += 1
        dispatch_next(client.engine, runtime, WS, SID, publish=publish)
    row = client.get_prompt(prompt.prompt_id)
    assert (row.status, row.attempt) == ("queued", 0)
    assert len(sends) <= 2, f"{len(sends)} sends refused busy in a row, each woken at once"

"""Maintenance runs end to end with real worker and beat processes, on both backends."""

from agent_radar.models.db import run_transaction
from agent_radar.models.tables import AgentSession
from tests.helpers import eventually
from tests.rules.test_maintenance import statuses

WS, SID = "ws-maint", "s1"


def test_an_agent_that_ignores_the_cancel(client, stack, sim_control):
    stack.start_worker()
    stack.start_beat()
    sim_control.session(WS, SID, maintenance_duration_ms=4000, ignore_cancel=True)
    run = client.start_maintenance(WS, SID, client_submit_id="m1")
    eventually(lambda: client.get_maintenance(run.run_id).lease_token, what="the run to start")
    client.cancel_maintenance(run.run_id)
    prompts = [
        client.submit_prompt(WS, SID, f"prompt {i}", client_submit_id=f"p{i}") for i in range(3)
    ]
    stuck = eventually(
        lambda: (lambda r: r.status == "recovery_required" and r)(
            client.get_maintenance(run.run_id)
        ),
        what="the cancel grace to pass",
    )
    assert stuck.error_code == "cancel_timeout"
    assert all(client.get_prompt(p.prompt_id).status == "queued" for p in prompts)
    done = client.wait(run, timeout=30)
    assert done.status == "completed"  # the work finished applied: a late cancel loses
    for p in prompts:
        eventually(
            lambda p=p: client.get_prompt(p.prompt_id).status == "completed",
            what=f"{p.text} to complete",
        )
    sent = [e["text"] for e in sim_control.effects("prompt")]
    assert sent == ["prompt 0", "prompt 1", "prompt 2"]
    session = run_transaction(client.engine, lambda s: s.get(AgentSession, (WS, SID)))
    assert session.active_turn_id is None
    assert [s for _, s in statuses(client, run.run_id)] == [
        "running",
        "cancelling",
        "recovery_required",
        "finalizing",
        "completed",
    ]


def test_worker_killed_mid_run_is_recovered_from_the_agents_answer(client, stack, sim_control):
    victim = stack.start_worker(concurrency=1)
    stack.start_beat()
    sim_control.session(WS, SID, maintenance_duration_ms=3000)
    run = client.start_maintenance(WS, SID, client_submit_id="m1")
    # Killed once the host runs the work (killed before, the host has no such run, and
    # recovery ends it interrupted: docs/lifecycles.md: maintenance).
    eventually(lambda: sim_control.calls("maintenance"), what="the run to start at the host")
    victim.kill()
    stack.start_worker(concurrency=1)
    done = client.wait(run, timeout=60)
    assert done.status == "completed", (done.error_code, done.detail)
    history = [s for _, s in statuses(client, run.run_id)]
    assert history[:2] == ["running", "recovery_required"] and history[-1] == "completed"
    rows = [r for r in client.history(WS, SID) if r.record_id == f"maintenance:{run.run_id}"]
    assert len(rows) == 1 and rows[0].revision == len(history)
    assert len(sim_control.effects("maintenance")) == 1


def test_a_stopping_worker_hands_a_long_run_back(client, stack, sim_control):
    """SIGTERM (a rollout) while a worker waits on a long run: the worker is gone at once,
    not when the run ends, and another worker re-attaches — no recovery, one run at the
    host."""
    import signal
    import subprocess

    first = stack.start_worker(concurrency=1)
    stack.start_beat()
    sim_control.session(WS, SID, maintenance_duration_ms=15_000)
    run = client.start_maintenance(WS, SID, client_submit_id="m1")
    eventually(lambda: sim_control.calls("maintenance"), what="the run to start at the host")
    first.popen.send_signal(signal.SIGTERM)
    try:
        first.popen.wait(9)  # without the hand-back it waits for the whole run (15 s)
    except subprocess.TimeoutExpired:
        raise AssertionError("the stopping worker held its shutdown for the run") from None
    assert client.get_maintenance(run.run_id).status == "running"
    # The worker left with the run still going at the host. The run ends there now, as it
    # would have at 15 s: the worker that re-attaches need not wait the rest of it out.
    sim_control.session(WS, SID, finish_run=run.run_id)
    stack.start_worker(concurrency=1)
    done = client.wait(run, timeout=60)
    assert done.status == "completed", (done.error_code, done.detail)
    assert [s for _, s in statuses(client, run.run_id)] == ["running", "finalizing", "completed"]
    assert len(sim_control.effects("maintenance")) == 1  # the start is idempotent by run_id

"""A maintenance start still on the wire when the control plane ends its run another way than
recovery — a restart at the host, a move away and back — never lands: the run's durable stop
has the host refuse it (docs/protocol.md: a run cancelled before it came). Found by a review;
counted at the host, on both backends."""

import threading
import time

from agent_radar.workflows import ids
from tests.helpers import cancel_runner, eventually, maintenance_executor, restorer

WS, SID = "ws-late", "s1"


def effects_at_host(sim_control, sid=SID):
    return [
        e
        for e in sim_control.effects(kind=None)
        if e["session_id"] == sid and e["kind"] in ("goal", "prompt", "maintenance")
    ]


def start_on_the_wire(client, sim_control):
    """A run admitted and its executor's start call held at the host (slow to reach it)."""
    run = client.start_maintenance(WS, SID, client_submit_id="m1")
    sim_control.hold("maintenance")  # the start call (not the status call)
    first = maintenance_executor(client, max_wait_s=0.5)
    result: dict = {}
    worker = threading.Thread(target=lambda: result.setdefault("r", first.execute(run.run_id)))
    worker.start()
    eventually(lambda: sim_control.holding() >= 1, what="the start call on its way")
    return run, worker, result


def let_the_start_land(sim_control):
    sim_control.hold("maintenance", hold=False)
    eventually(lambda: sim_control.holding() == 0, what="the start to be let go")
    eventually(
        lambda: len([c for c in sim_control.calls() if c["call"] == "maintenance"]) == 1,
        what="the start to reach the host",
    )
    time.sleep(0.3)  # the host answers it (to nobody)


def the_start_lands_and_never_runs(client, sim_control, run, note: str = "") -> None:
    """The held start reaches the host; then the next prompt: only the prompt runs there."""
    from agent_radar.workflows.steps.prompt_dispatch import dispatch_next

    let_the_start_land(sim_control)
    at_host = sim_control.session(WS, SID)["runs"].get(run.run_id, {})
    prompt = client.submit_prompt(WS, SID, "after the run", client_submit_id="p1")
    sent = dispatch_next(client.engine, client.runtime, WS, SID)
    assert [e["kind"] for e in effects_at_host(sim_control)] == ["prompt"], (
        f"run {run.run_id} (on record {client.get_maintenance(run.run_id).status}) started at "
        f"the host after it ended here: at the host {at_host}; {note}; the next prompt's "
        f"dispatch: {sent!r}, prompt {client.get_prompt(prompt.prompt_id).status}"
    )


def test_a_start_on_the_wire_across_a_restart_never_lands(client, sim_control):
    """The run's start is on its way to the host; the session's process restarts there (a new
    epoch: a per-session restart, the host's server stays up). The control plane sees the new
    epoch, ends the run `interrupted` (runtime_restarted), releases the session and owes the
    host the run's stop, which it delivers: the host does not know the run, and refuses its
    start from then on. The executor's call times out (it stops nothing). Then the start
    lands: refused. The next prompt goes."""
    from agent_radar.workflows import ids

    client.ensure_session(WS, SID)
    sim_control.session(WS, SID, maintenance_duration_ms=60_000, turn_duration_ms=0)
    run, worker, result = start_on_the_wire(client, sim_control)
    sim_control.session(WS, SID, restart=True)  # the session's process is new: epoch 2
    restorer(client).cancels.require_live(WS, SID)  # the control plane sees it
    ended = client.get_maintenance(run.run_id)
    assert (ended.status, ended.error_code) == ("interrupted", "runtime_restarted")
    runner = cancel_runner(client)
    assert runner.apply(ids.run_stop_id(WS, SID, run.run_id)) == "settled"  # as published
    assert sim_control.session(WS, SID)["runs"][run.run_id]["state"] == "refused"
    worker.join(15)  # its call timed out: it lets go, and stops nothing
    assert result["r"] == "runtime_unavailable"
    the_start_lands_and_never_runs(client, sim_control, run)


def test_a_start_on_the_wire_to_a_host_the_session_left_and_came_back_to_never_lands(
    client, sim_control, sim_b
):
    """The run's start is on its way to host A; the session moves to B (the run ends
    `interrupted`, a stop is owed to A). A's session is offline: the stop waits. The session
    moves back to A (let through: the stop found it offline, and the move resumes it, a new
    epoch). The stop owed to A then finds a newer epoch there; a turn's stop would end without
    a call (what has its id now is another turn), a run's goes all the same, and A refuses
    the run's start from then on. The start lands at A: refused. The next prompt goes."""
    from agent_radar.workflows import ids

    client.add_host("host-b", sim_b.url)
    client.ensure_session(WS, SID)
    sim_control.session(WS, SID, maintenance_duration_ms=60_000, turn_duration_ms=0)
    run, worker, result = start_on_the_wire(client, sim_control)
    client.ensure_session(WS, SID, host_id="host-b")  # the move: A owes a stop
    assert client.get_maintenance(run.run_id).status == "interrupted"
    sim_control.session(WS, SID, live=False)  # A's session went offline
    runner = cancel_runner(client)
    stop_id = ids.run_stop_id(WS, SID, run.run_id)
    assert runner.apply(stop_id) == "waiting_offline"
    worker.join(15)  # its call timed out: it lets go, and stops nothing
    assert result["r"] == "runtime_unavailable"
    client.ensure_session(WS, SID, host_id="default")  # back to A: resumed, a new epoch
    stop = runner.apply(stop_id)  # a newer epoch at A: a run's stop goes all the same
    cancels_at_a = len([c for c in sim_control.calls() if c["call"].endswith("/cancel")])
    the_start_lands_and_never_runs(
        client, sim_control, run, f"the stop owed to A: {stop!r}, cancels A got {cancels_at_a}"
    )


def test_a_start_on_the_wire_when_another_worker_ends_the_run_busy_never_lands(client, sim_control):
    """The first executor's start is on its way; its call times out and it lets the run go
    (still `running`, no lease). A second executor asks the host first: a turn runs there, so
    the run ends `failed` (session_busy) — and its stop goes to the host, which does not know
    the run and refuses its start from then on. The turn ends; then the first start lands:
    refused. Found by a review: before, nothing told the host, and the run started there
    under a record that says it failed."""
    client.ensure_session(WS, SID)
    sim_control.session(WS, SID, maintenance_duration_ms=60_000, turn_duration_ms=0)
    run, worker, result = start_on_the_wire(client, sim_control)
    worker.join(15)  # its call timed out: it lets go
    assert result["r"] == "runtime_unavailable"
    sim_control.session(WS, SID, turn={"turn_id": "meanwhile"})
    published: list = []
    assert maintenance_executor(client, published).execute(run.run_id) == "failed"
    ended = client.get_maintenance(run.run_id)
    assert (ended.status, ended.error_code) == ("failed", "session_busy")
    stop_id = ids.run_stop_id(WS, SID, run.run_id)
    assert ("agent_radar.cancel.apply", {"operation_id": stop_id}) in published
    assert cancel_runner(client).apply(stop_id) == "settled"
    assert sim_control.session(WS, SID)["runs"][run.run_id]["state"] == "refused"
    sim_control.session(WS, SID, settle_turn="meanwhile")
    eventually(
        lambda: sim_control.session(WS, SID)["turns"]["meanwhile"]["phase"] == "settled",
        what="the turn to end",
    )
    let_the_start_land(sim_control)
    assert not [e for e in effects_at_host(sim_control) if e["kind"] == "maintenance"]
    assert sim_control.session(WS, SID)["runs"][run.run_id]["state"] == "refused"

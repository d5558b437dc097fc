"""The demo's scripted steps (`agent-radar demo`), each against the running stack: goals and
their replay, an outage and a crash, fences, host restarts and moves, maintenance and prompts."""

from ..client import AgentRadar
from ..errors import GoalGenerationSuperseded
from .simulator import SimControl
from .stack import Stack, free_port, wait_for

WS = "acme"


def goals_and_replay(client: AgentRadar, say) -> bool:
    # 1. set a goal, and submit it again with the same client submit ID
    op = client.set_goal(WS, "session-a", "refactor the billing module", client_submit_id="req-1")
    say("goal set submitted", operation=op.operation_id, revision=op.goal_revision)
    op = client.wait(op)
    say("goal applied by the agent", status=op.status, phase=op.provider_phase)
    again = client.set_goal(
        WS, "session-a", "refactor the billing module", client_submit_id="req-1"
    )
    say(
        "same submit ID sent again: the same operation comes back",
        same_operation=again.operation_id == op.operation_id,
        status=again.status,
    )

    # 2. clear it; then an expected-revision conflict
    cleared = client.wait(client.clear_goal(WS, "session-a", client_submit_id="req-2"))
    state = client.goal_state(WS, "session-a")
    say(
        "goal cleared",
        status=cleared.status,
        revision=state.revision,
        tombstoned=state.tombstoned,
        sync=state.sync_status,
    )
    try:
        client.set_goal(
            WS, "session-a", "stale writer", client_submit_id="req-3", expected_revision=1
        )
        say("expected-revision check did not fire")
        return False
    except GoalGenerationSuperseded as exc:
        say(
            "stale expected revision refused, nothing written",
            error=exc.code,
            current_revision=exc.current_revision,
        )
    return True


def outage_and_crash(client: AgentRadar, sim: SimControl, stack: Stack, worker, say) -> bool:
    # 3. the agent host fails three calls in a row: backoff retries until it applies
    sim.fault("goal", status=503, count=3, session_id="session-b")
    say("agent outage begins (next 3 goal calls answer 503)")
    op = client.set_goal(WS, "session-b", "triage the incident queue", client_submit_id="req-4")
    op = client.wait(op, timeout=60)
    say("applied after the outage", status=op.status, attempts=op.attempt)

    # 4. a worker is SIGKILLed while its agent call is in flight; the sweeper finishes
    sim.latency("goal", 1500)
    op = client.set_goal(WS, "session-c", "write release notes", client_submit_id="req-5")
    wait_for(
        lambda: client.get_goal_operation(op.operation_id).lease_token, 30, "the dispatch to start"
    )
    say("dispatch in flight; killing the worker with SIGKILL", pid=worker.pid)
    worker.kill()
    sim.latency("goal", 0)
    stack.start_worker(concurrency=2, name="worker-2")
    say("a new worker started; waiting for the sweeper to notice the expired lease")
    op = client.wait(op, timeout=90)
    say("finished after the crash", status=op.status, attempts=op.attempt)
    return op.status == "completed"


def shared_goal_fences(client: AgentRadar, say) -> bool:
    # 5. fences: a shared goal revoked next to a newer owner goal, and a current one
    shared = client.wait(
        client.set_goal(WS, "session-d", "follow the shared runbook", client_submit_id="binding-7")
    )
    client.wait(client.set_goal(WS, "session-d", "owner's own plan", client_submit_id="req-6"))
    fence = client.fence_goal_generation(
        WS,
        "session-d",
        shared.operation_id,
        client_submit_id="revoke-binding-7",
        reason="shared binding revoked",
    )
    say(
        "shared goal fenced after the owner set a newer one",
        intent_accepted=fence.intent_accepted,
        clear=fence.clear_operation_id is not None,
    )
    fence = client.wait(fence)
    state = client.goal_state(WS, "session-d")
    say(
        "fence delivered; the owner's goal is untouched",
        fence=fence.status,
        revision=state.revision,
        desired=state.desired["objective"],
    )
    shared = client.wait(
        client.set_goal(WS, "session-e", "follow the shared runbook", client_submit_id="binding-8")
    )
    fence = client.wait(
        client.fence_goal_generation(
            WS, "session-e", shared.operation_id, client_submit_id="revoke-binding-8"
        )
    )
    state = client.goal_state(WS, "session-e")
    say(
        "a current shared goal fenced: cleared at the agent",
        fence=fence.status,
        revision=state.revision,
        tombstoned=state.tombstoned,
        sync=state.sync_status,
    )
    return fence.status == "completed"


def offline_fence(client: AgentRadar, sim: SimControl, say) -> bool:
    # 6. a fence against an offline session completes without resuming it
    offline = client.wait(
        client.set_goal(WS, "session-f", "nightly triage", client_submit_id="binding-9")
    )
    sim.session(WS, "session-f", live=False)
    say("session-f's agent host goes offline")
    fence = client.wait(
        client.fence_goal_generation(
            WS, "session-f", offline.operation_id, client_submit_id="revoke-binding-9"
        )
    )
    clear = client.get_goal_operation(fence.clear_operation_id)
    resumes = [c for c in sim.calls("resume") if c["session_id"] == "session-f"]
    say(
        "fence completed locally, no resume",
        fence=fence.status,
        clear_phase=clear.provider_phase,
        sync=client.goal_state(WS, "session-f").sync_status,
        resumes=len(resumes),
    )
    info = client.ensure_session(WS, "session-f")
    clear = client.get_goal_operation(fence.clear_operation_id)
    say(
        "the user brings session-f back: resumed with the fence preloaded, the clear delivered",
        live=info.live,
        epoch=info.runtime_epoch,
        clear_phase=clear.provider_phase,
        sync=client.goal_state(WS, "session-f").sync_status,
    )
    return not resumes and clear.provider_phase == "applied"


def _shared_goal_revoked(client: AgentRadar, sid: str, tag: str, owner_plan: str | None = None):
    """A shared goal applied, the owner's own plan after it (if any), then the shared
    goal's fence delivered; returns the shared goal's operation."""
    shared = client.wait(
        client.set_goal(WS, sid, "follow the shared runbook", client_submit_id=f"binding-{tag}")
    )
    if owner_plan is not None:
        client.wait(client.set_goal(WS, sid, owner_plan, client_submit_id=f"req-{tag}"))
    client.wait(
        client.fence_goal_generation(
            WS, sid, shared.operation_id, client_submit_id=f"revoke-binding-{tag}"
        )
    )
    return shared


def host_restart(client: AgentRadar, sim: SimControl, say) -> bool:
    # 7. the agent host restarts: the turn it ran ends interrupted, and the session's fences
    #    go back to it before anything else does
    sid = "session-r"
    sim.session(WS, sid, turn_duration_ms=0)  # its turns run until something ends them
    shared = _shared_goal_revoked(client, sid, "r", owner_plan="owner's own plan")
    turn_id = wait_for(lambda: client.session_info(WS, sid).active_turn_id, 30, "a running turn")
    before = client.session_info(WS, sid)
    sim.session(WS, sid, restart=True)
    say(
        "session-r's agent host restarts: its turns and fences are gone",
        epoch_before=before.runtime_epoch,
        fences_at_host=len(sim.session(WS, sid)["fences"]),
    )
    info = client.ensure_session(WS, sid)
    fences = sim.session(WS, sid)["fences"]
    outcome = _turn_outcome(client, sid, turn_id)
    say(
        "the user checks the session: the new epoch is seen, fences restored, old turn ended",
        epoch=info.runtime_epoch,
        fences_at_host=len(fences),
        old_turn=outcome,
        owner_goal_kept=client.goal_state(WS, sid).desired["objective"] == "owner's own plan",
    )
    return outcome == "interrupted" and [shared.operation_id, 1] in fences


def second_host(client: AgentRadar, stack: Stack, say) -> bool:
    # 8. a second agent host joins the fleet and session-m moves to it: a new epoch there,
    #    its fence goes there before its next goal, and nothing of it is sent to the first
    sid = "session-m"
    shared = _shared_goal_revoked(client, sid, "m")
    url = f"http://127.0.0.1:{free_port()}"
    stack.start_sim("host-b", url)
    host_b = SimControl(url, client.settings.runtime_token)
    # Its simulator was started with the demo's settings: the same token.
    client.add_host("host-b", url, token=client.settings.runtime_token)
    say("a second agent host joins", hosts=[h.host_id for h in client.list_hosts()])
    info = client.ensure_session(WS, sid, host_id="host-b")
    op = client.wait(client.set_goal(WS, sid, "carry on at host-b", client_submit_id="req-m"))
    calls = [c["call"] for c in host_b.calls() if c["session_id"] == sid]
    fences = host_b.session(WS, sid)["fences"]
    say(
        "session-m moves to host-b: a new epoch there, its fence first, then its current goal,"
        " then the next one",
        host=info.host_id,
        epoch=info.runtime_epoch,
        calls_at_host_b=calls,
        goal=op.status,
    )
    applied_at_b = [e["operation_id"] for e in host_b.effects()]
    return (
        op.status == "completed"
        and applied_at_b[-1:] == [op.operation_id]
        and shared.operation_id not in applied_at_b  # never the fenced generation
        and [shared.operation_id, 1] in fences
        and calls.index("goal-fences") < calls.index("goal")
    )


def _turn_outcome(client: AgentRadar, sid: str, turn_id: str) -> str | None:
    from ...models.db import run_transaction
    from ...models.tables import Turn

    turn = run_transaction(client.engine, lambda s: s.get(Turn, (WS, sid, turn_id)))
    return turn.outcome if turn is not None else None


def maintenance_and_prompts(client: AgentRadar, sim: SimControl, say) -> bool:
    # 9. maintenance: a compaction, a cancelled one, and prompts parked behind one
    run = client.wait(client.start_maintenance(WS, "session-g", client_submit_id="compact-1"))
    say(
        "compaction finished",
        status=run.status,
        records=run.revision,
        result_tokens=run.result_tokens,
    )
    sim.session(WS, "session-h", maintenance_duration_ms=5000)
    run = client.start_maintenance(WS, "session-h", client_submit_id="compact-2")
    wait_for(lambda: client.get_maintenance(run.run_id).lease_token, 30, "the run to start")
    client.cancel_maintenance(run.run_id)
    run = client.wait(run)
    say("compaction cancelled", status=run.status, error_code=run.error_code, records=run.revision)
    sim.session(WS, "session-i", maintenance_duration_ms=1500)
    run = client.start_maintenance(WS, "session-i", client_submit_id="compact-3")
    queued = [
        client.submit_prompt(WS, "session-i", text, client_submit_id=f"prompt-{n}")
        for n, text in enumerate(("summarise the diff", "open a pull request"))
    ]
    say(
        "two prompts submitted while the compaction holds the session",
        statuses=[client.get_prompt(p.prompt_id).status for p in queued],
    )
    run = client.wait(run)
    for p in queued:
        wait_for(lambda p=p: client.get_prompt(p.prompt_id).settled, 60, "the prompts")
    sent = [e["text"] for e in sim.effects("prompt") if e["session_id"] == "session-i"]
    say("compaction done; the parked prompts went out in order", run=run.status, sent=sent)
    return sent == ["summarise the diff", "open a pull request"]

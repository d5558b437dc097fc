"""Many agent hosts end to end (docs/lifecycles.md: sessions), on both backends: real worker
processes send every kind of call to the host of its session, and a session that turns up at another
host (its reports say so, through the broker) is a new epoch there: its old turn ends `interrupted`
and its fences reach the new host before the next goal does."""

from agent_radar.workflows.tools.simulator import SimControl
from tests.helpers import eventually

WS = "ws-hosts"


def effects_of(control: SimControl, kind: str | None = None) -> list[dict]:
    return [e for e in control.effects(kind=None) if kind is None or e["kind"] == kind]


def sessions_called(control: SimControl) -> set[str]:
    return {c["session_id"] for c in control.calls()}


def test_every_call_goes_to_the_host_of_its_session(client, stack, sim_control, sim_b):
    control_b = SimControl(sim_b.url)
    client.add_host("host-b", sim_b.url)
    control_b.session(WS, "s-b", continuation_turns=False)  # maintenance needs an idle session
    client.ensure_session(WS, "s-b", host_id="host-b")
    stack.start_worker()

    goals = {
        sid: client.set_goal(WS, sid, f"goal of {sid}", client_submit_id="g1")
        for sid in ("s-a", "s-b")
    }
    for op in goals.values():
        assert client.wait(op, timeout=60).status == "completed"
    fence = client.fence_goal_generation(
        WS, "s-b", goals["s-b"].operation_id, client_submit_id="f1"
    )
    run = client.start_maintenance(WS, "s-b", client_submit_id="m1")
    assert client.wait(fence, timeout=60).status == "completed"
    assert client.wait(run, timeout=60).status == "completed"
    prompt = client.submit_prompt(WS, "s-b", "hello b", client_submit_id="p1")
    eventually(
        lambda: client.get_prompt(prompt.prompt_id).status == "completed",
        timeout_s=60,
        what="the prompt at host-b",
    )

    assert [e["operation_id"] for e in effects_of(sim_control, "goal")] == [
        goals["s-a"].operation_id
    ]
    assert goals["s-b"].operation_id in [e["operation_id"] for e in effects_of(control_b, "goal")]
    assert [e["kind"] for e in effects_of(control_b) if e["kind"] != "goal"].count(
        "maintenance"
    ) >= 1
    assert control_b.session(WS, "s-b")["fences"] == [[goals["s-b"].operation_id, 1]]
    assert sessions_called(sim_control) == {"s-a"}
    assert sessions_called(control_b) == {"s-b"}


def test_a_session_that_moves_host_is_a_new_epoch_there(client, stack, sim_control, sim_b):
    control_b = SimControl(sim_b.url)
    client.add_host("host-b", sim_b.url)
    worker = stack.start_worker()
    # Turns run until something ends them; the goal starts none, so the fence cancels none.
    sim_control.session(WS, "s1", turn_duration_ms=0, continuation_turns=False)
    first = client.wait(client.set_goal(WS, "s1", "first", client_submit_id="g1"), timeout=60)
    fence = client.fence_goal_generation(WS, "s1", first.operation_id, client_submit_id="f1")
    assert client.wait(fence, timeout=60).status == "completed"
    client.submit_prompt(WS, "s1", "a long task", client_submit_id="p1")
    turn_id = eventually(
        lambda: client.session_info(WS, "s1").active_turn_id, what="the prompt's turn"
    )

    # host-b claims the session: it is bound to the host that reported it, so the report is
    # refused and nothing moves (a compromised host cannot take another's sessions).
    control_b.session(WS, "s1")
    sim_b.sim.send_report({"workspace_id": WS, "session_id": "s1", "occurred_at_ms": _now_ms()})
    eventually(
        lambda: "bound to host 'default'" in worker.log_path.read_text(),
        what="the report refused",
    )
    assert client.session_info(WS, "s1").host_id == "default"
    # An operator moves it: a new epoch there, its fences go there first.
    info = client.ensure_session(WS, "s1", host_id="host-b")
    assert (info.host_id, info.runtime_epoch) == ("host-b", 1)
    old = eventually(
        lambda: (t := _turn(client, turn_id)).phase == "settled" and t, what="the old turn"
    )
    assert old.outcome == "interrupted"

    second = client.wait(client.set_goal(WS, "s1", "second", client_submit_id="g2"), timeout=60)
    assert second.status == "completed"
    b_calls = [c["call"] for c in control_b.calls() if c["session_id"] == "s1"]
    assert b_calls.index("goal-fences") < b_calls.index("goal")
    assert control_b.session(WS, "s1")["fences"] == [[first.operation_id, 1]]
    assert second.operation_id not in [e.get("operation_id") for e in effects_of(sim_control)]


def _now_ms() -> int:
    import time

    return int(time.time() * 1000)


def _turn(client, turn_id):
    from agent_radar.models.db import run_transaction
    from agent_radar.models.tables import Turn

    return run_transaction(client.engine, lambda s: s.get(Turn, (WS, "s1", turn_id)))

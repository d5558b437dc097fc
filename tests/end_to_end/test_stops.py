"""Session stop end to end (docs/lifecycles.md: sessions), on both backends: a real worker delivers
the durable cancel of the running turn to the agent; the record settles when the turn has ended."""

from tests.helpers import eventually

WS = "ws-stops"


def test_stop_session_cancels_the_running_turn_at_the_agent(client, stack, sim_control):
    stack.start_worker()
    sim_control.session(WS, "s1", turn_duration_ms=0)  # the turn runs until cancelled
    client.wait(client.set_goal(WS, "s1", "keep going", client_submit_id="1"))
    turn_id = eventually(
        lambda: client.session_info(WS, "s1").active_turn_id, what="the continuation turn"
    )
    stop = client.stop_session(WS, "s1", client_submit_id="stop", reason="user pressed stop")
    assert stop.turn_id == turn_id and not stop.settled
    done = client.wait(stop, timeout=60)
    assert (done.status, done.settled) == ("completed", True)
    cancels = [e for e in sim_control.effects(kind=None) if e["kind"] == "cancel"]
    assert [(e["turn_id"], e["operation_id"]) for e in cancels] == [
        (turn_id, stop.cancel_operation_id)
    ]
    assert client.session_info(WS, "s1").active_turn_id is None
    assert not [c for c in sim_control.calls() if c["call"] == "resume"]

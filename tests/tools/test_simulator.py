"""The simulator's effects feed, as the benchmark and the demo read it."""

import threading
import time

import pytest

from agent_radar.workflows.adapters.http_runtime import HttpRuntime
from agent_radar.workflows.errors import RuntimeFault
from agent_radar.workflows.tools.simulator.faults import HostFaults
from tests.helpers import eventually, goal_call

WS = "ws-sim"


@pytest.fixture
def backend():
    return "embedded"  # the simulator does not depend on the product's backend


def _apply(settings, sid: str) -> None:
    goal_call(HttpRuntime(settings.runtime_url, settings.runtime_token), WS, sid)


@pytest.fixture
def quiet_sim(sim_control):
    """Goal calls only: no agent turns that would add effects of their own."""
    sim_control.defaults(continuation_turns=False)
    return sim_control


def test_a_waiting_poll_answers_with_the_next_effect(settings, quiet_sim):
    _apply(settings, "first")
    assert [e["operation_id"] for e in quiet_sim.effects(kind=None)] == ["op-first"]
    later = threading.Timer(0.3, _apply, (settings, "second"))
    later.start()
    started = time.monotonic()
    effects = quiet_sim.effects(kind=None, since=1, wait_s=5)
    waited = time.monotonic() - started
    later.join()
    assert [e["operation_id"] for e in effects] == ["op-second"]
    # It answered on the effect, not at the end of its wait.
    assert 0.2 < waited < 4


def test_a_waiting_poll_with_nothing_new_answers_empty_after_its_wait(settings, quiet_sim):
    _apply(settings, "only")
    started = time.monotonic()
    assert quiet_sim.effects(kind=None, since=1, wait_s=0.3) == []
    assert time.monotonic() - started >= 0.3
    # Without a wait it answers at once with what it has.
    assert [e["operation_id"] for e in quiet_sim.effects(kind=None)] == ["op-only"]


@pytest.mark.parametrize("wait_s", ["-1", "5.5", "nan", "inf", "soon"])
def test_a_bad_wait_is_rejected(settings, sim_control, wait_s):
    with pytest.raises(RuntimeFault) as caught:
        sim_control.http.request("GET", f"/sim/effects?since=0&wait_s={wait_s}")
    assert caught.value.http_status == 422


def test_a_stopped_simulator_reports_nothing_more():
    """After `close` (which `SimServer.stop` calls) no timer fires and no report goes out:
    the reporter (a publisher, with its broker connection) can then be closed without a late
    report opening it again. (That `close` waits for the reports on their way is the kit's,
    tests/tools/test_host_kit.py.)"""
    from agent_radar.workflows.tools.simulator.state import Simulator

    reported: list[dict] = []
    sim = Simulator(reported.append)
    report = {"workspace_id": WS, "session_id": "s"}
    sim.later(200, sim.send_report, {**report, "late": True})
    (timer,) = sim._timers
    sim.send_report({**report, "first": True})
    sim.close()
    timer.join(5)
    sim.send_report(report)
    sim.later(0, sim.send_report, report)
    time.sleep(0.2)
    assert [r.get("first") for r in reported] == [True]  # the late one never fired
    assert not sim._timers


def test_a_latency_drawn_per_session_is_the_same_for_that_session_every_time():
    """The benchmark's tail phases compare two runs over the same session ids: drawn per
    session, their latencies are the same draws, lognormal with the median asked for."""
    faults = HostFaults(threading.Condition())
    faults.control("/sim/latency", {"call": "goal", "ms": 200, "p99_ms": 2000, "per_session": True})
    drawn = [faults.delay_ms("goal", f"s{i}") for i in range(600)]
    assert drawn == [faults.delay_ms("goal", f"s{i}") for i in range(600)]
    assert len(set(drawn)) == 600
    assert 160 < sorted(drawn)[300] < 250 and max(drawn) > 1000
    assert faults.delay_ms("liveness", "s0") == 0  # other calls keep theirs

    faults.control("/sim/latency", {"call": "goal", "ms": 200, "p99_ms": 2000})
    assert len({faults.delay_ms("goal", "s0") for _ in range(5)}) == 5  # per call again
    faults.control("/sim/latency", {"call": "goal", "ms": 200})
    assert faults.delay_ms("goal", "s0") == 200


def test_a_simulator_with_a_token_signs_its_reports_and_numbers_turns_if_asked():
    """A host with a token signs every report (docs/protocol.md: signing a report); with
    `numbered_turns` its process numbers turns from 1 again after a restart."""
    from agent_radar.workflows.adapters import report_auth
    from agent_radar.workflows.tools.simulator.state import Simulator

    reported = []
    sim = Simulator(reported.append, "gpu-2", "gpu-2-secret")
    sim.control(f"/sim/sessions/{WS}/s", {"numbered_turns": True, "turn_duration_ms": 0})
    sim.handle("prompts", WS, "s", {"prompt_id": "p1", "text": "a"})
    sim.control(f"/sim/sessions/{WS}/s", {"restart": True})
    sim.handle("prompts", WS, "s", {"prompt_id": "p2", "text": "b"})
    eventually(lambda: len(reported) == 2, what="both turns' reports")
    # Each process numbered its turn 1; the reports go out on timers, in either order.
    assert sorted((r["turn"]["turn_id"], r["session"]["runtime_epoch"]) for r in reported) == [
        ("turn-1", 1),
        ("turn-1", 2),
    ]
    for report in reported:
        assert report["signed_by"] == "gpu-2"
        assert report_auth.signature_ok(report, "gpu-2-secret")
        assert not report_auth.signature_ok(report, "another")
    sim.close()


def test_a_long_run_s_effects_come_a_page_at_a_time_and_all_arrive(settings, quiet_sim):
    """The broker-fault campaign's 10,000 goals made one answer of /sim/effects larger than
    a client takes (1 MiB): an answer holds EFFECTS_PAGE effects at most, and the feed asks
    again from where it is until it has them all."""
    from concurrent.futures import ThreadPoolExecutor

    from agent_radar.workflows.tools.simulator.endpoints import EFFECTS_PAGE

    count = EFFECTS_PAGE + 5
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: _apply(settings, f"s{i}"), range(count)))
    first = quiet_sim.http.request("GET", "/sim/effects?since=0")
    assert (len(first["effects"]), first["total"]) == (EFFECTS_PAGE, count)
    assert sorted(e["operation_id"] for e in quiet_sim.effects(kind=None)) == sorted(
        f"op-s{i}" for i in range(count)
    )
    assert len(quiet_sim.effects(kind=None, since=count - 3)) == 3


def test_a_caller_that_gives_up_before_its_answer_costs_no_traceback(capsys):
    """A worker whose call reached its deadline closes the connection; the simulator's late
    answer then meets a reset. That is one debug line, not a traceback on stderr per call
    (a 10,000-fault campaign printed 65 of them), and the simulator serves on."""
    import socket
    import struct

    from agent_radar.workflows.tools.simulator.control import SimControl
    from tests.helpers import QuickStopSimServer

    server = QuickStopSimServer(port=0).start()
    try:
        control = SimControl(server.url)
        control.hold("*")
        host, port = server.httpd.server_address[:2]
        caller = socket.create_connection((host, port))
        body = b'{"action": "set"}'
        caller.sendall(
            b"POST /v1/workspaces/ws/sessions/s1/goal HTTP/1.1\r\nHost: sim\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        eventually(lambda: control.holding() == 1, what="the call to be held")
        # Gone at once, with a reset: the answer's write fails.
        caller.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        caller.close()
        control.hold("*", hold=False)
        eventually(lambda: control.holding() == 0, what="the held call to end")
        time.sleep(0.2)  # its answer's write, and what the server does with its failure
        assert control.effects(kind=None) is not None  # still serving
    finally:
        server.stop()
    assert "Traceback" not in capsys.readouterr().err


def _goal(sim, sid, op, revision):
    body = {"operation_id": op, "action": "set", "objective": "o", "revision": revision}
    return sim.handle("goal", WS, sid, body | {"client_submit_id": op, "require_live": True})


def test_what_the_kit_took_over_answers_as_the_simulator_did():
    """Review of the simulator on the kit: every report signed (a test's own too, whatever
    it holds); a run of no duration done when first asked; a goal accepted before a silent
    drop or a move here anew is answered anew on its retry instead of `accepted` for ever."""
    from agent_radar.workflows.adapters.report_auth import signature_ok
    from agent_radar.workflows.tools.simulator.state import Simulator

    reported: list[dict] = []
    sim = Simulator(reported.append, host_id="h", token="t0ken")
    sim.send_report({"workspace_id": WS, "session_id": "s", "occurred_at_ms": 1})
    sim.send_report(
        {"workspace_id": WS, "session_id": "s", "occurred_at_ms": 2, "session": {"live": True}}
    )
    eventually(lambda: len(reported) == 2, what="both reports")
    assert all(signature_ok(r, "t0ken") for r in reported)

    sim.control(f"/sim/sessions/{WS}/run", {"maintenance_duration_ms": 0})
    sim.handle("maintenance", WS, "run", {"run_id": "r1", "kind": "compact", "args": {}})
    assert sim.handle("maintenance/r1", WS, "run", {})["state"] == "done"

    for how in ({"live": False}, {"fresh": True}):
        sid = f"later-{len(how)}-{next(iter(how))}"
        sim.control(f"/sim/sessions/{WS}/{sid}", {"goal_mode": "accepted", "apply_delay_ms": 50})
        assert _goal(sim, sid, f"op-{sid}", 1)["phase"] == "accepted"
        sim.control(f"/sim/sessions/{WS}/{sid}", how)  # silent, before the goal applies
        time.sleep(0.2)
        sim.control(f"/sim/sessions/{WS}/{sid}", {"live": True, "goal_mode": "applied"})
        assert _goal(sim, sid, f"op-{sid}", 1)["phase"] == "applied"
    sim.close()

"""The simulator's effects feed, as the benchmark and the demo read it."""

import threading
import time

import pytest

from tests.helpers import goal_call
from workflows.adapters.runtime import HttpRuntime
from workflows.errors import RuntimeFault

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

"""The runtime router over real sockets (docs/lifecycles.md: sessions): each session's calls go to
its host's URL through that host's own connection pool, so a host that hangs holds only its own
connections and its own calls, each of which ends at the per-call timeout."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from agent_radar.workflows.adapters.http_runtime import HostRouter, HttpRuntime
from agent_radar.workflows.errors import RuntimeFault
from tests import helpers
from tests.hostile import HANG, ScriptedHost, applied

WS = "ws-router"


@pytest.fixture
def silent():
    """An agent host that accepts connections and reads requests, and never answers."""
    h = ScriptedHost(lambda connection, request: HANG)
    yield h
    h.close()


def goal_call(runtime, sid: str):
    return helpers.goal_call(runtime, WS, sid)


def test_a_hanging_host_stalls_only_its_own_calls(host, silent):
    hosts = {"on-a": ("host-a", silent.url), "on-b": ("host-b", host.url)}
    router = HostRouter("http://127.0.0.1:9", lambda ws, sid: hosts[sid], timeout_s=5.0)
    host.answers["on-b"] = applied
    assert router.on_host("host-a", silent.url).http is not router.on_host("host-b", host.url).http

    with ThreadPoolExecutor(4) as pool:
        stuck = [pool.submit(goal_call, router, "on-a") for _ in range(4)]
        for _ in stuck:  # every call to host-a has reached it and hangs there
            assert silent.accepted.acquire(timeout=30)
        answers = [goal_call(router, "on-b") for _ in range(3)]
        # host-b answered every call while all four calls to host-a were still waiting.
        assert [a["phase"] for a in answers] == ["applied"] * 3
        assert not any(f.done() for f in stuck)
        for f in stuck:
            with pytest.raises(RuntimeFault) as fault:
                f.result(timeout=30)
            assert fault.value.code == "timeout" and fault.value.retryable


def test_the_default_host_is_the_configured_url_and_unknown_hosts_are_never_called(host):
    host.answers["s1"] = applied
    router = HostRouter(host.url, lambda ws, sid: ("default", None))
    assert goal_call(router, "s1")["phase"] == "applied"
    gone = HostRouter(host.url, lambda ws, sid: ("removed-host", None))
    with pytest.raises(RuntimeFault) as fault:
        goal_call(gone, "s1")
    assert fault.value.code == "unknown_host" and fault.value.retryable


def test_every_call_to_a_host_passes_its_bulkhead(host, silent):
    """A fence, a cancel, a prompt: not only goal calls pass the host's bulkhead (docs/
    dispatch.md). Once calls to a host failed in a row, its circuit is open and no call of
    any kind reaches it, each failing retryably at once; and a host whose every slot is busy
    holds a call back until its wait runs out."""
    from agent_radar.workflows.adapters import bulkhead

    host.answers["s1"] = (500, b'{"error": "server_error"}')
    router = HostRouter("http://127.0.0.1:9", lambda ws, sid: ("host-a", host.url))
    for _ in range(bulkhead.BREAKER_FAILURES):
        with pytest.raises(RuntimeFault) as fault:
            goal_call(router, "s1")
        assert fault.value.code == "server_error"
    reached = len(host.seen)
    calls = [
        lambda: router.install_fence(
            WS, "s1", target_operation_id="op-1", target_revision=1, require_live=True
        ),
        lambda: router.cancel_turn(
            WS, "s1", "t1", operation_id="c1", reason="r", require_live=True
        ),
        lambda: router.submit_prompt(WS, "s1", prompt_id="p1", text="hello"),
        lambda: router.liveness(WS, "s1"),
    ]
    for call in calls:
        with pytest.raises(RuntimeFault) as fault:
            call()
        assert fault.value.code == "circuit_open" and fault.value.retryable
    assert len(host.seen) == reached  # none of them was sent

    # One slot, held by a call that hangs: another call waits for it, then gives up. The
    # waiting call's deadline (its wait) is well inside the hanging one's, so the slot is
    # still held when the wait runs out, however loaded the machine.
    busy = HostRouter(
        "http://127.0.0.1:9",
        lambda ws, sid: ("host-b", silent.url),
        timeout_s=3.0,
        host_concurrency=1,
    )
    waiting = HttpRuntime(silent.url, timeout_s=0.5, host_id="host-b", bulkhead=busy.bulkhead)
    with ThreadPoolExecutor(1) as pool:
        stuck = pool.submit(goal_call, busy, "s2")
        assert silent.accepted.acquire(timeout=30)
        with pytest.raises(RuntimeFault) as fault:
            waiting.liveness(WS, "s3")
        assert fault.value.code == "host_busy" and fault.value.retryable
        assert stuck.exception(timeout=30).code == "timeout"
    assert silent.accepted.acquire(timeout=0.1) is False  # the held-back call never went

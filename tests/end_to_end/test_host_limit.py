"""A burst past a host's limit (docs/dispatch.md), on both backends: a worker process calls
a host at most `host_concurrency` at a time and queues as many again; what it cannot hold
goes back due a moment later. With no beat running, nothing sweeps: the worker's own drain
looks again once that work is due, so the whole burst settles at the host's pace, each goal
applied once."""

from dataclasses import replace

import pytest

from tests.helpers import eventually

WS = "ws-limit"
SESSIONS = 12


@pytest.fixture
def settings(settings):
    return replace(settings, host_concurrency=1)


def test_a_burst_past_the_host_limit_settles_without_a_sweep(client, stack, sim_control):
    sim_control.latency("goal", 150)  # a slow host: one call at a time holds the rest back
    stack.start_worker(concurrency=1)  # and no beat: the sweeper never runs
    ops = [
        client.set_goal(WS, f"s{i}", f"goal {i}", client_submit_id="g1") for i in range(SESSIONS)
    ]

    def statuses() -> list[str]:
        return [client.get_goal_operation(op.operation_id).status for op in ops]

    eventually(
        lambda: statuses() == ["completed"] * SESSIONS,
        timeout_s=60,
        what="every goal of the burst",
    )
    applied = sorted(e["operation_id"] for e in sim_control.effects())
    assert applied == sorted(op.operation_id for op in ops)
    # A claim that went back cost no attempt: each goal was called once.
    assert [client.get_goal_operation(op.operation_id).attempt for op in ops] == [1] * SESSIONS

"""Pulling under load (docs/dispatch.md), on PostgreSQL: a puller's promise and channel, and
the goal submit that notifies one instead of asking for a dispatch message."""

from datetime import timedelta

import pytest
from sqlalchemy import delete, select, update

from agent_radar.models.base import utcnow
from agent_radar.models.coordination import GoalPuller
from agent_radar.models.db import run_transaction
from agent_radar.models.dialects import dialect_of
from agent_radar.workflows.goals.submit import GoalRequest, submit
from agent_radar.workflows.steps.goals.pull import Puller, notified
from tests.helpers import eventually

ON_POSTGRESQL = pytest.mark.parametrize("backend", ["production"])


class Wakes:
    """What the puller woke its drain with, in order."""

    def __init__(self) -> None:
        self.seen: list = []

    def __call__(self, what) -> None:
        self.seen.append(what)


def _promises(engine) -> dict[str, object]:
    return run_transaction(
        engine,
        lambda s: {row.channel: row.expires_at for row in s.execute(select(GoalPuller)).scalars()},
    )


def _submit(engine, sid: str, submit_id: str = "1"):
    request = GoalRequest.parse("ws-pull", sid, "set", f"goal {sid}", client_submit_id=submit_id)
    return run_transaction(engine, lambda s: submit(s, request, utcnow(), notify=True))


@ON_POSTGRESQL
def test_a_puller_holds_its_promise_wakes_on_notification_and_lets_go(client):
    wakes = Wakes()
    puller = Puller(client.engine, wakes)
    puller.start()
    try:
        # Connected: one wake for whatever was notified while nobody listened.
        eventually(lambda: wakes.seen and puller.channel in _promises(client.engine))
        assert wakes.seen == [None]
        assert _promises(client.engine)[puller.channel] > utcnow()
        op, created, notified = _submit(client.engine, "s1")
        assert created and notified
        # The notification names the operation and its session.
        eventually(lambda: len(wakes.seen) == 2, what="the notification's wake")
        assert wakes.seen[1] == (op.operation_id, "ws-pull", "s1")
        # A replay notifies nobody: it asks for nothing.
        assert _submit(client.engine, "s1")[1:] == (False, False)

        puller.holding = False
        eventually(lambda: puller.channel not in _promises(client.engine), what="let go")
        _op, created, notified = _submit(client.engine, "s2")
        assert created and not notified  # no promise: the submit publishes its message
        puller.holding = True
        eventually(lambda: puller.channel in _promises(client.engine), what="held again")
    finally:
        puller.stop()
        # Let go at once, from the caller's thread.
        assert puller.channel not in _promises(client.engine)
        puller.thread.join(5)
    assert not puller.thread.is_alive()


def test_a_payload_that_is_not_a_notification_names_nothing():
    assert notified('["op", "ws", "s1"]') == ("op", "ws", "s1")
    for payload in ("", "op", "[1, 2, 3]", '["op", "ws"]', "{}", '["a", "b", "c", "d"]', '["x'):
        assert notified(payload) is None, payload


@ON_POSTGRESQL
def test_an_expired_promise_is_not_notified_and_sessions_spread_over_live_ones(client):
    engine = client.engine
    now = utcnow()
    live = {f"agent_radar_pull_live{i}" for i in range(2)}
    run_transaction(
        engine,
        lambda s: s.add_all(
            [GoalPuller(channel=c, expires_at=now + timedelta(hours=1)) for c in live]
            + [GoalPuller(channel="agent_radar_pull_dead", expires_at=now - timedelta(1))]
        ),
    )
    # Which channel each submit notified, as a listener on every channel sees it.
    conn = dialect_of(engine).listening_connection(engine)
    try:
        for channel in [*live, "agent_radar_pull_dead"]:
            conn.execute(f'LISTEN "{channel}"')
        for i in range(40):
            assert _submit(engine, f"s{i}")[2]
        for i in range(40):  # a session's next operation goes where its first went
            assert _submit(engine, f"s{i}", "2")[2]
        seen = [n.channel for n in conn.notifies(timeout=2, stop_after=80)]
    finally:
        conn.close()
    assert len(seen) == 80 and set(seen) == live
    assert seen[:40] == seen[40:]

    # Every promise expired: nothing is notified, the submit asks for a message.
    run_transaction(engine, lambda s: s.execute(update(GoalPuller).values(expires_at=now)))
    assert _submit(engine, "s-late")[1:] == (True, False)
    run_transaction(engine, lambda s: s.execute(delete(GoalPuller)))

"""Pulling under load (docs/dispatch.md), on PostgreSQL: a puller's promise and channel, and
the client's notification of committed goal operations instead of a dispatch message."""

from datetime import timedelta

import pytest
from sqlalchemy import delete, select, update

from agent_radar.models.base import utcnow
from agent_radar.models.coordination import GoalPuller
from agent_radar.models.db import run_transaction
from agent_radar.models.dialects import dialect_of
from agent_radar.workflows.goals import pullers
from agent_radar.workflows.goals.pullers import Puller, notified
from agent_radar.workflows.validation import MAX_ID_CHARS
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


def _notify(engine, named) -> set[str]:
    return run_transaction(engine, lambda s: pullers.notify(s, named))


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
        op = client.set_goal("ws-pull", "s1", "goal s1", client_submit_id="1")
        assert client.flush()
        # The notification names the operation and its session.
        eventually(lambda: len(wakes.seen) == 2, what="the notification's wake")
        assert wakes.seen[1] == [(op.operation_id, "ws-pull", "s1")]
        # A replay notifies nobody: it asks for nothing. The next wake is the next submit's.
        client.set_goal("ws-pull", "s1", "goal s1", client_submit_id="1")
        op2 = client.set_goal("ws-pull", "s1", "goal s1 again", client_submit_id="2")
        assert client.flush()
        eventually(lambda: len(wakes.seen) == 3, what="the second notification's wake")
        assert wakes.seen[2] == [(op2.operation_id, "ws-pull", "s1")]

        puller.holding = False
        eventually(lambda: puller.channel not in _promises(client.engine), what="let go")
        # No promise: nobody is told, the client publishes its message.
        assert _notify(client.engine, [("op-x", "ws-pull", "s2")]) == set()
        puller.holding = True
        eventually(lambda: puller.channel in _promises(client.engine), what="held again")
    finally:
        puller.stop()
        # Let go at once, from the caller's thread.
        assert puller.channel not in _promises(client.engine)
        puller.thread.join(5)
    assert not puller.thread.is_alive()


def test_a_payload_that_is_not_a_notification_names_nothing():
    assert notified('[["op", "ws", "s1"]]') == [("op", "ws", "s1")]
    assert notified('[["a", "w", "s"], ["b", "w", "t"]]') == [("a", "w", "s"), ("b", "w", "t")]
    for payload in (
        "",
        "op",
        "[]",
        '["op", "ws", "s1"]',
        "[[1, 2, 3]]",
        '[["op", "ws"]]',
        "{}",
        '[["a", "b", "c", "d"]]',
        '[["a", "b", "c"], "d"]',
        '["x',
        "[" * 5000,  # nested past the parser's depth
    ):
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
    # Which channel each operation was told on, as a listener on every channel sees it.
    conn = dialect_of(engine).listening_connection(engine)
    try:
        for channel in [*live, "agent_radar_pull_dead"]:
            conn.execute(f'LISTEN "{channel}"')
        first = [(f"op{i}", "ws-pull", f"s{i}") for i in range(40)]
        # A session's next operation goes where its first went.
        second = [(f"op{i}-2", "ws-pull", f"s{i}") for i in range(40)]
        assert _notify(engine, first) == {op for op, _, _ in first}
        assert _notify(engine, second) == {op for op, _, _ in second}
        seen = list(conn.notifies(timeout=2, stop_after=4))
    finally:
        conn.close()
    # One notification per puller and statement, the operations spread over the live ones.
    assert len(seen) == 4 and {n.channel for n in seen} == live
    told = {}
    for n in seen:
        for op, _ws, sid in notified(n.payload):
            told[op] = (n.channel, sid)
    assert set(told) == {op for op, _, _ in first + second}
    for i in range(40):
        assert told[f"op{i}"] == told[f"op{i}-2"]

    # Every promise expired: nobody is told, the client publishes the messages.
    run_transaction(engine, lambda s: s.execute(update(GoalPuller).values(expires_at=now)))
    assert _notify(engine, [("op-late", "ws-pull", "s-late")]) == set()
    run_transaction(engine, lambda s: s.execute(delete(GoalPuller)))


@ON_POSTGRESQL
def test_long_names_are_told_in_payloads_postgresql_accepts(client):
    engine = client.engine
    channel = "agent_radar_pull_long"
    run_transaction(
        engine,
        lambda s: s.add(GoalPuller(channel=channel, expires_at=utcnow() + timedelta(hours=1))),
    )
    # The longest ids there are, in characters of four and three UTF-8 bytes (and JSON
    # escapes): 2,805 bytes each, so that two make a payload and three would pass 8,000.
    wide = "\U0001f600" * (MAX_ID_CHARS - 2) + '"\\'
    named = [(f"{i:03d}" + "€" * (MAX_ID_CHARS - 3), wide, wide) for i in range(16)]
    conn = dialect_of(engine).listening_connection(engine)
    try:
        conn.execute(f'LISTEN "{channel}"')
        assert _notify(engine, named) == {op for op, _, _ in named}
        seen = list(conn.notifies(timeout=2, stop_after=len(named)))
    finally:
        conn.close()
        run_transaction(engine, lambda s: s.execute(delete(GoalPuller)))
    assert len(seen) == 8 and all(len(n.payload.encode()) < 8000 for n in seen)
    assert sorted(one for n in seen for one in notified(n.payload)) == sorted(named)


@ON_POSTGRESQL
def test_a_submit_whose_notification_fails_is_dispatched_by_message(
    client, settings, monkeypatch, caplog
):
    """The database away for the sender's notification (after the submit committed): the
    operation goes out in a dispatch message instead, naming its session."""
    from agent_radar import AgentRadar
    from tests.adapters.test_publisher import RecordingPublisher

    def away(_session, _named):
        raise ConnectionError("database away")

    monkeypatch.setattr(pullers, "notify", away)
    publisher = RecordingPublisher(settings, delay_s=0)
    c = AgentRadar(settings=settings, publisher=publisher)
    op = c.set_goal("ws-away", "s1", "ship it", client_submit_id="away-1")
    assert c.flush(5)
    assert publisher.messages == [
        (
            "agent_radar.goal.dispatch",
            {"operation_ids": [op.operation_id], "workspace_id": "ws-away", "session_id": "s1"},
        )
    ]
    assert "1 operations go by message: ConnectionError: database away" in caplog.text

"""The embedded broker: kombu's filesystem transport with this project's fixes
(workflows.adapters.broker)."""

import json
import os
import socket

import pytest
from kombu.transport import filesystem

from agent_radar.workflows.adapters.broker import (
    DEFAULT_QUEUE,
    FILESYSTEM_DRAIN_SLICE_S,
    broker_connection,
    broker_folders,
    queue_named,
)
from agent_radar.workflows.adapters.config import Settings
from agent_radar.workflows.adapters.publisher import TaskPublisher


def _settings(tmp_path, name) -> Settings:
    home = tmp_path / name
    home.mkdir()
    return Settings(home=home, database_url=f"sqlite:///{home / 'db'}", broker_url="filesystem://")


def _default_queue(settings: Settings):
    return queue_named(settings, DEFAULT_QUEUE)


def _received(settings: Settings) -> list[dict]:
    """Consume every message waiting in the default queue of this broker folder."""
    got = []
    with broker_connection(settings) as conn:
        with conn.Consumer(
            [_default_queue(settings)],
            accept=["json"],
            callbacks=[lambda body, message: (got.append(body[1]), message.ack())],
        ):
            while True:
                try:
                    conn.drain_events(timeout=0.5)
                except TimeoutError:
                    return got


def test_each_broker_folder_gets_its_own_bindings(tmp_path):
    """Upstream keeps one binding registry per process: after publishing to one folder, a
    message published to a second folder (no worker bound yet) was routed nowhere."""
    first, second = _settings(tmp_path, "a"), _settings(tmp_path, "b")
    for settings, n in ((first, 1), (second, 2)):
        publisher = TaskPublisher(settings)
        publisher.publish("agent_radar.goal.dispatch", {"operation_id": f"op-{n}"})
        publisher.close()
    assert _received(second) == [{"operation_id": "op-2"}]
    assert _received(first) == [{"operation_id": "op-1"}]


def test_a_message_file_appears_whole(tmp_path, monkeypatch):
    """A consumer takes any `.msg` file it lists, so a message is written under another name
    and renamed into place: at the moment it appears, it is complete."""
    settings = _settings(tmp_path, "a")
    queue_folder = broker_folders(settings)["queue"]
    seen = []
    real_rename = os.rename

    def rename(src, dst):
        if str(dst).endswith(".msg"):
            assert not os.path.exists(dst)
            with open(src, "rb") as written:
                seen.append(json.loads(written.read())["headers"]["task"])
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    publisher = TaskPublisher(settings)
    publisher.publish("agent_radar.goal.dispatch", {"operation_id": "op-1"})
    publisher.close()
    assert seen == ["agent_radar.goal.dispatch"]
    assert [p.suffix for p in queue_folder.iterdir() if not p.name.startswith("tmp-")] == [".msg"]
    assert not [p for p in queue_folder.iterdir() if p.name.startswith("tmp-")]


def test_a_wait_for_messages_is_cut_into_short_slices(tmp_path, monkeypatch):
    """Celery's loop for this transport looks for a pending shutdown only between drains,
    so each drain waits at most FILESYSTEM_DRAIN_SLICE_S, whatever it was asked for."""
    settings = _settings(tmp_path, "a")
    asked = []
    real = filesystem.Transport.drain_events

    def recording(self, connection, timeout=None):
        asked.append(timeout)
        return real(self, connection, timeout=timeout)

    monkeypatch.setattr(filesystem.Transport, "drain_events", recording)
    with broker_connection(settings) as conn:
        with conn.Consumer([_default_queue(settings)], accept=["json"], callbacks=[]):
            with pytest.raises(socket.timeout):
                conn.drain_events(timeout=2.0)
    assert asked == [FILESYSTEM_DRAIN_SLICE_S]


def test_a_lost_redis_connection_while_restoring_unacked_messages_does_not_stop_the_worker():
    """kombu puts the unacknowledged messages back when a channel closes; after a lost Redis
    its connection is already released, and the restore raised AttributeError out of the
    worker (seen in the broker restart test). The guarded channel's QoS logs it and goes
    on: the messages stay in Redis's unacknowledged set, which gives them back later."""
    from agent_radar.tasks.envelope import GuardedRedisQoS

    class Released:
        do_restore = True

        def conn_or_acquire(self, client=None):
            raise AttributeError("'NoneType' object has no attribute 'hostname'")

    qos = GuardedRedisQoS(Released())
    qos._delivered["tag-1"] = object()
    qos.restore_unacked_once()  # raised AttributeError before
    assert not qos._delivered and qos._delivered.restored

"""Coalesced publishing: concurrent submits of one process share dispatch messages, and every
item is in exactly one message (or reported unpublished, for the sweeper)."""

import threading
import time

from workflows.broker import TaskPublisher

TASK = "agent_radar.goal.dispatch"


class RecordingPublisher(TaskPublisher):
    """Records instead of talking to a broker; slow, so concurrent callers pile up."""

    def __init__(self, settings, fail=False):
        super().__init__(settings)
        self.messages = []
        self.fail = fail

    def publish(self, task_name, kwargs=None, queue=None):
        time.sleep(0.05)
        if self.fail:
            raise ConnectionError("broker unreachable")
        self.messages.append((task_name, kwargs))
        return "task-id"


def _publish_concurrently(publisher, count):
    barrier = threading.Barrier(count)
    results = {}

    def submit(i):
        barrier.wait()
        results[i] = publisher.publish_coalesced(TASK, "operation_ids", f"op-{i}")
    threads = [threading.Thread(target=submit, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    return results


def test_concurrent_items_share_messages_and_each_is_published_once(settings):
    publisher = RecordingPublisher(settings)
    results = _publish_concurrently(publisher, 8)
    assert results == {i: True for i in range(8)}
    published = [item for task, kwargs in publisher.messages for item in kwargs["operation_ids"]]
    assert sorted(published) == sorted(f"op-{i}" for i in range(8))
    assert {task for task, _kwargs in publisher.messages} == {TASK}
    assert len(publisher.messages) < 8


def test_a_lone_item_is_published_at_once_in_its_own_message(settings):
    publisher = RecordingPublisher(settings)
    assert publisher.publish_coalesced(TASK, "operation_ids", "only")
    assert publisher.messages == [(TASK, {"operation_ids": ["only"]})]


def test_a_failed_message_reports_each_of_its_items_unpublished(settings):
    publisher = RecordingPublisher(settings, fail=True)
    results = _publish_concurrently(publisher, 4)
    assert results == {i: False for i in range(4)}
    assert publisher.messages == []

"""Coalesced publishing (workflows/client/coalescing.py, in front of the task publisher): the
submits of one process hand their items to a sender thread and return; the sender gives a
burst of them a few messages, and every item is in exactly one message (or reported
unpublished, for the sweeper)."""

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from agent_radar.workflows.adapters.publisher import TaskPublisher
from agent_radar.workflows.client.coalescing import Coalescer, _Waiting
from agent_radar.workflows.task_names import COALESCE_MAX_ITEMS
from tests.helpers import eventually

TASK = "agent_radar.goal.dispatch"


class _Recorder(TaskPublisher):
    """A task publisher that records into its RecordingPublisher instead of publishing."""

    def __init__(self, settings, owner):
        super().__init__(settings)
        self.owner = owner

    def publish(self, task_name, kwargs=None, queue=None, label=None):
        owner = self.owner
        owner.attempt_threads.append(threading.current_thread())
        owner.began.set()
        time.sleep(owner.delay_s)
        if owner.fail:
            raise ConnectionError("broker unreachable")
        owner.messages.append((task_name, kwargs))
        owner.labels.append(label)
        return "task-id"


class RecordingPublisher(Coalescer):
    """A coalescer whose publisher records instead of talking to a broker; slow, so
    concurrent callers pile up. Besides the messages that went out, it records the thread of
    every publish attempt, failed ones too (`attempt_threads`), and sets `began` when the
    first one starts."""

    def __init__(self, settings, fail=False, delay_s=0.05):
        super().__init__(_Recorder(settings, self))
        self.messages = []
        self.labels = []
        self.attempt_threads = []
        self.began = threading.Event()
        self.fail = fail
        self.delay_s = delay_s

    def publish_coalesced(self, task_name, list_kwarg, item):
        """Hand `item` to the sender, as a submit's end does, and wait for its message: True
        once published, False if that failed."""
        mine = _Waiting(item)
        with self._changed:
            self._hand_over((task_name, list_kwarg, None), mine)
            self._changed.notify_all()
            while mine.published is None:
                self._changed.wait()
        return mine.published


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


def _submit(publisher, item, label=None):
    """A submit whose transaction has committed: its item goes to the sender."""
    with publisher.coalescing(TASK, "operation_ids") as publish:
        publish(item, label)


def _submit_in_background(publisher, item, transaction_s):
    """A submit that spends `transaction_s` in its transaction, then publishes `item`."""
    entered = threading.Event()

    def submit():
        with publisher.coalescing(TASK, "operation_ids") as publish:
            entered.set()
            time.sleep(transaction_s)
            publish(item)

    thread = threading.Thread(target=submit)
    thread.start()
    entered.wait(5)
    return thread


def test_a_publish_waits_briefly_for_a_submit_still_in_its_transaction(settings):
    publisher = RecordingPublisher(settings, delay_s=0)
    publisher.linger_s = 5.0
    thread = _submit_in_background(publisher, "slow", transaction_s=0.1)
    assert publisher.publish_coalesced(TASK, "operation_ids", "fast")
    thread.join(5)
    assert publisher.messages == [(TASK, {"operation_ids": ["fast", "slow"]})]


def test_the_wait_for_a_submit_in_its_transaction_is_bounded(settings):
    publisher = RecordingPublisher(settings, delay_s=0)
    publisher.linger_s = 0.05
    thread = _submit_in_background(publisher, "slow", transaction_s=1.0)
    started = time.monotonic()
    assert publisher.publish_coalesced(TASK, "operation_ids", "fast")
    assert time.monotonic() - started < 0.9
    thread.join(5)
    assert publisher.flush(5)
    assert publisher.messages == [
        (TASK, {"operation_ids": ["fast"]}),
        (TASK, {"operation_ids": ["slow"]}),
    ]


def test_a_submit_that_fails_publishes_nothing_and_holds_nobody_up(settings):
    publisher = RecordingPublisher(settings, delay_s=0)
    publisher.linger_s = 5.0
    try:
        with publisher.coalescing(TASK, "operation_ids"):
            raise RuntimeError("the transaction failed")
    except RuntimeError:
        pass
    started = time.monotonic()
    assert publisher.publish_coalesced(TASK, "operation_ids", "next")
    assert time.monotonic() - started < 1.0
    assert publisher.messages == [(TASK, {"operation_ids": ["next"]})]


def test_a_coalesced_items_label_reaches_its_message(settings):
    publisher = RecordingPublisher(settings, delay_s=0)
    publisher.linger_s = 5.0
    _submit(publisher, "op-1", "acme/s1 submit=req-1")
    assert publisher.flush(5)
    assert publisher.labels == ["acme/s1 submit=req-1"]


def test_an_items_arguments_for_a_message_of_its_own_go_only_with_it_alone(settings):
    """An item may bring more arguments for a message that carries it alone (a goal
    operation's session): a message that holds that item only has them; a shared message
    has none of them."""
    alone = {"workspace_id": "acme", "session_id": "s1"}
    sender = RecordingPublisher(settings, delay_s=0)
    with sender.coalescing(TASK, "operation_ids") as publish:
        publish("op-2", None, alone)
    assert sender.flush(5)
    assert sender.messages == [(TASK, {"operation_ids": ["op-2"], **alone})]

    shared = RecordingPublisher(settings, delay_s=0)
    shared.linger_s = 5.0
    with shared.coalescing(TASK, "operation_ids") as first:
        with shared.coalescing(TASK, "operation_ids") as second:
            second("op-3", None, alone)
        first("op-4", None, {"workspace_id": "acme", "session_id": "s2"})
    assert shared.flush(5)
    assert shared.messages == [(TASK, {"operation_ids": ["op-3", "op-4"]})]


def test_a_submit_behind_a_message_on_its_way_hands_its_item_to_the_sender(settings):
    """While a submit's message is on its way, the next submit does not wait for the
    broker: it hands its item over and returns, and the sender publishes it after."""
    publisher = RecordingPublisher(settings, delay_s=0.4)
    first = threading.Thread(target=_submit, args=(publisher, "op-1"))
    first.start()
    assert publisher.began.wait(5)
    started = time.monotonic()
    _submit(publisher, "op-2")
    assert time.monotonic() - started < 0.3
    first.join(5)
    assert publisher.flush(5)
    # Both go out, each once; in which order they finish is the threads' (a loaded machine
    # finished op-2's first), and two operations' messages promise no order.
    assert sorted(publisher.messages, key=str) == [
        (TASK, {"operation_ids": ["op-1"]}),
        (TASK, {"operation_ids": ["op-2"]}),
    ]


def test_a_divert_takes_items_out_of_their_message_and_a_failed_one_leaves_them_in(settings):
    """A divert (a goal operation notified to a worker that pulls) gets every item of a
    message about to be sent with its own arguments; what it delivered is not published, and
    a message it left empty is not sent. If it fails, the message carries every item."""
    seen = []

    def divert(pairs):
        seen.append(pairs)
        return {item for item, _alone in pairs if item.startswith("told")}

    shared = RecordingPublisher(settings, delay_s=0)
    shared.linger_s = 5.0
    with shared.coalescing(TASK, "operation_ids", divert) as first:
        with shared.coalescing(TASK, "operation_ids", divert) as second:
            second("told-1", None, {"session_id": "s1"})
        first("op-2", None, {"session_id": "s2"})
    assert shared.flush(5)
    assert seen == [[("told-1", {"session_id": "s1"}), ("op-2", {"session_id": "s2"})]]
    # Left alone in its message, an item has its own arguments there.
    assert shared.messages == [(TASK, {"operation_ids": ["op-2"], "session_id": "s2"})]

    alone = RecordingPublisher(settings, delay_s=0)
    with alone.coalescing(TASK, "operation_ids", divert) as publish:
        publish("told-3", None, {"session_id": "s3"})
    assert alone.flush(5) and alone.messages == []

    def failing(pairs):
        raise ConnectionError("database away")

    fallback = RecordingPublisher(settings, delay_s=0)
    with fallback.coalescing(TASK, "operation_ids", failing) as publish:
        publish("told-4", None, {"session_id": "s4"})
    assert fallback.flush(5)
    assert fallback.messages == [(TASK, {"operation_ids": ["told-4"], "session_id": "s4"})]


def test_a_submit_returns_before_its_message_is_published(settings):
    """The committed row is the accepted intent: a submit handing its item to the sender
    does not wait for the broker. `flush` waits for the sender, and then the message is
    there."""
    publisher = RecordingPublisher(settings, delay_s=0.5)
    started = time.monotonic()
    _submit(publisher, "op-1")
    assert time.monotonic() - started < 0.4
    assert publisher.messages == []
    assert publisher.flush(5)
    assert publisher.messages == [(TASK, {"operation_ids": ["op-1"]})]


def test_a_burst_shares_messages_beyond_the_number_of_submitting_threads(settings):
    """Four threads submitting back to back: while a message is on its way, the items of
    the next submits gather, so messages carry more than four items (at most
    COALESCE_MAX_ITEMS), and every item is in exactly one of them."""
    publisher = RecordingPublisher(settings, delay_s=0.02)

    def submit_many(t):
        for i in range(25):
            _submit(publisher, f"op-{t}-{i}")

    threads = [threading.Thread(target=submit_many, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert publisher.flush(10)
    sizes = [len(kwargs["operation_ids"]) for _task, kwargs in publisher.messages]
    published = [item for _task, kwargs in publisher.messages for item in kwargs["operation_ids"]]
    assert sorted(published) == sorted(f"op-{t}-{i}" for t in range(4) for i in range(25))
    assert max(sizes) > 4 and max(sizes) <= COALESCE_MAX_ITEMS
    assert len(publisher.messages) < 100 / 4


def test_close_publishes_what_the_sender_still_holds(settings):
    publisher = RecordingPublisher(settings, delay_s=0.2)
    for i in range(3):
        _submit(publisher, f"op-{i}")
    publisher.close()
    published = [item for _task, kwargs in publisher.messages for item in kwargs["operation_ids"]]
    assert sorted(published) == ["op-0", "op-1", "op-2"]


def test_a_failed_message_leaves_its_items_to_the_sweeper_and_holds_nobody_up(settings, caplog):
    publisher = RecordingPublisher(settings, fail=True, delay_s=0)
    _submit(publisher, "op-1")
    assert publisher.flush(5)  # settled: failed, not waiting
    assert publisher.messages == []
    # the fault's class is named: a connection lost mid-publish may carry no text at all
    assert "(ConnectionError: broker unreachable); the sweeper will publish it" in caplog.text
    publisher.fail = False
    _submit(publisher, "op-2")
    assert publisher.flush(5)
    assert publisher.messages == [(TASK, {"operation_ids": ["op-2"]})]


def test_when_the_broker_fails_the_waiting_items_go_to_the_sweeper_at_once(settings):
    """Once a message failed (after its retries), the rest of its batch is left to the
    sweeper too: an outage does not make the sender wait out the retries once per
    COALESCE_MAX_ITEMS items while the items pile up. Three messages' worth of items wait
    while the first publish fails: one more attempt, not three."""
    publisher = RecordingPublisher(settings, fail=True, delay_s=0.3)
    _submit(publisher, "first")
    for i in range(COALESCE_MAX_ITEMS * 3):
        _submit(publisher, f"op-{i}")
    assert publisher.flush(10)
    assert publisher.messages == []
    assert len(publisher.attempt_threads) <= 2


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_sender_killed_by_an_unexpected_error_leaves_nothing_waiting(settings):
    """An error no publish expects ends the sender thread: its items are reported
    unpublished (the sweeper's), `flush` does not wait for them, and the next item starts
    a new sender."""

    class Broken(_Recorder):
        broken = True

        def publish_after_commit(self, task_name, kwargs, label=None):
            if self.broken:
                raise SystemError("a bug")
            return super().publish_after_commit(task_name, kwargs, label)

    publisher = RecordingPublisher(settings, delay_s=0)
    publisher.publisher = Broken(settings, publisher)
    assert publisher.publish_coalesced(TASK, "operation_ids", "op-1") is False
    assert publisher.flush(1)
    publisher.publisher.broken = False
    assert publisher.publish_coalesced(TASK, "operation_ids", "op-2") is True
    assert publisher.messages == [(TASK, {"operation_ids": ["op-2"]})]


def test_the_sender_thread_ends_when_idle(settings):
    publisher = RecordingPublisher(settings, delay_s=0)
    publisher.sender_idle_s = 0.05

    def senders():
        return {t for t in threading.enumerate() if t.name == "agent-radar-publisher"}

    others = senders()  # of earlier tests' publishers
    _submit(publisher, "op-1")
    assert publisher.flush(5)
    mine = senders() - others
    assert len(mine) == 1
    eventually(lambda: not any(t.is_alive() for t in mine), timeout_s=5, what="the sender to end")
    _submit(publisher, "op-2")  # a new one starts for the next item
    assert publisher.flush(5)
    assert [kwargs["operation_ids"] for _task, kwargs in publisher.messages] == [["op-1"], ["op-2"]]


def test_a_forked_child_publishes_none_of_its_parents_items(settings):
    """Items waiting at a fork are the parent's: its sender publishes them, the child's
    flush has nothing to wait for, and the child's own items still go out."""
    publisher = RecordingPublisher(settings, delay_s=0.3)
    _submit(publisher, "parent-1")
    _submit(publisher, "parent-2")  # waits while the first message is on its way
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only
        code = 0
        try:
            if not publisher.flush(0.01):
                code = 1
            elif any("parent-2" in kwargs["operation_ids"] for _t, kwargs in publisher.messages):
                code = 2
            else:
                publisher.delay_s = 0
                _submit(publisher, "child-1")
                if not publisher.flush(5) or publisher.messages[-1][1] != {
                    "operation_ids": ["child-1"]
                }:
                    code = 3
        finally:
            os._exit(code)
    _pid, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert publisher.flush(5)
    published = [item for _task, kwargs in publisher.messages for item in kwargs["operation_ids"]]
    assert sorted(published) == ["parent-1", "parent-2"]


def test_a_process_that_ends_without_close_publishes_its_items(settings):
    """A script or a CLI command may submit and exit: the items its sender still holds are
    published at exit, to the real broker."""
    script = textwrap.dedent(
        """
        import time
        from agent_radar.workflows.adapters.publisher import TaskPublisher
        from agent_radar.workflows.adapters.config import Settings
        from agent_radar.workflows.client.coalescing import Coalescer, _Waiting

        coalescer = Coalescer(TaskPublisher(Settings.from_env()))
        original = coalescer.publisher.publish

        def slow(*args, **kwargs):
            time.sleep(0.3)  # still on its way when the script ends
            return original(*args, **kwargs)

        coalescer.publisher.publish = slow
        for i in range(3):
            with coalescer.coalescing("agent_radar.goal.dispatch", "operation_ids") as add:
                add(f"op-{i}")
        """
    )
    env = {**os.environ, **settings.to_env()}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert _queued_items(settings) == ["op-0", "op-1", "op-2"]


def _queued_items(settings) -> list[str]:
    from agent_radar.workflows.adapters.broker import broker_connection, queue_named

    queue = queue_named(settings, "default")
    items = []
    with broker_connection(settings) as conn:
        while (message := queue(conn.default_channel).get(no_ack=True)) is not None:
            items.extend(message.decode()[1]["operation_ids"])
    return sorted(items)


def test_a_label_shows_beside_the_arguments_of_a_real_message(settings):
    """Flower and the worker log show kwargsrepr: a dispatch message carries the workspace,
    session and client submit ID an operator knows it by."""
    from agent_radar.workflows.adapters.broker import broker_connection, queue_named

    publisher = TaskPublisher(settings)
    try:
        publisher.publish(TASK, {"operation_id": "op-9"}, label="acme/s1 submit=req-9")
    finally:
        publisher.close()
    queue = queue_named(settings, "default")
    with broker_connection(settings) as conn:
        message = None
        for _ in range(50):
            message = queue(conn.default_channel).get(no_ack=True)
            if message is not None:
                break
            time.sleep(0.1)
    assert message is not None
    assert message.headers["kwargsrepr"] == "[acme/s1 submit=req-9] {'operation_id': 'op-9'}"
    assert message.decode()[1] == {"operation_id": "op-9"}  # the arguments themselves unchanged


@pytest.mark.parametrize("backend", ["production"])
def test_a_redis_publisher_keeps_one_client_for_its_messages(settings, monkeypatch):
    """kombu's Redis channel would build a redis-py client (0.14 ms of CPU) for every
    command; the publisher's channel keeps one for the message and its task-sent event,
    and the messages still land under the key prefix of the deployment."""
    import redis

    from tests.helpers import queue_depth

    built = []
    original = redis.Redis.__init__

    def counting(self, *args, **kwargs):
        built.append(1)
        original(self, *args, **kwargs)

    monkeypatch.setattr(redis.Redis, "__init__", counting)
    publisher = TaskPublisher(settings)
    try:
        publisher.publish(TASK, {"operation_id": "op-0"})
        after_first = len(built)  # the channel's clients: its event loop's and the kept one
        for i in range(1, 6):
            publisher.publish(TASK, {"operation_id": f"op-{i}"})
    finally:
        publisher.close()
    monkeypatch.undo()
    assert after_first <= 2 and len(built) == after_first
    assert queue_depth(settings) == 6

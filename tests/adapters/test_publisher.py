"""The task publisher (workflows/adapters/publisher.py): a message now, or shared: the
submits of one process hand their items to a sender thread and return; the sender gives a
burst of them a few messages, and every item is in exactly one message (or is left
unpublished, for the sweeper)."""

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from agent_radar.workflows.adapters import publisher as publisher_module
from agent_radar.workflows.adapters.publisher import TaskPublisher
from agent_radar.workflows.task_names import COALESCE_MAX_ITEMS
from tests.helpers import eventually

TASK = "agent_radar.goal.dispatch"


def _ids(items):
    return {"operation_ids": list(items)}


class RecordingPublisher(TaskPublisher):
    """A publisher that records its messages instead of sending them; slow, so concurrent
    callers pile up. Besides the messages that went out, it records the thread of every
    publish attempt, failed ones too (`attempt_threads`), and sets `began` when the first
    one starts."""

    def __init__(self, settings, fail=False, delay_s=0.05):
        super().__init__(settings)
        self.messages = []
        self.labels = []
        self.attempt_threads = []
        self.began = threading.Event()
        self.fail = fail
        self.delay_s = delay_s

    def publish(self, task_name, kwargs=None, label=None):
        self.attempt_threads.append(threading.current_thread())
        self.began.set()
        time.sleep(self.delay_s)
        if self.fail:
            raise ConnectionError("broker unreachable")
        self.messages.append((task_name, kwargs))
        self.labels.append(label)
        return "task-id"

    def items(self):
        return [item for _task, kwargs in self.messages for item in kwargs["operation_ids"]]


def _submit(publisher, item, label=None, pack=_ids, divert=None):
    """A submit whose transaction has committed: its item goes to the sender."""
    publisher.share(TASK, item, label, pack, divert)


def _submit_concurrently(publisher, count):
    barrier = threading.Barrier(count)

    def submit(i):
        barrier.wait()
        _submit(publisher, f"op-{i}")

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert publisher.flush(10)


def test_concurrent_items_share_messages_and_each_is_published_once(settings):
    publisher = RecordingPublisher(settings)
    _submit_concurrently(publisher, 8)
    assert sorted(publisher.items()) == sorted(f"op-{i}" for i in range(8))
    assert {task for task, _kwargs in publisher.messages} == {TASK}
    assert len(publisher.messages) < 8


def test_a_lone_item_is_published_at_once_in_its_own_message(settings):
    publisher = RecordingPublisher(settings)
    _submit(publisher, "only")
    assert publisher.flush(5)
    assert publisher.messages == [(TASK, {"operation_ids": ["only"]})]


def test_a_failed_message_publishes_none_of_its_items(settings):
    publisher = RecordingPublisher(settings, fail=True)
    _submit_concurrently(publisher, 4)
    assert publisher.messages == [] and publisher.attempt_threads


def test_a_shared_items_label_reaches_its_message(settings):
    publisher = RecordingPublisher(settings, delay_s=0)
    _submit(publisher, "op-1", "acme/s1 submit=req-1")
    assert publisher.flush(5)
    assert publisher.labels == ["acme/s1 submit=req-1"]


def test_pack_gives_a_message_its_arguments_from_the_items_it_carries(settings):
    """A message of one item may say more than a shared one (the dispatch message of a lone
    goal operation names its session: client/goals.py)."""

    def pack(items):
        if len(items) == 1:
            return {"operation_ids": [items[0][0]], "session_id": items[0][1]}
        return {"operation_ids": [op for op, _sid in items]}

    publisher = RecordingPublisher(settings, delay_s=0.3)
    _submit(publisher, ("op-1", "s1"), pack=pack)
    assert publisher.began.wait(5)
    _submit(publisher, ("op-2", "s2"), pack=pack)  # these two wait while op-1's goes out
    _submit(publisher, ("op-3", "s3"), pack=pack)
    assert publisher.flush(5)
    assert publisher.messages == [
        (TASK, {"operation_ids": ["op-1"], "session_id": "s1"}),
        (TASK, {"operation_ids": ["op-2", "op-3"]}),
    ]


def test_a_submit_behind_a_message_on_its_way_hands_its_item_to_the_sender(settings):
    """While a submit's message is on its way, the next submit does not wait for the
    broker: it hands its item over and returns, and the sender publishes it after."""
    publisher = RecordingPublisher(settings, delay_s=0.4)
    _submit(publisher, "op-1")
    assert publisher.began.wait(5)
    started = time.monotonic()
    _submit(publisher, "op-2")
    assert time.monotonic() - started < 0.3
    assert publisher.flush(5)
    assert publisher.messages == [
        (TASK, {"operation_ids": ["op-1"]}),
        (TASK, {"operation_ids": ["op-2"]}),
    ]


def test_a_divert_takes_items_out_of_their_message_and_what_it_leaves_goes_by_message(settings):
    """A divert (goal operations notified to workers that pull) gets every item of a
    message about to be sent; what it delivered is not published, and a message it left
    empty is not sent."""
    seen = []

    def divert(items):
        seen.append(list(items))
        return [item for item in items if not item.startswith("told")]

    shared = RecordingPublisher(settings, delay_s=0.3)
    _submit(shared, "first")
    assert shared.began.wait(5)
    _submit(shared, "told-1", divert=divert)
    _submit(shared, "op-2", divert=divert)
    assert shared.flush(5)
    assert seen == [["told-1", "op-2"]]
    assert shared.messages == [(TASK, _ids(["first"])), (TASK, _ids(["op-2"]))]

    alone = RecordingPublisher(settings, delay_s=0)
    _submit(alone, "told-3", divert=divert)
    assert alone.flush(5) and alone.messages == []


def test_a_submit_returns_before_its_message_is_published(settings):
    """The committed row is the accepted intent: a submit handing its item to the sender
    does not wait for the broker. `flush` waits for the sender, and then the message is
    there."""
    publisher = RecordingPublisher(settings, delay_s=0.5)
    started = time.monotonic()
    _submit(publisher, "op-1")
    assert time.monotonic() - started < 0.4
    assert publisher.messages == []
    assert not publisher.flush(0.05)
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
    assert sorted(publisher.items()) == sorted(f"op-{t}-{i}" for t in range(4) for i in range(25))
    assert max(sizes) > 4 and max(sizes) <= COALESCE_MAX_ITEMS
    assert len(publisher.messages) < 100 / 4


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
    """Once a message failed (after its retries), the rest of what waited is left to the
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


def test_a_sender_that_an_unexpected_error_cuts_short_leaves_nothing_waiting(settings, caplog):
    """An error no publish expects (a bug in a divert, say) is logged; the items it held
    are left to the sweeper, `flush` does not wait for them, and the next item goes out."""

    def broken(items):
        raise SystemError("a bug")

    publisher = RecordingPublisher(settings, delay_s=0)
    _submit(publisher, "op-1", divert=broken)
    assert publisher.flush(1)
    assert "SystemError: a bug" in caplog.text
    _submit(publisher, "op-2")
    assert publisher.flush(1)
    assert publisher.messages == [(TASK, {"operation_ids": ["op-2"]})]


def test_the_sender_thread_ends_when_idle(settings, monkeypatch):
    monkeypatch.setattr(publisher_module, "SENDER_IDLE_S", 0.05)
    publisher = RecordingPublisher(settings, delay_s=0)

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
    assert publisher.items() == ["op-1", "op-2"]


def test_a_forked_child_publishes_none_of_its_parents_items(settings):
    """Items waiting at a fork are the parent's: its sender publishes them, the child's
    flush has nothing to wait for, and the child's own items still go out."""
    publisher = RecordingPublisher(settings, delay_s=0.3)
    _submit(publisher, "parent-1")
    assert publisher.began.wait(5)
    _submit(publisher, "parent-2")  # waits while the first message is on its way
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only
        code = 0
        try:
            if not publisher.flush(0.01):
                code = 1
            elif "parent-2" in publisher.items():
                code = 2
            else:
                publisher.delay_s = 0
                _submit(publisher, "child-1")
                if not publisher.flush(5) or publisher.messages[-1][1] != _ids(["child-1"]):
                    code = 3
        finally:
            os._exit(code)
    _pid, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert publisher.flush(5)
    assert sorted(publisher.items()) == ["parent-1", "parent-2"]


def test_a_process_that_ends_without_close_publishes_its_items(settings):
    """A script or a CLI command may submit and exit: the items its sender still holds are
    published at exit, to the real broker."""
    script = textwrap.dedent(
        """
        import time
        from agent_radar.workflows.adapters.publisher import TaskPublisher
        from agent_radar.workflows.adapters.config import Settings

        publisher = TaskPublisher(Settings.from_env())
        original = publisher.publish

        def slow(*args, **kwargs):
            time.sleep(0.3)  # still on its way when the script ends
            return original(*args, **kwargs)

        publisher.publish = slow
        for i in range(3):
            publisher.share(
                "agent_radar.goal.dispatch", f"op-{i}", None, lambda ids: {"operation_ids": ids}
            )
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


def test_a_sender_thread_that_failed_to_start_strands_no_item(settings, monkeypatch):
    """A thread that cannot start ("can't start new thread") fails no submit (its row is
    committed); the next share or flush starts one, and every item goes out."""
    original = threading.Thread.start
    failures = []

    def start_failing_once(thread):
        if thread.name == "agent-radar-publisher" and not failures:
            failures.append(thread)
            raise RuntimeError("can't start new thread")
        return original(thread)

    monkeypatch.setattr(threading.Thread, "start", start_failing_once)
    publisher = RecordingPublisher(settings, delay_s=0)
    _submit(publisher, "op-1")
    assert failures and publisher.flush(2)
    _submit(publisher, "op-2")
    assert publisher.flush(2)
    assert sorted(publisher.items()) == ["op-1", "op-2"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_items_shared_while_a_base_exception_kills_the_sender_still_go_out(settings):
    entered, release = threading.Event(), threading.Event()
    killed = []

    def pack(items):
        if items == ["doomed"]:
            killed.append(threading.current_thread())
            entered.set()
            release.wait(5)
            raise SystemExit("killed")
        return _ids(items)

    publisher = RecordingPublisher(settings, delay_s=0)
    _submit(publisher, "doomed", pack=pack)
    assert entered.wait(5)
    _submit(publisher, "op-2", pack=pack)  # waits while the sender is in pack
    release.set()
    killed[0].join(5)
    assert publisher.flush(2)
    assert publisher.items() == ["op-2"]


def test_an_unhashable_item_is_published_with_its_label(settings):
    publisher = RecordingPublisher(settings, delay_s=0)
    _submit(publisher, {"op": "op-1"}, "submit=a")
    assert publisher.flush(5)
    assert publisher.messages == [(TASK, {"operation_ids": [{"op": "op-1"}]})]
    assert publisher.labels == ["submit=a"]


def test_the_end_of_the_process_waits_about_flush_timeout_in_all(settings, monkeypatch):
    """However many publishers hold items a broker that hangs keeps, the process's end waits
    FLUSH_TIMEOUT_S in all, not that long for each."""
    monkeypatch.setattr(publisher_module, "FLUSH_TIMEOUT_S", 0.5)
    stuck = threading.Event()

    class Stuck(RecordingPublisher):
        def publish(self, task_name, kwargs=None, label=None):
            stuck.wait(30)
            return super().publish(task_name, kwargs, label)

    publishers = [Stuck(settings, delay_s=0) for _ in range(4)]
    for publisher in publishers:
        _submit(publisher, "op")
    started = time.monotonic()
    publisher_module._flush_at_exit()
    elapsed = time.monotonic() - started
    stuck.set()
    assert all(p.flush(5) for p in publishers)
    assert elapsed < 1.5, elapsed  # 2 s, had each waited its own

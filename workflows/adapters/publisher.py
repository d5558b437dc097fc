"""The task publisher (the publish port's adapter): Celery protocol v2 task messages sent with
kombu — the same wire format any producer in any language uses (README.md) — so the client,
the sweeper and the simulator share one small publisher. `workflows/` never imports Celery.
"""

import atexit
import logging
import math
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..task_names import COALESCE_MAX_ITEMS, SHOWN_WHEN_EFFECTIVE
from .broker import broker_connection, kombu_queues, queue_for
from .config import Settings
from .sent_events import SentEvents

log = logging.getLogger(__name__)

# A coalesced message waits at most this long for submits of this process that are still in
# their transaction, so that they share it.
COALESCE_LINGER_S = 0.005
# The publisher's sender thread ends after this long without items; the next item starts
# another. A process that stops submitting keeps no thread, nor the publisher, alive.
SENDER_IDLE_S = 1.0
# How long closing a publisher, or the end of its process, waits for items handed to the
# sender. Past it the items stay unpublished: their committed rows are the outbox, and the
# sweeper publishes them.
FLUSH_TIMEOUT_S = 10.0


class TaskPublisher:
    """Publishes Celery protocol v2 task messages; one connection per process, thread-safe."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._pid = None
        self._connection = None
        self._producer = None
        self._exchanges = {q.name: q for q in kombu_queues(settings)}
        self._events: SentEvents | None = None
        self._fresh_state()
        self.linger_s = COALESCE_LINGER_S
        self.sender_idle_s = SENDER_IDLE_S
        # Whether a lone submit publishes its own message (see `coalescing`).
        self.lone_publishes = True
        _LIVE.add(self)
        # On kombu's emulated transports (Redis, the filesystem) a publish through a named
        # exchange first reads the exchange's bindings from the broker (one more round trip,
        # docs/benchmarks.md); the default exchange names the queue directly. On
        # RabbitMQ the exchange routes (and Celery's delayed delivery needs it).
        self._by_queue_name = not settings.is_amqp_broker

    def _ensure(self):
        if self._pid != os.getpid() or self._producer is None:
            self._connection = broker_connection(self.settings)
            self._producer = self._connection.Producer()
            self._events = SentEvents(self._connection)
            self._pid = os.getpid()
        return self._producer

    def publish(
        self,
        task_name: str,
        kwargs: dict[str, Any] | None = None,
        queue: str | None = None,
        label: str | None = None,
    ) -> str:
        """Publish one task message. `label` (e.g. the workspace, session and client submit
        ID an internal message is about) is shown before the arguments in Flower and the
        worker log, so an operator finds the message by what the client knows."""
        kwargs = kwargs or {}
        queue_name = queue or queue_for(task_name)
        target = self._exchanges[queue_name]
        task_id = str(uuid.uuid4())
        # The label first: Flower's task list shows the start of a long argument list.
        kwargsrepr = ((f"[{label}] " if label else "") + repr(kwargs))[:1024]
        headers = {
            "lang": "py",
            "task": task_name,
            "id": task_id,
            "shadow": None,
            "eta": None,
            "expires": None,
            "group": None,
            "group_index": None,
            "retries": 0,
            "timelimit": [None, None],
            "root_id": task_id,
            "parent_id": None,
            "argsrepr": "()",
            "kwargsrepr": kwargsrepr,
            "origin": "agent-radar",
            "ignore_result": True,
        }
        body: tuple[list[Any], dict[str, Any], dict[str, None]] = (
            [],
            kwargs,
            {"callbacks": None, "errbacks": None, "chain": None, "chord": None},
        )
        with self._lock:
            producer = self._ensure()
            # The event's time is when the publish began: on RabbitMQ the publish returns
            # once the broker confirms it, and a worker may have received the message by
            # then (Flower would show it received before it was sent).
            sent_at = time.time()
            producer.publish(
                body,
                exchange="" if self._by_queue_name else target.exchange,
                routing_key=target.name if self._by_queue_name else target.routing_key,
                serializer="json",
                headers=headers,
                correlation_id=task_id,
                delivery_mode=2,
                declare=[target],
                retry=True,
                retry_policy={
                    "max_retries": 3,
                    "interval_start": 0.1,
                    "interval_step": 0.5,
                    "interval_max": 2,
                },
            )
            assert self._events is not None
            if task_name not in SHOWN_WHEN_EFFECTIVE:
                self._events.task_sent(producer, task_id, task_name, kwargsrepr, target, sent_at)
        return task_id

    def publish_after_commit(
        self, task_name: str, kwargs: dict[str, Any], label: str | None = None
    ) -> bool:
        """Publish an already-committed intent. The row is the outbox: if this fails the
        sweeper publishes it later, so a failure is logged, never raised."""
        try:
            self.publish(task_name, kwargs, label=label)
            return True
        except Exception as exc:  # noqa: BLE001 - any broker fault leaves it to the sweeper
            log.warning(
                "publish of %s %s failed (%s: %s); the sweeper will publish it",
                task_name,
                kwargs,
                exc.__class__.__name__,  # a connection lost mid-publish may say nothing more
                exc,
            )
            self._release()
            return False

    def _fresh_state(self) -> None:
        """The publish lock, and the coalescing state (see `coalescing`), all of it this
        process's and guarded by `_changed`: items waiting for a message, per (task, list
        argument); how many submits are still in their transaction; how many items are
        handed over (or being published by their own submit) and not yet published or
        failed; whether the sender thread runs; whether the last message went out; and when
        the last submit began."""
        self._lock = threading.Lock()
        self._changed = threading.Condition()
        self._waiting: dict[_Key, list[_Waiting]] = {}
        self._submitting = 0
        self._pending = 0
        self._sending = False
        self._published_last = True
        self._last_began = -math.inf

    def _after_fork(self) -> None:
        """A forked child starts with fresh locks (one a parent's thread held at the fork
        would stay held) and no items: those waiting are its parent's, whose sender
        publishes them. Its connection is its own too (`_ensure`)."""
        self._fresh_state()

    @contextmanager
    def coalescing(
        self, task_name: str, list_kwarg: str, divert: "Divert | None" = None
    ) -> Iterator[Callable[..., None]]:
        """Wrap a submit that may publish one item in the list argument `list_kwarg` of a
        `task_name` message: the block commits, then calls the yielded function with its
        item (and its label, see `publish`). Leaving the block hands the item to this
        process's sender thread and returns at once: the committed row is the accepted
        intent, and the sender publishes it with the items of this process's other submits
        at that moment, so a burst of submits costs a few messages, not one each. An item
        may come with `alone`, more arguments for a message that carries it alone (what
        saves its consumer a read, for example), left out of a shared one. While the
        block runs, the sender waits briefly (COALESCE_LINGER_S) for its item. A failed
        message is logged and left to the sweeper, its rows being the outbox; `flush` waits
        for the sender.

        `divert(pairs of (item, alone))`, before a message is sent, returns the items it
        delivered otherwise (docs/dispatch.md: pulling); the message carries the rest, if any.

        A lone submit (none other of this process began within COALESCE_LINGER_S before it or
        is in its transaction, no message on its way or waiting) has nothing to share its
        message with: it publishes the message itself before it returns, rather than wait
        for the hand-over to the sender thread. Submits that follow each other closer than
        that (a producer under load) keep sharing messages through the sender. A lone
        submit publishes itself only while the last message went out: once one failed (the
        broker is down, most likely), submits hand over and return at once until one goes
        out again."""
        key = (task_name, list_kwarg, divert)
        mine: list[_Waiting] = []
        with self._changed:
            self._submitting += 1
            began = time.monotonic()
            spaced = began - self._last_began >= self.linger_s
            self._last_began = began

        def add(item: Any, label: str | None = None, alone: dict[str, Any] | None = None) -> None:
            mine.append(_Waiting(item, label, alone))

        def leave(alone_may_publish: bool) -> bool:
            with self._changed:
                self._submitting -= 1
                alone = bool(
                    alone_may_publish
                    and spaced
                    and self.lone_publishes
                    and mine
                    and not self._submitting
                    and not self._pending
                    and not self._waiting
                    and self._published_last
                )
                if alone:
                    self._pending += len(mine)
                else:
                    for waiting in mine:
                        self._hand_over(key, waiting)
                    self._changed.notify_all()
            return alone

        try:
            yield add
        except BaseException:
            leave(alone_may_publish=False)  # an item already added still goes out
            raise
        if leave(alone_may_publish=True):
            self._publish_batch(key, mine)

    def publish_coalesced(self, task_name: str, list_kwarg: str, item: Any) -> bool:
        """Hand `item` to the sender (see `coalescing`) and wait for its message: True once
        published, False if that failed (logged; the committed row is the outbox)."""
        mine = _Waiting(item)
        with self._changed:
            self._hand_over((task_name, list_kwarg, None), mine)
            self._changed.notify_all()
            while mine.published is None:
                self._changed.wait()
        return mine.published

    def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
        """Wait until every item this process handed to the sender is published or failed;
        False if some still wait after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self._pending and (left := deadline - time.monotonic()) > 0:
                self._changed.wait(left)
            return not self._pending

    def _hand_over(self, key: "_Key", waiting: "_Waiting") -> None:
        # The caller holds `_changed` and notifies.
        self._waiting.setdefault(key, []).append(waiting)
        self._pending += 1
        if not self._sending:
            self._sending = True
            threading.Thread(target=self._send, name="agent-radar-publisher", daemon=True).start()

    def _send(self) -> None:
        """The sender thread: publishes what is waiting, a message per COALESCE_MAX_ITEMS
        items of one key, until it has had nothing to do for `sender_idle_s`."""
        try:
            while (work := self._next_batch()) is not None:
                self._publish_batch(*work)
        except BaseException:
            # Whatever killed it, the next item starts another sender.
            with self._changed:
                self._sending = False
            raise

    def _next_batch(self) -> tuple["_Key", list["_Waiting"]] | None:
        with self._changed:
            idle_until = time.monotonic() + self.sender_idle_s
            while not self._waiting:
                left = idle_until - time.monotonic()
                if left <= 0:
                    self._sending = False
                    return None
                self._changed.wait(left)
            key = next(iter(self._waiting))
            # Submits still in their transaction get a moment to join this message.
            linger_until = time.monotonic() + self.linger_s
            while (
                self._submitting
                and len(self._waiting[key]) < COALESCE_MAX_ITEMS
                and (left := linger_until - time.monotonic()) > 0
            ):
                self._changed.wait(left)
            return key, self._waiting.pop(key)

    def _publish_batch(self, key: "_Key", batch: list["_Waiting"]) -> None:
        """A message per COALESCE_MAX_ITEMS items, of those the key's divert did not take.
        Once one failed (after its retries), the rest are left to the sweeper too, rather
        than each waiting out the retries; so is the rest of a batch that an unexpected error
        cut short."""
        task_name, list_kwarg, divert = key
        settled = 0
        rest = batch
        try:
            if divert is not None:
                rest = self._divert(divert, batch)
            for start in range(0, len(rest), COALESCE_MAX_ITEMS):
                chunk = rest[start : start + COALESCE_MAX_ITEMS]
                labels = "; ".join(w.label for w in chunk if w.label)
                kwargs = {list_kwarg: [w.item for w in chunk]}
                if len(chunk) == 1 and chunk[0].alone:
                    kwargs |= chunk[0].alone
                ok = self.publish_after_commit(task_name, kwargs, labels or None)
                self._settle(chunk, ok)
                settled += len(chunk)
                if not ok:
                    break
        finally:
            self._settle(rest[settled:], False)

    def _divert(self, divert: "Divert", batch: list["_Waiting"]) -> list["_Waiting"]:
        """Settle what `divert` delivers of `batch`; the rest, for messages."""
        try:
            taken = divert([(w.item, w.alone) for w in batch])
        except Exception as exc:  # noqa: BLE001 - the messages carry them all
            log.warning("%d items go by message: %s: %s", len(batch), type(exc).__name__, exc)
            return batch
        self._settle([w for w in batch if w.item in taken], True, sent=False)
        return [w for w in batch if w.item not in taken]

    def _settle(self, items: list["_Waiting"], published: bool, sent: bool = True) -> None:
        """Items published (or delivered otherwise: not `sent`, which says nothing of the
        broker) or failed."""
        with self._changed:
            if items and sent:
                self._published_last = published
            for waiting in items:
                waiting.published = published
            self._pending -= len(items)
            self._changed.notify_all()

    def close(self) -> None:
        """Publish what the sender still holds (see `flush`), then drop the connection."""
        self.flush()
        self._release()

    def _release(self) -> None:
        with self._lock:
            if self._connection is not None and self._pid == os.getpid():
                try:
                    self._connection.release()
                except Exception:  # noqa: BLE001 - closing a broken connection
                    pass
            self._connection = self._producer = None


# Every publisher of this process: its exit publishes what their senders still hold (a
# short-lived process, a CLI command or a script, may submit and end without `close()`),
# and a forked child resets them.
_LIVE: "weakref.WeakSet[TaskPublisher]" = weakref.WeakSet()


@atexit.register
def _flush_at_exit() -> None:
    for publisher in list(_LIVE):
        publisher.flush()


def _reset_after_fork() -> None:
    for publisher in list(_LIVE):
        publisher._after_fork()


os.register_at_fork(after_in_child=_reset_after_fork)


# A coalescing's divert (see `coalescing`); its key: (task, list argument, divert).
Divert = Callable[[list[tuple[Any, dict[str, Any] | None]]], set[Any]]
_Key = tuple[str, str, Divert | None]


class _Waiting:
    __slots__ = ("item", "label", "alone", "published")

    def __init__(
        self, item: Any, label: str | None = None, alone: dict[str, Any] | None = None
    ) -> None:
        self.item = item
        self.label = label
        self.alone = alone  # more arguments for a message of this item alone
        self.published: bool | None = None

"""Shared dispatch messages (docs/dispatch.md): the goal submits of one process hand their
items to a sender thread and return; the sender gives a burst of them a few messages (or one
notifying statement: a `divert`), and every item is in exactly one message or is reported
unpublished, for the sweeper (its committed row is the outbox). The messages go through the
process's TaskPublisher (adapters/publisher.py), which only publishes."""

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..adapters.publisher import TaskPublisher
from ..task_names import COALESCE_MAX_ITEMS

log = logging.getLogger(__name__)

# A coalesced message waits at most this long for submits of this process that are still in
# their transaction, so that they share it.
COALESCE_LINGER_S = 0.005
# The sender thread ends after this long without items; the next item starts another. A
# process that stops submitting keeps no thread, nor the coalescer, alive.
SENDER_IDLE_S = 1.0
# How long closing a coalescer, or the end of its process, waits for items handed to the
# sender. Past it the items stay unpublished: their committed rows are the outbox, and the
# sweeper publishes them.
FLUSH_TIMEOUT_S = 10.0


class Coalescer:
    """Shares messages among the submits of this process (see `coalescing`); thread-safe."""

    def __init__(self, publisher: TaskPublisher) -> None:
        self.publisher = publisher
        self._fresh_state()
        self.linger_s = COALESCE_LINGER_S
        self.sender_idle_s = SENDER_IDLE_S
        _LIVE.add(self)

    def _fresh_state(self) -> None:
        """The coalescing state (see `coalescing`), all of it this process's and guarded by
        `_changed`: items waiting for a message, per (task, list argument); how many submits
        are still in their transaction; how many items are handed over and not yet published
        or failed; whether the sender thread runs. A forked child starts with a fresh lock
        (one a parent's thread held at the fork would stay held) and no items: those waiting
        are its parent's, whose sender publishes them."""
        self._changed = threading.Condition()
        self._waiting: dict[_Key, list[_Waiting]] = {}
        self._submitting = 0
        self._pending = 0
        self._sending = False

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
        for the sender. An item added before the block failed still goes out.

        `divert(pairs of (item, alone))`, before a message is sent, returns the items it
        delivered otherwise (docs/dispatch.md: pulling); the message carries the rest, if any."""
        key = (task_name, list_kwarg, divert)
        mine: list[_Waiting] = []
        with self._changed:
            self._submitting += 1

        def add(item: Any, label: str | None = None, alone: dict[str, Any] | None = None) -> None:
            mine.append(_Waiting(item, label, alone))

        try:
            yield add
        finally:
            with self._changed:
                self._submitting -= 1
                for waiting in mine:
                    self._hand_over(key, waiting)
                self._changed.notify_all()

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
                ok = self.publisher.publish_after_commit(task_name, kwargs, labels or None)
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
        self._settle([w for w in batch if w.item in taken], True)
        return [w for w in batch if w.item not in taken]

    def _settle(self, items: list["_Waiting"], published: bool) -> None:
        """Items published or failed."""
        with self._changed:
            for waiting in items:
                waiting.published = published
            self._pending -= len(items)
            self._changed.notify_all()

    def close(self) -> None:
        """Publish what the sender still holds (see `flush`), then drop the connection."""
        self.flush()
        self.publisher.close()


# Every coalescer of this process: its exit publishes what their senders still hold (a
# short-lived process, a CLI command or a script, may submit and end without `close()`),
# and a forked child resets them.
_LIVE: "weakref.WeakSet[Coalescer]" = weakref.WeakSet()


@atexit.register
def _flush_at_exit() -> None:
    for coalescer in list(_LIVE):
        coalescer.flush()


def _reset_after_fork() -> None:
    for coalescer in list(_LIVE):
        coalescer._fresh_state()


os.register_at_fork(after_in_child=_reset_after_fork)


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

"""The task publisher (the publish port's adapter): Celery protocol v2 task messages sent with
kombu, the wire format any producer in any language uses (README.md), so that `workflows/`
never imports Celery. A message goes out now (`publish`), or later from the process's sender
thread, shared with the items of other submits that wait then (`share`, docs/dispatch.md)."""

import atexit
import contextlib
import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any

from ..task_names import COALESCE_MAX_ITEMS, SHOWN_WHEN_EFFECTIVE
from .broker import broker_connection, kombu_queues, queue_for
from .config import Settings
from .sent_events import SentEvents

log = logging.getLogger(__name__)

# What every message of ours says alike: no ETA, expiry, group, parent or time limit.
_HEADERS: dict[str, Any] = dict.fromkeys(("shadow", "eta", "expires", "group", "group_index"))
_HEADERS |= {"parent_id": None, "lang": "py", "retries": 0, "timelimit": [None, None]}
_HEADERS |= {"argsrepr": "()", "origin": "agent-radar", "ignore_result": True}
_NO_CANVAS = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
_RETRY = {"max_retries": 3, "interval_start": 0.1, "interval_step": 0.5, "interval_max": 2}
# How long `flush` and the process's end wait; what still waits then is the sweeper's.
FLUSH_TIMEOUT_S = 10.0
# The sender thread ends after this long without items; the next item starts another.
SENDER_IDLE_S = 1.0


class TaskPublisher:
    """Publishes Celery protocol v2 task messages; thread-safe, one connection per process."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._exchanges = {q.name: q for q in kombu_queues(settings)}
        self._by_pid: dict[int, _Process] = {}
        _LIVE.add(self)
        # On kombu's emulated transports (Redis, the filesystem) a named exchange costs a
        # read of its bindings per publish (docs/benchmarks.md); the default exchange names
        # the queue. On RabbitMQ the exchange routes (and Celery's delayed delivery needs it).
        self._by_queue_name = not settings.is_amqp_broker

    def _mine(self) -> "_Process":
        """This process's connection and sender (a forked child's own: the parent's locks)."""
        pid = os.getpid()
        return self._by_pid.get(pid) or self._by_pid.setdefault(pid, _Process())

    def publish(self, task_name: str, kwargs: dict, label: str | None = None) -> str:
        """Publish one task message. Its `label` (the workspace, session and client submit ID
        it is about) shows first in Flower and the worker log, before its arguments."""
        target = self._exchanges[queue_for(task_name)]
        task_id = str(uuid.uuid4())
        kwargsrepr = ((f"[{label}] " if label else "") + repr(kwargs))[:1024]
        headers = _HEADERS | {"task": task_name, "id": task_id, "root_id": task_id}
        mine = self._mine()
        with mine.lock:
            if mine.producer is None:
                mine.connection = broker_connection(self.settings)
                mine.producer = mine.connection.Producer()
                mine.events = SentEvents(mine.connection)
            # The event's time is when the publish began: a worker may have the message by
            # the time RabbitMQ confirms it (Flower would show it received before sent).
            sent_at = time.time()
            mine.producer.publish(
                ([], kwargs, _NO_CANVAS),
                exchange="" if self._by_queue_name else target.exchange,
                routing_key=target.name if self._by_queue_name else target.routing_key,
                serializer="json",
                headers=headers | {"kwargsrepr": kwargsrepr},
                correlation_id=task_id,
                delivery_mode=2,
                declare=[target],
                retry=True,
                retry_policy=_RETRY,
            )
            if task_name not in SHOWN_WHEN_EFFECTIVE:
                mine.events.task_sent(
                    mine.producer, task_id, task_name, kwargsrepr, target, sent_at
                )
        return task_id

    def publish_after_commit(self, task_name: str, kwargs: dict, label: str | None = None) -> bool:
        """Publish a committed intent; a failure is logged (with its class: a connection lost
        mid-publish may say nothing more), never raised: the row is the sweeper's outbox."""
        try:
            self.publish(task_name, kwargs, label=label)
            return True
        except Exception as exc:  # noqa: BLE001 - any broker fault leaves it to the sweeper
            fault = f"{task_name} {kwargs} failed ({type(exc).__name__}: {exc})"
            log.warning("publish of %s; the sweeper will publish it", fault)
            self.close()
            return False

    def share(self, task: str, item: Any, label: str | None, pack: Callable, divert=None) -> None:
        """Hand a committed submit's item to this process's sender thread, which publishes
        `task(**pack(items))` per COALESCE_MAX_ITEMS items of one (task, pack, divert), labels
        joined, once `divert(items)` returned those it did not deliver (docs/dispatch.md)."""
        mine = self._mine()
        with mine.changed:
            mine.waiting.setdefault((task, pack, divert), []).append((item, label))
            self._start(mine)
            mine.changed.notify_all()

    def _start(self, mine: "_Process") -> None:
        """Start the sender if none runs (under `changed`); else the next share or flush will."""
        try:
            if not mine.sending:
                name = "agent-radar-publisher"
                threading.Thread(target=self._send, args=(mine,), name=name, daemon=True).start()
                mine.sending = True
        except Exception as exc:  # noqa: BLE001 - "can't start new thread"
            log.warning("no sender thread (%s: %s); the items wait", type(exc).__name__, exc)

    def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
        """Wait until what this process shared is sent or left to the sweeper (False: not yet)."""
        mine = self._mine()
        with mine.changed:
            if mine.waiting:
                self._start(mine)  # a share could not start one
            return mine.changed.wait_for(lambda: not (mine.waiting or mine.busy), timeout_s)

    def close(self) -> None:
        """Drop this process's connection (the next publish opens another)."""
        mine = self._mine()
        with mine.lock:
            if mine.connection is not None:
                with contextlib.suppress(Exception):  # closing a broken connection
                    mine.connection.release()
            mine.connection = mine.producer = None

    def _send(self, mine: "_Process") -> None:
        """The sender thread: publishes what waits, until nothing has for SENDER_IDLE_S. If
        anything kills it, another takes what was shared meanwhile."""
        try:
            while True:
                with mine.changed:
                    mine.busy = False
                    mine.changed.notify_all()
                    if not mine.changed.wait_for(lambda: mine.waiting, SENDER_IDLE_S):
                        return
                    waiting, mine.waiting, mine.busy = mine.waiting, {}, True
                self._publish_waiting(waiting)
        finally:
            with mine.changed:
                mine.sending = mine.busy = False
                if mine.waiting:
                    self._start(mine)
                mine.changed.notify_all()

    def _publish_waiting(self, waiting: dict) -> None:
        """Once a message failed (after its retries), the rest are left to the sweeper."""
        try:
            for (task, pack, divert), batch in waiting.items():
                labels = {id(i): label for i, label in batch}  # an item may be unhashable
                items = divert([i for i, _ in batch]) if divert else [i for i, _ in batch]
                for start in range(0, len(items), COALESCE_MAX_ITEMS):
                    chunk = items[start : start + COALESCE_MAX_ITEMS]
                    label = "; ".join(filter(None, (labels.get(id(i)) for i in chunk))) or None
                    if not self.publish_after_commit(task, pack(chunk), label):
                        return
        except Exception:
            log.exception("the sweeper publishes what the sender held")


class _Process:
    """A process's connection (`lock`) and sender (`changed`): items waiting per key, whether
    its thread runs (`sending`) and publishes what it took (`busy`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.connection: Any = None
        self.producer: Any = None
        self.events: Any = None
        self.changed = threading.Condition()
        self.waiting: dict[tuple, list[tuple[Any, str | None]]] = {}
        self.sending = self.busy = False


# This process's publishers, flushed at its end: a script may submit and end without flush().
_LIVE: "weakref.WeakSet[TaskPublisher]" = weakref.WeakSet()


@atexit.register
def _flush_at_exit() -> None:
    deadline = time.monotonic() + FLUSH_TIMEOUT_S  # in all, however many publishers
    for publisher in list(_LIVE):
        publisher.flush(max(0.0, deadline - time.monotonic()))

"""A worker pool process's promise to pull (docs/dispatch.md: pulling): while its drain runs
and has room, the process holds a row in `goal_pullers` and LISTENs on a channel of its own;
a client that committed goal operations notifies such channels, naming the operations and
their sessions, instead of publishing a dispatch message, and the notified drain claims them
by name, as a message's dispatch does. PostgreSQL only.

Nothing is lost to a puller that dies or lets go at the wrong moment: the operation row is
the outbox, and any drain's next steal, or the sweeper after its outbox grace, takes what a
notification reached nobody for."""

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from sqlalchemy.engine import Engine

from ....models.db import run_transaction
from ....models.dialects import dialect_of
from ...goals.pullers import (
    FORGET_AFTER_S,
    FORGET_SQL,
    LET_GO_SQL,
    PROMISE_S,
    RENEW_S,
    RENEW_SQL,
    Named,
)

log = logging.getLogger(__name__)

# A puller whose connection failed connects again after this long, doubling up to
# RETRY_MAX_S; meanwhile its promise runs out and submits publish their messages.
RETRY_S = 0.5
RETRY_MAX_S = 10.0
# The listening connection finds a silently dead peer (a half-open TCP connection) within
# about this long, rather than waiting on it for the kernel's default of many minutes.
KEEPALIVE = {"keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2}
KEEPALIVE |= {"keepalives_count": 3, "tcp_user_timeout": 15_000}

# What a notification names: [(operation id, workspace id, session id)]; None: anything may
# be due (the puller connected again, and what was notified meanwhile reached nobody; or a
# notification that is not one of ours).
Notified = list[Named] | None


def notified(payload: str) -> Notified:
    """A notification's payload (workflows/goals/pullers.py), or None if it is not one."""
    try:
        value = json.loads(payload)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        return None
    if not isinstance(value, list) or not value:
        return None
    named: list[Named] = []
    for one in value:
        if not (isinstance(one, list) and len(one) == 3 and all(isinstance(v, str) for v in one)):
            return None
        named.append((one[0], one[1], one[2]))
    return named


class Puller:
    """The promise and its listening connection, in a thread of their own. `wake` is called
    (from that thread) with what each notification names, and with None once on each
    (re)connection."""

    def __init__(self, engine: Engine, wake: Callable[[Notified], None]) -> None:
        self.engine = engine
        self.wake = wake
        self.channel = f"agent_radar_pull_{uuid.uuid4().hex}"
        # Whether the promise is to be held (renewed) or let go (deleted, still listening).
        self.holding = True
        self._stopped = threading.Event()
        self.thread = threading.Thread(target=self._main, name="goal-pull", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Let go at once (the row deleted from the caller's thread: submits stop notifying
        this process now, not at the listening thread's next turn) and stop listening. Once:
        the drain's end stops it again."""
        if self._stopped.is_set():
            return
        self.holding = False
        self._stopped.set()
        try:
            run_transaction(
                self.engine,
                lambda s: s.connection().exec_driver_sql(LET_GO_SQL, {"channel": self.channel}),
            )
        except Exception:  # noqa: BLE001 - the database is away: the promise runs out
            pass

    def _main(self) -> None:
        retry_s = RETRY_S
        while not self._stopped.is_set():
            try:
                self._listen()
            except Exception as exc:  # noqa: BLE001 - the database is away: try again later
                log.warning(
                    "goal puller: its connection failed (%s: %s); submits publish dispatch "
                    "messages until it is back",
                    exc.__class__.__name__,
                    str(exc).splitlines()[0] if str(exc) else "",
                )
                if self._connected:
                    retry_s = RETRY_S
                self._stopped.wait(retry_s)
                retry_s = min(retry_s * 2, RETRY_MAX_S)

    _connected = False

    def _listen(self) -> None:
        self._connected = False
        conn: Any = dialect_of(self.engine).listening_connection(self.engine, **KEEPALIVE)
        held = False
        try:
            conn.execute(f'LISTEN "{self.channel}"')
            conn.execute(FORGET_SQL, {"after_s": FORGET_AFTER_S})
            self._connected = True
            self.wake(None)
            renew_at = 0.0
            while not self._stopped.is_set():
                if self.holding:
                    if time.monotonic() >= renew_at:
                        conn.execute(RENEW_SQL, {"channel": self.channel, "promise_s": PROMISE_S})
                        held, renew_at = True, time.monotonic() + RENEW_S
                elif held:
                    conn.execute(LET_GO_SQL, {"channel": self.channel})
                    held = False
                wait_s = max(0.0, renew_at - time.monotonic()) if self.holding else RENEW_S
                for notification in conn.notifies(timeout=wait_s):
                    self.wake(notified(notification.payload))
        finally:
            try:
                # (Stopped: stop() deleted it already.)
                if held and not conn.broken and not self._stopped.is_set():
                    conn.execute(LET_GO_SQL, {"channel": self.channel})
            finally:
                conn.close()

"""A worker pool process's promise to pull (docs/dispatch.md: pulling under load): while its
drain runs, the process holds a row in `goal_pullers` and LISTENs on a channel of its own;
a goal submit that sees a live promise notifies one such channel instead of publishing a
dispatch message, and the notified drain claims due work as a steal does. PostgreSQL only.

Nothing is lost to a puller that dies or lets go at the wrong moment: the operation row is
the outbox, and any drain's next steal, or the sweeper after its outbox grace, takes what a
notification reached nobody for."""

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from sqlalchemy.engine import Engine

from agent_radar.models.dialects import dialect_of
from agent_radar.workflows.goals.pullers import (
    FORGET_AFTER_S,
    FORGET_SQL,
    LET_GO_SQL,
    PROMISE_S,
    RENEW_S,
    RENEW_SQL,
)

log = logging.getLogger(__name__)

# A puller whose connection failed connects again after this long, doubling up to
# RETRY_MAX_S; meanwhile its promise runs out and submits publish their messages.
RETRY_S = 0.5
RETRY_MAX_S = 10.0


def pulls(engine: Engine) -> bool:
    """Whether a worker's drain on this database pulls (the database notifies)."""
    return dialect_of(engine).notifies


class Puller:
    """The promise and its listening connection, in a thread of their own. `wake` is called
    (from that thread) on each notification, and once on each (re)connection, when what was
    notified meanwhile reached nobody."""

    def __init__(self, engine: Engine, wake: Callable[[], None]) -> None:
        self.engine = engine
        self.wake = wake
        self.channel = f"agent_radar_pull_{uuid.uuid4().hex}"
        # Whether the promise is to be held (renewed) or let go (deleted, still listening).
        self.holding = True
        self._stopped = threading.Event()
        self.thread = threading.Thread(target=self._main, name="goal-pull", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def hold(self) -> None:
        self.holding = True

    def let_go(self) -> None:
        self.holding = False

    def stop(self) -> None:
        """Let go and stop listening (within RENEW_S)."""
        self.holding = False
        self._stopped.set()

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
                self._stopped.wait(retry_s)
                retry_s = min(retry_s * 2, RETRY_MAX_S)

    def _listen(self) -> None:
        conn: Any = dialect_of(self.engine).listening_connection(self.engine)
        held = False
        try:
            conn.execute(f'LISTEN "{self.channel}"')
            conn.execute(FORGET_SQL, {"after_s": FORGET_AFTER_S})
            self.wake()
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
                for _ in conn.notifies(timeout=wait_s):
                    self.wake()
        finally:
            try:
                if held and not conn.broken:
                    conn.execute(LET_GO_SQL, {"channel": self.channel})
            finally:
                conn.close()

"""An agent host's reports on their way out (host/agent_host.py): handed to the reporter in
order on a thread of their own, so that no call waits for the broker and one that stalls
holds up no call; and closed, after which nothing more goes out."""

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)
# The sender thread ends after this long with nothing to send; the next report starts another.
IDLE_S = 1.0

Reporter = Callable[[dict[str, Any]], Any]


class ReportSender:
    def __init__(self, reporter: Reporter) -> None:
        self.reporter = reporter
        self.closed = False
        self._queue: queue.SimpleQueue[dict] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._unsent = 0  # queued or being sent: what `close` waits for
        self._dropping = False

    def send(self, reports: list[dict]) -> None:
        """Queue signed reports, in order. After `close`, they are dropped."""
        with self._cond:
            if self.closed or not reports:
                return
            self._unsent += len(reports)
            for report in reports:
                self._queue.put(report)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._sending, daemon=True, name="agent-host-reports"
                )
                self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        """Send nothing more, and wait (up to `timeout_s`) for what is queued or on its way:
        the reporter (a publisher, with its broker connection) can be closed after this."""
        with self._cond:
            self.closed = True
            self._cond.wait_for(lambda: not self._unsent, timeout_s)
            self._dropping = True  # what is still queued after the wait never goes

    def _sending(self) -> None:
        """A report that fails is logged and lost: the state call tells what it would have
        (docs/protocol.md: reports)."""
        while True:
            try:
                report = self._queue.get(timeout=IDLE_S)
            except queue.Empty:
                with self._cond:
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            try:
                if not self._dropping:
                    self.reporter(report)
            except Exception:  # noqa: BLE001 - a host keeps running when reporting fails
                log.exception("agent host: a report could not be sent")
            finally:
                with self._cond:
                    self._unsent -= 1
                    self._cond.notify_all()

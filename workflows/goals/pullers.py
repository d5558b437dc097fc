"""Pulling under load (docs/dispatch.md): a worker pool process promises to take due goal work
when its channel is notified, and a client that committed goal operations notifies the
channels of live promises instead of publishing a dispatch message. PostgreSQL only
(LISTEN/NOTIFY); on SQLite nothing here runs and every submit publishes its message.

While its drain runs and has room, a pool process holds a row in `goal_pullers` and LISTENs
on a channel of its own (`Puller`); the notified drain claims what a notification names, as
a message's dispatch does. Nothing is lost to a puller that dies or lets go at the wrong
moment: the operation row is the outbox, and any drain's next steal, or the sweeper after
its outbox grace, takes what a notification reached nobody for."""

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from ...models.db import run_transaction
from ...models.dialects import dialect_of

# A promise lasts PROMISE_S past its last renewal (the database's clock); its holder renews
# it every RENEW_S. A holder that lets go (its process full, or stopping) deletes it; one that
# is full keeps listening (a client that found the promise may still be notifying it).
PROMISE_S = 1.0
RENEW_S = 0.5
# Promises dead this long (a killed process's) are deleted by the next puller that connects.
FORGET_AFTER_S = 60

# A client's notification of goal operations it committed (workflows/client/goals.py, after
# the commit, the operations of several submits together as its publisher would send them in
# one message): each operation goes to one live puller, the one whose channel hashes least
# with the session (so a session's operations go to the same puller while the pullers stay
# the same, and the sessions spread over them); one notification per puller, its payload the
# JSON list of [operation id, workspace id, session id] it names. Live by the statement's
# time, by the database's clock. A row per puller notified, with the operations it was told
# of; an operation in none (nobody pulls) is for a dispatch message. PostgreSQL delivers the
# notifications when the statement's transaction commits: after the operations' own.
NOTIFY_SQL = text(
    "SELECT array_agg(t.op), "
    "pg_notify(chosen.channel, json_agg(json_build_array(t.op, t.ws, t.sid))::text) "
    "FROM unnest(CAST(:ops AS text[]), CAST(:wss AS text[]), CAST(:sids AS text[])) "
    "AS t(op, ws, sid) "
    "CROSS JOIN LATERAL (SELECT channel FROM goal_pullers "
    "WHERE expires_at > statement_timestamp() "
    "ORDER BY hashtext(channel || t.ws || '/' || t.sid) LIMIT 1) AS chosen "
    "GROUP BY chosen.channel"
)
# PostgreSQL refuses a payload of 8,000 bytes or more: a statement notifies the operations of
# at most this many bytes of payload (the puller's share is never more).
PAYLOAD_BYTES = 7_000

Named = tuple[str, str, str]  # (operation id, workspace id, session id)


def notify(session: Session, named: list[Named]) -> set[str]:
    """Notify live pullers of these committed operations, in the caller's transaction (see
    NOTIFY_SQL): the ids of those a puller was told of."""
    told: set[str] = set()
    for part in _parts(named):
        ops, wss, sids = (list(column) for column in zip(*part, strict=True))
        rows = session.connection().execute(NOTIFY_SQL, {"ops": ops, "wss": wss, "sids": sids})
        for ids, _ in rows:
            told.update(ids)
    return told


def _parts(named: list[Named]) -> list[list[Named]]:
    parts: list[list[Named]] = [[]]
    size = 2
    for one in named:
        # As PostgreSQL writes it: UTF-8, ", " between items; quotes and backslashes escaped.
        one_size = len(json.dumps(one, ensure_ascii=False).encode()) + 2
        if parts[-1] and size + one_size > PAYLOAD_BYTES:
            parts.append([])
            size = 2
        parts[-1].append(one)
        size += one_size
    return parts if parts[-1] else []


# The holder's own statements, on its listening connection (psycopg, autocommit).
RENEW_SQL = (
    "INSERT INTO goal_pullers (channel, expires_at) "
    "VALUES (%(channel)s, now() + make_interval(secs => %(promise_s)s)) "
    "ON CONFLICT (channel) DO UPDATE SET expires_at = excluded.expires_at"
)
LET_GO_SQL = "DELETE FROM goal_pullers WHERE channel = %(channel)s"
FORGET_SQL = (
    "DELETE FROM goal_pullers WHERE expires_at < now() - make_interval(secs => %(after_s)s)"
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

"""Pulling under load (docs/dispatch.md): a worker pool process promises to take due goal work
when its channel is notified, and a client that committed goal operations notifies the
channels of live promises instead of publishing a dispatch message. PostgreSQL only
(LISTEN/NOTIFY); on SQLite nothing here runs and every submit publishes its message."""

import json

from sqlalchemy import text
from sqlalchemy.orm import Session

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

"""Pulling under load (docs/dispatch.md): a worker pool process promises to take due goal work
when its channel is notified, and a goal submit that sees a live promise notifies a channel
instead of publishing a dispatch message. PostgreSQL only (LISTEN/NOTIFY); on SQLite nothing
here runs and every submit publishes its message."""

from sqlalchemy import Text, bindparam, cast, func, select

from agent_radar.models.base import table_of
from agent_radar.models.coordination import GoalPuller

PULLERS = table_of(GoalPuller)

# A promise lasts PROMISE_S past its last renewal (the database's clock); its holder renews
# it every RENEW_S. A holder that lets go (its process full, or stopping) deletes it; one that
# is full keeps listening (a submit that read the promise before may commit after).
PROMISE_S = 1.0
RENEW_S = 0.5
# Promises dead this long (a killed process's) are deleted by the next puller that connects.
FORGET_AFTER_S = 60

# The end of a goal submit's write (workflows/goals/submit.py): notify one live puller, the
# one whose channel hashes least with the session (so a session's operations go to the same
# puller while the pullers stay the same, and the sessions spread over them), and return a
# row if there was one. Live by the statement's time, not the transaction's (a submit that
# waited for its session's lock). The payload names the operation and its session, as a
# dispatch message does: the puller claims it by name, whatever the clocks say of its due
# time. PostgreSQL delivers the notification when the transaction commits: it never
# arrives ahead of the operation's row.
_CHOSEN = (
    select(PULLERS.c.channel)
    .where(PULLERS.c.expires_at > func.statement_timestamp())
    .order_by(func.hashtext(PULLERS.c.channel + bindparam("b_ws") + "/" + bindparam("b_sid")))
    .limit(1)
    .subquery()
)
_PAYLOAD = func.json_build_array(
    bindparam("op_operation_id"), bindparam("b_ws"), bindparam("b_sid")
)
NOTIFY_PULLER = select(func.pg_notify(_CHOSEN.c.channel, cast(_PAYLOAD, Text))).select_from(_CHOSEN)

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

"""Direct transactions (models.db.Direct): the hot paths' statements sent through psycopg
without SQLAlchemy's execution around each, on PostgreSQL; an ORM session elsewhere. What
the work sees must be what a session would give it: the same rows, binds, errors, retries
and rollbacks."""

import pytest
from sqlalchemy import bindparam, select, text, update
from sqlalchemy.exc import IntegrityError, MultipleResultsFound, NoResultFound, ProgrammingError
from sqlalchemy.orm import Session

from agent_radar.models.base import utcnow
from agent_radar.models.db import engine_for, run_read, run_transaction
from agent_radar.models.direct import Direct
from agent_radar.models.tables import AgentSession
from agent_radar.workflows.goals.tables import OPS, STATES
from agent_radar.workflows.sessions.rows import SESSIONS, lock_session
from tests.helpers import row_counts, statements_sent

WS, SID = "ws-direct", "s-1"
_STATE = select(STATES.c.revision, STATES.c.desired).where(
    STATES.c.workspace_id == bindparam("b_ws"), STATES.c.session_id == bindparam("b_sid")
)
_OPS_OF = select(OPS.c.operation_id).where(
    OPS.c.operation_id.in_(bindparam("b_ops", expanding=True))
)
_SET_DESIRED = (
    update(STATES)
    .where(STATES.c.workspace_id == bindparam("b_ws"), STATES.c.session_id == bindparam("b_sid"))
    .values(desired=bindparam("b_desired", type_=STATES.c.desired.type))
)
KEY = {"b_ws": WS, "b_sid": SID}


def _goal(client, objective: str = "one", submit_id: str = "s-1"):
    return client.set_goal(WS, SID, objective, client_submit_id=submit_id)


def test_direct_work_gets_a_direct_on_postgresql_and_a_session_elsewhere(client, backend):
    kind = run_transaction(client.engine, lambda s: type(s), direct=True)
    assert kind is (Direct if backend == "production" else Session)
    assert run_read(client.engine, lambda s: type(s), direct=True) is kind
    # Without `direct`, every backend's work gets the ORM session, as before.
    assert run_transaction(client.engine, lambda s: type(s)) is Session


def test_rows_binds_and_expanding_lists_read_as_through_a_session(client):
    first = _goal(client)
    second = client.set_goal(WS, "s-2", "two", client_submit_id="s-1")

    def read(s):
        conn = s.connection()
        state = conn.execute(_STATE, KEY).first()
        ids = set(
            conn.execute(
                _OPS_OF, {"b_ops": [first.operation_id, second.operation_id, "x"]}
            ).scalars()
        )
        return state, ids

    (direct_state, direct_ids) = run_transaction(client.engine, read, direct=True)
    (state, ids) = run_transaction(client.engine, read)
    assert direct_ids == ids == {first.operation_id, second.operation_id}
    # By attribute and by position, JSON loaded, as a session's row.
    assert (direct_state.revision, direct_state.desired) == (state.revision, state.desired)
    assert direct_state[1] == {"objective": "one", "status": "active"}


def test_lists_of_every_length_read_as_through_a_session(client):
    """A statement's text is made once per set of list lengths (models.db._Compiled): each
    length, and a length again with other values, reads exactly its own rows."""
    ids = [
        client.set_goal(WS, f"s-{i}", "x", client_submit_id="s-1").operation_id for i in range(4)
    ]
    cases = [ids[:1], ids[:3], [], ids[1:2], ids[2:4] + ["absent"], ids[:3][::-1], ids[3:]]

    def read(s):
        return [set(s.connection().execute(_OPS_OF, {"b_ops": case}).scalars()) for case in cases]

    direct = run_transaction(client.engine, read, direct=True)
    assert direct == run_transaction(client.engine, read)
    assert direct == [set(case) - {"absent"} for case in cases]


def _expanded_as_sqlalchemy_does(compiled, params):
    """The text and bound parameters of one execution as SQLAlchemy's own expansion makes
    them (what a Direct sent before it kept one text per set of lengths)."""
    state = compiled.construct_expanded_state(params)
    bound = dict(state.parameters)
    for processors in (compiled._bind_processors, state.processors):
        for name, process in processors.items():
            if name in bound:
                bound[name] = (
                    process(bound[name])
                    if callable(process)
                    else tuple(
                        v if p is None else p(v) for p, v in zip(process, bound[name], strict=True)
                    )
                )
    return state.statement, bound


def _comparable(bound):
    """Bound parameters to compare: a JSON value wrapped for psycopg, by what it wraps."""
    sql, params = bound
    return sql, {name: (type(v), v.obj) if hasattr(v, "obj") else v for name, v in params.items()}


def test_a_kept_text_binds_exactly_what_sqlalchemy_would():
    """Every hot statement with lists (plain and of rows, besides fixed lists of its own and
    JSON), at each length and again at the same length with other values: the same text and
    the same bound parameters as SQLAlchemy's expansion of that very execution."""
    from sqlalchemy.dialects import postgresql

    from agent_radar.models.direct import _Compiled
    from agent_radar.workflows.goals.statements import LOOKUP_AND_CLAIM, NEXT_DUE_AND_ANYWHERE
    from agent_radar.workflows.sessions.rows import INSERT_EVENT, event_params

    now = utcnow()
    claim = {
        "b_now": now,
        "b_first": now,
        "b_owner": "w",
        "b_token": "t",
        "b_expires": now,
        "b_budget_since": now,
    }
    cases = [
        (LOOKUP_AND_CLAIM, lambda n, tag: {**claim, "b_ops": [f"{tag}-op-{i}" for i in range(n)]}),
        (
            NEXT_DUE_AND_ANYWHERE,
            lambda n, tag: {
                "b_now": now,
                "b_stale": now,
                "b_keys": [(f"{tag}-ws-{i}", f"{tag}-s-{i}") for i in range(n)],
            },
        ),
        (
            INSERT_EVENT,
            lambda n, tag: event_params(
                WS,
                f"{tag}-{n}",
                n,
                kind="k",
                record_id="r",
                idempotency_key="i",
                revision=n,
                payload={"tag": tag, "n": [n, None]},
                now=now,
            ),
        ),
        (_OPS_OF, lambda n, tag: {"b_ops": [f"{tag}-{i}" for i in range(n)]}),
    ]
    dialect = postgresql.psycopg.dialect()
    for statement, params_of in cases:
        compiled = statement.compile(dialect=dialect)
        kept = _Compiled(compiled)
        for n in (0, 1, 3, 1, 32, 3, 0):
            for tag in ("a", "b"):  # the second: the same lengths, other values
                params = params_of(n, tag)
                assert _comparable(kept.bound(params)) == _comparable(
                    _expanded_as_sqlalchemy_does(compiled, params)
                )


def test_json_binds_go_through_the_column_type(client):
    _goal(client)
    desired = {"objective": 'ünïcode "quoted" {braces}', "status": "paused", "n": [1, 2.5, None]}

    def write(s):
        return s.connection().execute(_SET_DESIRED, {**KEY, "b_desired": desired}).rowcount

    assert run_transaction(client.engine, write, direct=True) == 1
    assert client.goal_state(WS, SID).desired == desired

    # Several parameter sets (executemany) go through SQLAlchemy, on the same transaction.
    client.set_goal(WS, "s-2", "two", client_submit_id="s-1")
    both = [
        {"b_ws": WS, "b_sid": sid, "b_desired": {"objective": f"many {sid}"}}
        for sid in (SID, "s-2")
    ]
    run_transaction(
        client.engine, lambda s: s.connection().execute(_SET_DESIRED, both), direct=True
    )
    assert client.goal_state(WS, "s-2").desired == {"objective": "many s-2"}
    assert client.goal_state(WS, SID).desired == {"objective": f"many {SID}"}

    # None is SQL NULL (the column is none_as_null), as through the session.
    run_transaction(
        client.engine,
        lambda s: s.connection().execute(_SET_DESIRED, {**KEY, "b_desired": None}),
        direct=True,
    )
    with client.engine.connect() as conn:
        nulls = text("SELECT count(*) FROM goal_states WHERE desired IS NULL")
        assert conn.execute(nulls).scalar_one() == 1


def test_result_shapes_and_their_errors(client):
    _goal(client)
    client.set_goal(WS, "s-2", "two", client_submit_id="s-1")
    every = select(SESSIONS.c.session_id).order_by(SESSIONS.c.session_id)
    none = select(SESSIONS.c.session_id).where(SESSIONS.c.session_id == "absent")

    def shapes(s):
        conn = s.connection()
        return (
            conn.execute(every).all(),
            conn.execute(every).scalars().all(),
            conn.execute(every).scalar(),
            conn.execute(none).first(),
            conn.execute(none).scalar_one_or_none(),
            list(conn.execute(every)),
        )

    rows, scalars, scalar, first, maybe, iterated = run_transaction(
        client.engine, shapes, direct=True
    )
    assert [r.session_id for r in rows] == scalars == ["s-1", "s-2"] == [r[0] for r in iterated]
    assert (scalar, first, maybe) == ("s-1", None, None)
    with pytest.raises(MultipleResultsFound):
        run_transaction(client.engine, lambda s: s.connection().execute(every).one(), direct=True)
    with pytest.raises(NoResultFound):
        run_transaction(
            client.engine, lambda s: s.connection().execute(none).scalar_one(), direct=True
        )


def test_a_failed_direct_transaction_writes_nothing(client):
    _goal(client)
    before = row_counts(client.engine)

    def half(s):
        s.connection().execute(_SET_DESIRED, {**KEY, "b_desired": {"objective": "lost"}})
        raise RuntimeError("the work fails after a write")

    with pytest.raises(RuntimeError):
        run_transaction(client.engine, half, direct=True)
    assert client.goal_state(WS, SID).desired == {"objective": "one", "status": "active"}
    assert row_counts(client.engine) == before


@pytest.mark.parametrize("backend", ["production"])
def test_driver_errors_surface_as_sqlalchemy_errors(client):
    op = _goal(client)
    duplicate = OPS.insert().values(
        operation_id=op.operation_id,
        workspace_id=WS,
        session_id=SID,
        client_submit_id="other",
        origin="client",
        action="set",
        goal_revision=9,
        status="prepared",
        provider_phase="prepared",
        attempt=0,
        next_attempt_at=utcnow(),
        created_at=utcnow(),
    )
    # A unique key taken: IntegrityError, which run_transaction retries (a concurrent first
    # insert) until its attempts run out, as through a session.
    with pytest.raises(IntegrityError):
        run_transaction(
            client.engine, lambda s: s.connection().execute(duplicate), attempts=2, direct=True
        )
    with pytest.raises(ProgrammingError):
        run_transaction(
            client.engine, lambda s: s.connection().execute(text("SELEC 1")), direct=True
        )
    # The pooled connection is usable after either.
    assert (
        run_read(
            client.engine,
            lambda s: s.connection().execute(_STATE, KEY).first().revision,
            direct=True,
        )
        == 1
    )


@pytest.mark.parametrize("backend", ["production"])
def test_a_connection_lost_mid_transaction_is_retried_on_a_fresh_one(client):
    """The server ends the transaction's connection: the error is transient and marks the
    connection invalid, and the retry runs on another."""
    _goal(client)
    attempts = []

    def work(s):
        conn = s.connection()
        pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
        attempts.append(pid)
        if len(attempts) == 1:
            with client.engine.connect() as other:
                other.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        return conn.execute(_SET_DESIRED, {**KEY, "b_desired": {"objective": "kept"}}).rowcount

    assert run_transaction(client.engine, work, direct=True) == 1
    assert len(attempts) == 2 and attempts[0] != attempts[1]
    assert client.goal_state(WS, SID).desired == {"objective": "kept"}


def test_orm_work_in_a_direct_transaction_shares_its_connection(client):
    """What is not a prebuilt statement on `connection()` (ORM reads, `add`, `flush`) goes
    to a session on the same connection and transaction: it sees the direct writes, and its
    own are committed or rolled back with them."""
    _goal(client)

    def mixed(s, fail: bool):
        s.connection().execute(_SET_DESIRED, {**KEY, "b_desired": {"objective": "direct"}})
        row = lock_session(s, WS, "s-new")  # creates the session row through the ORM
        row.event_sequence = 7
        seen = s.execute(select(STATES.c.desired)).scalar_one()
        if fail:
            raise RuntimeError("after both kinds of write")
        return seen

    with pytest.raises(RuntimeError):
        run_transaction(client.engine, lambda s: mixed(s, True), direct=True)
    assert client.goal_state(WS, SID).desired == {"objective": "one", "status": "active"}
    assert run_transaction(client.engine, lambda s: s.get(AgentSession, (WS, "s-new"))) is None

    assert run_transaction(client.engine, lambda s: mixed(s, False), direct=True) == {
        "objective": "direct"
    }
    assert client.goal_state(WS, SID).desired == {"objective": "direct"}
    created = run_transaction(client.engine, lambda s: s.get(AgentSession, (WS, "s-new")))
    assert created is not None and created.event_sequence == 7


def test_direct_statements_reach_the_engine_events(client, backend):
    """The engine's cursor events see a direct statement, as they see a session's (what the
    statement-count tests and any tracing rely on)."""
    with statements_sent(client.engine) as statements:
        run_read(client.engine, lambda s: s.connection().execute(_STATE, KEY).first(), direct=True)
    assert [s for s in statements if s not in ("BEGIN", "COMMIT")] == ["SELECT"]
    assert engine_for(str(client.settings.database_url)) is client.engine


@pytest.mark.parametrize("backend", ["production"])
def test_a_process_goes_on_with_its_most_recent_connection(client):
    """After a burst of concurrent transactions left several connections in the pool, the
    next transactions take the most recent one, with the statements prepared on it (psycopg
    prepares a text on its sixth use on a connection), not each pooled one in turn."""
    hot = select(OPS.c.operation_id).where(OPS.c.workspace_id == bindparam("b_ws"))

    def prepared(s) -> set[str]:
        listed = s.connection().execute(text("SELECT statement FROM pg_prepared_statements"))
        return {" ".join(statement.split()) for statement in listed.scalars()}

    def run(s):
        for _ in range(6):
            s.connection().execute(hot, {"b_ws": WS})
        return prepared(s)

    conns = [client.engine.connect() for _ in range(3)]
    for conn in conns:
        conn.close()
    statements = run_transaction(client.engine, run, direct=True)
    hot_sql = " ".join(str(hot.compile(dialect=client.engine.dialect)).split())
    assert hot_sql.replace("%(b_ws)s", "$1") in statements
    for _ in range(3):
        assert run_read(client.engine, prepared, direct=True) >= statements

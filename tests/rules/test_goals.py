"""docs/lifecycles.md: accept, goals, rule by rule, on both backends: the workflow functions against
the real database and the simulator over real HTTP, with a clock the test controls."""

import logging
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta

import pytest
from sqlalchemy import create_engine, event, make_url, select, text, update

from agent_radar.models.db import run_transaction
from agent_radar.workflows import ids
from agent_radar.workflows.adapters.http_runtime import HttpRuntime
from agent_radar.workflows.client import AgentRadar
from agent_radar.workflows.errors import (
    GoalGenerationSuperseded,
    GoalOperationConflict,
    GoalStateAbsent,
    InvalidArgument,
)
from agent_radar.workflows.goals.operations import DISPATCH_MAX_ATTEMPTS
from agent_radar.workflows.goals.tables import OPS
from agent_radar.workflows.sessions.rows import EVENTS, SESSIONS
from agent_radar.workflows.steps.goals.dispatch import Dispatcher
from tests.conftest import PG_ADMIN_URL, throwaway_pg_database
from tests.helpers import Clock, row_counts, statements_sent

WS, SID = "ws-rules", "session-1"
# Reports are timed in milliseconds since the epoch; the tests order theirs from here.
REPORT_EPOCH_MS = 1_764_770_000_000
# A dispatch step on PostgreSQL, for one operation or many: the lanes read; the claim (lanes
# taken or created with the session locks, the claim read with the claim and its goal
# states); the record (session lock, every applied operation with its evidence and goal
# state with the lanes' release, the look for more work).
LANES_READ = ["SELECT"]
CLAIM = ["WITH", "WITH"]
# A named message's claim: one call of migration 0016's function, in autocommit.
NAMED_CLAIM = ["SELECT"]
RECORD = ["SELECT", "WITH", "SELECT"]
DISPATCH_STEP_STATEMENTS = LANES_READ + CLAIM + RECORD


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def dispatcher(client, settings, clock):
    def make(worker_id="worker-a", timeout_s=2):
        return Dispatcher(
            client.engine,
            HttpRuntime(settings.runtime_url, timeout_s=timeout_s),
            worker_id=worker_id,
            lease_s=settings.lease_s,
            clock=clock,
            resume_session=lambda ws, sid: client.ensure_session(ws, sid),
        )

    return make


def test_ids_are_derived_from_the_submit_id(client):
    op = client.set_goal(WS, SID, "ship it", client_submit_id="s-1")
    expected = uuid.uuid5(ids.NAMESPACE, f"goal\0{WS}\0{SID}\0s-1")
    assert op.operation_id == str(expected)
    assert client.find_goal_operation(WS, SID, "s-1") == op
    assert client.find_goal_operation(WS, SID, "s-2") is None


def test_replay_returns_the_existing_record_and_writes_nothing(client, sim_control):
    first = client.set_goal(WS, SID, "ship it", client_submit_id="s-1")
    before = row_counts(client.engine)
    again = client.set_goal(WS, SID, "ship it", client_submit_id="s-1")
    assert again == first
    assert row_counts(client.engine) == before
    assert client.goal_state(WS, SID).revision == 1


def test_same_submit_id_with_other_payload_is_a_conflict(client):
    client.set_goal(WS, SID, "ship it", client_submit_id="s-1")
    before = row_counts(client.engine)
    with pytest.raises(GoalOperationConflict):
        client.set_goal(WS, SID, "something else", client_submit_id="s-1")
    with pytest.raises(GoalOperationConflict):
        client.clear_goal(WS, SID, client_submit_id="s-1")
    assert row_counts(client.engine) == before


def test_submit_ids_are_scoped_per_session(client):
    a = client.set_goal(WS, "one", "x", client_submit_id="same")
    b = client.set_goal(WS, "two", "y", client_submit_id="same")
    assert a.operation_id != b.operation_id


def test_expected_revision_mismatch_writes_nothing(client):
    client.set_goal(WS, SID, "ship it", client_submit_id="s-1")
    before = row_counts(client.engine)
    with pytest.raises(GoalGenerationSuperseded) as err:
        client.set_goal(WS, SID, "other", client_submit_id="s-2", expected_revision=0)
    assert err.value.current_revision == 1
    assert row_counts(client.engine) == before
    op = client.set_goal(WS, SID, "other", client_submit_id="s-3", expected_revision=1)
    assert op.goal_revision == 2


def test_pause_or_resume_without_a_goal_is_absent(client):
    before = row_counts(client.engine)
    with pytest.raises(GoalStateAbsent):
        client.pause_goal(WS, SID, client_submit_id="p-1")
    with pytest.raises(GoalStateAbsent):
        client.resume_goal(WS, SID, client_submit_id="r-1")
    assert row_counts(client.engine) == before
    client.set_goal(WS, SID, "x", client_submit_id="s-1")
    client.clear_goal(WS, SID, client_submit_id="c-1")
    with pytest.raises(GoalStateAbsent):
        client.pause_goal(WS, SID, client_submit_id="p-2")


def test_submit_sets_desired_state_and_appends_an_audit_event(client):
    client.set_goal(WS, SID, "ship it", client_submit_id="s-1")
    paused = client.pause_goal(WS, SID, client_submit_id="p-1")
    state = client.goal_state(WS, SID)
    assert (state.revision, state.sync_status) == (2, "pending")
    assert state.desired == {"objective": "ship it", "status": "paused"}
    assert state.pending_operation_id == paused.operation_id
    cleared = client.clear_goal(WS, SID, client_submit_id="c-1")
    state = client.goal_state(WS, SID)
    assert state.desired is None and state.tombstoned and state.revision == 3
    assert cleared.status == "prepared" and cleared.provider_phase == "prepared"
    assert row_counts(client.engine)["session_events"] == 3


def test_a_submit_writes_in_one_statement_on_postgresql(client, backend):
    """The submit's writes (session row or its event counter, a superseded operation, the
    goal state, the operation, its event) go together: one statement on PostgreSQL, after
    the session lock and (for a session that exists) the read of its goal state."""
    with statements_sent(client.engine) as statements:
        first = client.set_goal(WS, SID, "one", client_submit_id="s-1")  # a new session
        assert client.flush()
        new_session = list(statements)
        statements.clear()
        second = client.set_goal(WS, SID, "two", client_submit_id="s-2")  # supersedes
        assert client.flush()
        existing_session = list(statements)
    if backend == "production":
        # Each is then notified, from the client's sender thread, to the workers that pull
        # (the last SELECT; none pull here, and its message is published).
        assert new_session == ["SELECT", "WITH", "SELECT"]
        assert existing_session == ["SELECT", "SELECT", "WITH", "SELECT"]
    assert client.get_goal_operation(first.operation_id).status == "superseded"
    assert client.get_goal_operation(second.operation_id).status == "prepared"
    state = client.goal_state(WS, SID)
    assert (state.revision, state.pending_operation_id) == (2, second.operation_id)
    with client.engine.connect() as conn:
        events = conn.execute(
            select(EVENTS.c.sequence, EVENTS.c.kind, EVENTS.c.revision).order_by(EVENTS.c.sequence)
        ).all()
        counter = conn.execute(select(SESSIONS.c.event_sequence)).scalar_one()
    assert [tuple(e) for e in events] == [(1, "goal-control", 1), (2, "goal-control", 2)]
    assert counter == 2


def test_a_lone_dispatch_is_six_statements_on_postgresql(client, dispatcher, backend):
    """The lanes read; claim: the lane (taken or created) with the session lock, the claim
    read with the claim and its goal state. Record: the session lock, the completion with its
    goal state and the lane's release, the look for more work. Each merged pair is one statement on
    PostgreSQL."""
    op = client.set_goal(WS, SID, "ship it", client_submit_id="s-1")
    assert client.flush()  # its notification (or message) sent: not counted below
    with statements_sent(client.engine) as statements:
        outcomes = dispatcher().dispatch(op.operation_id)
    assert [r.outcome for r in outcomes] == ["applied"]
    if backend == "production":
        assert statements == DISPATCH_STEP_STATEMENTS
    state = client.goal_state(WS, SID)
    assert (state.sync_status, state.pending_operation_id) == ("synced", None)
    assert state.observed == {"objective": "ship it", "status": "active"}
    done = client.get_goal_operation(op.operation_id)
    assert (done.status, done.lease_token, done.evidence is not None) == ("completed", None, True)


def test_work_the_claim_statement_left_is_claimed_on_its_own(
    client, dispatcher, sim_control, monkeypatch, backend
):
    """What the judgement lets go but the claim statement did not take (a row another
    transaction changed after the statement's snapshot; here, a statement that takes
    nothing) is claimed by a statement of its own, and applied once."""
    from sqlalchemy import false

    from agent_radar.workflows.goals import lanes as claim_module
    from agent_radar.workflows.goals.statements import CLAIM_LOOKUP

    took_nothing = CLAIM_LOOKUP.add_columns(false().label("taken"))
    monkeypatch.setattr(claim_module, "LOOKUP_AND_CLAIM", took_nothing)
    op = client.set_goal(WS, SID, "ship it", client_submit_id="s-1")
    assert client.flush()  # its notification (or message) sent: not counted below
    with statements_sent(client.engine) as statements:
        assert [r.outcome for r in dispatcher().dispatch(op.operation_id)] == ["applied"]
    if backend == "production":
        assert statements[:3] == LANES_READ + ["WITH", "SELECT"]
        assert statements[3] == "WITH"  # the claim of its own
    assert [e["revision"] for e in sim_control.effects()] == [1]
    assert client.get_goal_operation(op.operation_id).status == "completed"


def test_a_message_for_settled_work_costs_one_read(client, dispatcher):
    """Under load most dispatch messages find their operation already taken along by
    another dispatch: such a message reads once and writes nothing."""
    op = client.set_goal(WS, SID, "ship it", client_submit_id="s-1")
    assert client.flush()  # its notification (or message) sent: not counted below
    assert [r.outcome for r in dispatcher().dispatch_many([op.operation_id])] == ["applied"]
    with statements_sent(client.engine) as statements:
        again = dispatcher("worker-b").dispatch_many([op.operation_id])
    assert again == []
    assert [s for s in statements if s not in ("BEGIN", "COMMIT")] == ["SELECT"]


def test_a_submits_message_of_its_own_names_the_session_of_its_operation(settings):
    """So that the worker takes the session's lane without reading it first."""
    from tests.adapters.test_publisher import RecordingPublisher

    publisher = RecordingPublisher(settings, delay_s=0)
    c = AgentRadar(settings=settings, publisher=publisher)
    op = c.set_goal(WS, SID, "ship it", client_submit_id="s-1")
    c.close()
    assert publisher.messages == [
        (
            "agent_radar.goal.dispatch",
            {"operation_ids": [op.operation_id], "workspace_id": WS, "session_id": SID},
        )
    ]


def test_a_message_that_names_the_session_skips_the_lanes_read(
    client, dispatcher, sim_control, backend
):
    """On PostgreSQL the lane of the named session is taken at once, in the claim's one
    call: a lone dispatch is then four statements (no lanes read). On SQLite the
    name is not used (`takes_named_lanes`): the dispatch is the unnamed one, with the same
    outcome."""
    op = client.set_goal(WS, SID, "ship it", client_submit_id="s-1")
    assert client.flush()  # its notification (or message) sent: not counted below
    with statements_sent(client.engine) as statements:
        outcomes = dispatcher().dispatch_many([op.operation_id], session_of=(WS, SID))
    assert [r.outcome for r in outcomes] == ["applied"]
    if backend == "production":
        assert statements == NAMED_CLAIM + RECORD
    assert [e["operation_id"] for e in sim_control.effects()] == [op.operation_id]
    assert client.get_goal_operation(op.operation_id).status == "completed"
    assert _lane_tokens(client, [SID]) == {ids.lane_name(WS, SID): None}


@pytest.mark.parametrize("backend", ["production"])
def test_a_named_claim_needs_nothing_of_a_new_connection(client, dispatcher, sim_control):
    """The named claim's function is the database's (migration 0016), not a connection's:
    the first call on a new connection (a new pool, a reconnect) claims as any other, and
    nothing is rolled back."""
    first = client.set_goal(WS, SID, "one", client_submit_id="s-1")
    d = dispatcher()
    assert [r.outcome for r in d.dispatch_many([first.operation_id], session_of=(WS, SID))] == [
        "applied"
    ]
    client.engine.dispose()
    second = client.set_goal(WS, "s-2", "two", client_submit_id="s-1")
    with _rollbacks(client.engine) as rolled_back:
        outcomes = d.dispatch_many([second.operation_id], session_of=(WS, "s-2"))
    assert [r.outcome for r in outcomes] == ["applied"]
    assert rolled_back == []
    assert [e["operation_id"] for e in sim_control.effects()] == [
        first.operation_id,
        second.operation_id,
    ]
    assert _lane_tokens(client, [SID, "s-2"]) == {
        ids.lane_name(WS, SID): None,
        ids.lane_name(WS, "s-2"): None,
    }


@pytest.mark.parametrize("backend", ["production"])
def test_a_role_with_table_rights_only_claims_named_messages_in_one_call(settings, sim_control):
    """A database role that may only read and write the tables (TEMP revoked from PUBLIC,
    as some hardened databases do; no right to make anything) still claims a named message
    in one call: the function is the schema's (migration 0016), run with the caller's
    rights."""
    role = f"radar_no_temp_{uuid.uuid4().hex[:8]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE ROLE "{role}" LOGIN'))
    try:
        with throwaway_pg_database("agent_radar_no_temp") as url:
            database = url.rsplit("/", 1)[1]
            owner = create_engine(url, isolation_level="AUTOCOMMIT")
            with owner.connect() as conn:
                conn.execute(text(f'REVOKE TEMPORARY ON DATABASE "{database}" FROM PUBLIC'))
                conn.execute(text(f'GRANT USAGE ON SCHEMA public TO "{role}"'))
                conn.execute(
                    text(
                        "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public "
                        f'TO "{role}"'
                    )
                )
                conn.execute(text(f'GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO "{role}"'))
            owner.dispose()
            role_url = make_url(url).set(username=role).render_as_string(hide_password=False)
            as_role = replace(settings, database_url=role_url)
            client = AgentRadar(settings=as_role)
            try:
                d = Dispatcher(
                    client.engine,
                    HttpRuntime(settings.runtime_url, timeout_s=2),
                    worker_id="worker-a",
                    lease_s=settings.lease_s,
                )
                # One at a time: a dispatch takes the due work of other sessions along.
                ops = [client.set_goal(WS, SID, "ship it", client_submit_id="s-1")]
                first = d.dispatch_many([ops[0].operation_id], session_of=(WS, SID))
                ops.append(client.set_goal(WS, "s-2", "ship it", client_submit_id="s-1"))
                assert client.flush()  # their notifications sent: not counted below
                with statements_sent(client.engine) as statements:
                    second = d.dispatch_many([ops[1].operation_id], session_of=(WS, "s-2"))
                assert [r.outcome for r in first + second] == ["applied", "applied"]
                assert statements == NAMED_CLAIM + RECORD
                assert [e["operation_id"] for e in sim_control.effects()] == [
                    op.operation_id for op in ops
                ]
                assert {client.get_goal_operation(op.operation_id).status for op in ops} == {
                    "completed"
                }
            finally:
                client.close()
                client.engine.dispose()
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP ROLE IF EXISTS "{role}"'))
        admin.dispose()


@pytest.mark.parametrize("named", ["another-session", "no-such-session"])
def test_a_wrongly_named_session_takes_nothing_and_the_operation_is_applied_once(
    client, dispatcher, sim_control, settings, named
):
    """A message's session is its word, not the database's: named wrongly (another
    session, with open work of its own, or none at all), no lane is taken for it, and the
    operation is dispatched as if nothing were named: applied once. The named session is
    left as it was, and no lane row is made for a session that does not exist."""
    other = client.set_goal(WS, "another-session", "not now", client_submit_id="o-1")
    op = client.set_goal(WS, SID, "ship it", client_submit_id="s-1")
    lanes_before = _lane_tokens(client, [SID, "another-session", "no-such-session"])
    held_during_call = []

    class Watched(HttpRuntime):
        def apply_goal(self, workspace_id, session_id, **call):
            held_during_call.append(_lane_tokens(client, [session_id]))
            return super().apply_goal(workspace_id, session_id, **call)

    d = dispatcher()
    d.runtime = Watched(settings.runtime_url, timeout_s=2)
    with _rollbacks(client.engine) as rolled_back:
        outcomes = d.dispatch_many([op.operation_id], session_of=(WS, named))
    assert rolled_back == []
    # the operation was called with its own session's lane held
    assert [list(tokens) for tokens in held_during_call] == [[ids.lane_name(WS, SID)]]
    assert None not in held_during_call[0].values()
    assert [(r.operation_id, r.outcome) for r in outcomes] == [(op.operation_id, "applied")]
    assert [e["operation_id"] for e in sim_control.effects()] == [op.operation_id]
    untouched = client.get_goal_operation(other.operation_id)
    assert (untouched.status, untouched.attempt, untouched.lease_token) == ("prepared", 0, None)
    lanes_after = _lane_tokens(client, [SID, "another-session", "no-such-session"])
    mine = ids.lane_name(WS, SID)
    assert lanes_after.pop(mine) is None  # taken and released by the unnamed dispatch
    lanes_before.pop(mine, None)
    assert lanes_after == lanes_before  # on SQLite a lane's row is made on its first use
    assert ids.lane_name(WS, "no-such-session") not in lanes_after


@contextmanager
def _rollbacks(engine):
    """The transactions the engine rolled back in the block."""
    seen: list[object] = []

    def record(conn):
        seen.append(conn)

    event.listen(engine, "rollback", record)
    try:
        yield seen
    finally:
        event.remove(engine, "rollback", record)


def test_a_named_message_for_settled_work_writes_nothing(client, dispatcher, sim_control):
    """A second message for an operation already applied, naming its session: no lane is
    taken, nothing is called, nothing written, and (on PostgreSQL) nothing is rolled back
    either: psycopg forgets the statements it prepared on a connection that rolls back."""
    op = client.set_goal(WS, SID, "ship it", client_submit_id="s-1")
    assert [r.outcome for r in dispatcher().dispatch(op.operation_id)] == ["applied"]
    before = (row_counts(client.engine), client.get_goal_operation(op.operation_id))
    with _rollbacks(client.engine) as rolled_back:
        again = dispatcher("worker-b").dispatch_many([op.operation_id], session_of=(WS, SID))
    assert again == []
    assert rolled_back == []
    assert (row_counts(client.engine), client.get_goal_operation(op.operation_id)) == before
    assert _lane_tokens(client, [SID]) == {ids.lane_name(WS, SID): None}
    assert len(sim_control.effects()) == 1


def test_a_named_message_leaves_a_lane_another_worker_holds(client, dispatcher, sim_control):
    """The named session's lane is held (another worker drains it): this dispatch takes
    nothing and calls nothing; the holder finds the operation when it releases."""
    from agent_radar.workflows import leases

    op = client.set_goal(WS, SID, "ship it", client_submit_id="s-1")
    token, taken = run_transaction(
        client.engine,
        lambda s: leases.claim_many(
            s, [ids.lane_name(WS, SID)], "worker-b", 60, dispatcher().clock()
        ),
    )
    assert taken == {ids.lane_name(WS, SID)}
    with _rollbacks(client.engine) as rolled_back:
        assert dispatcher().dispatch_many([op.operation_id], session_of=(WS, SID)) == []
    assert rolled_back == []
    assert _lane_tokens(client, [SID]) == {ids.lane_name(WS, SID): token}
    assert client.get_goal_operation(op.operation_id).status == "prepared"
    assert sim_control.effects() == []


def test_concurrent_submits_to_one_session_take_distinct_revisions(client):
    """Each submit reads the goal state after it holds the session lock: on PostgreSQL a
    read in the locking statement itself could predate the submit that held the lock, and
    two submits would both take revision n + 1 and leave both operations pending."""
    client.set_goal(WS, SID, "start", client_submit_id="0")
    threads, per_thread = 6, 10

    def submit(t: int) -> None:
        for i in range(per_thread):
            client.set_goal(WS, SID, f"goal {t}-{i}", client_submit_id=f"{t}-{i}")

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(submit, range(threads)))
    total = 1 + threads * per_thread
    with client.engine.connect() as conn:
        rows = conn.execute(select(OPS.c.goal_revision, OPS.c.status, OPS.c.operation_id)).all()
    assert sorted(r.goal_revision for r in rows) == list(range(1, total + 1))
    open_ops = [r for r in rows if r.status == "prepared"]
    assert len(open_ops) == 1 and open_ops[0].goal_revision == total
    state = client.goal_state(WS, SID)
    assert (state.revision, state.pending_operation_id) == (total, open_ops[0].operation_id)


def test_a_newer_submit_supersedes_the_pending_operation(client, dispatcher, sim_control):
    first = client.set_goal(WS, SID, "one", client_submit_id="s-1")
    second = client.set_goal(WS, SID, "two", client_submit_id="s-2")
    assert client.get_goal_operation(first.operation_id).status == "superseded"
    assert [r.outcome for r in dispatcher().dispatch(first.operation_id)] == []
    outcomes = dispatcher().dispatch(second.operation_id)
    assert [r.outcome for r in outcomes] == ["applied"]
    assert [e["revision"] for e in sim_control.effects()] == [2]


def test_applied_outcome_completes_and_syncs(client, dispatcher, sim_control):
    op = client.set_goal(WS, SID, "ship it", client_submit_id="s-1")
    assert [r.outcome for r in dispatcher().dispatch(op.operation_id)] == ["applied"]
    done = client.get_goal_operation(op.operation_id)
    assert (done.status, done.provider_phase, done.attempt) == ("completed", "applied", 1)
    state = client.goal_state(WS, SID)
    assert state.sync_status == "synced" and state.pending_operation_id is None
    assert state.observed == {"objective": "ship it", "status": "active"}
    # a second delivery of the same task does nothing at all
    assert dispatcher().dispatch(op.operation_id) == []
    assert len(sim_control.effects()) == 1


def test_observed_that_differs_from_desired_is_diverged(client, dispatcher, sim):
    client.set_goal(WS, SID, "x", client_submit_id="s-1")
    dispatcher().dispatch(client.find_goal_operation(WS, SID, "s-1").operation_id)
    sim.sim.session(WS, SID).goal = None  # the agent lost its goal behind our back
    op = client.pause_goal(WS, SID, client_submit_id="p-1")
    dispatcher().dispatch(op.operation_id)
    assert client.goal_state(WS, SID).sync_status == "diverged"


def test_a_goal_answer_of_another_shape_is_diverged_and_said(client, dispatcher, sim, caplog):
    """The goal a host answers must be exactly `{"objective", "status"}` (docs/protocol.md):
    one key more and the goal is diverged. The worker log says so, with what the host held
    (escaped), so a host team learns it from the log and not only from `status`."""
    host = sim.sim
    original = host.handle

    def with_a_key_more(call, ws, sid, body):
        answer = original(call, ws, sid, body)
        if call == "goal" and answer.get("goal"):
            answer = {**answer, "goal": {**answer["goal"], "note\n": "extra"}}
        return answer

    host.handle = with_a_key_more
    op = client.set_goal(WS, SID, "x", client_submit_id="s-1")
    with caplog.at_level(logging.WARNING, logger="agent_radar.workflows.goals.operations"):
        assert [r.outcome for r in dispatcher().dispatch(op.operation_id)] == ["applied"]
    assert client.goal_state(WS, SID).sync_status == "diverged"
    (line,) = [r.getMessage() for r in caplog.records if "diverged" in r.getMessage()]
    assert op.operation_id in line and "note\\n" in line and "\n" not in line


def test_a_batch_is_recorded_in_one_statement_on_postgresql(client, dispatcher, sim, backend):
    """A step's applied operations (here: sets, a clear, and a pause whose agent lost its
    goal) are completed with their evidence and their goal states synced or diverged
    together: one statement on PostgreSQL for any number of them."""
    for i in range(4):
        client.set_goal(WS, f"b{i}", f"goal {i}", client_submit_id="s-1")
        dispatcher().dispatch(client.find_goal_operation(WS, f"b{i}", "s-1").operation_id)
    sim.sim.session(WS, "b3").goal = None  # the agent lost its goal behind our back
    ops = [
        client.set_goal(WS, "b0", "goal 0 again", client_submit_id="s-2"),
        client.set_goal(WS, "b1", "goal 1 again", client_submit_id="s-2"),
        client.clear_goal(WS, "b2", client_submit_id="c-1"),
        client.pause_goal(WS, "b3", client_submit_id="p-1"),
    ]
    assert client.flush()  # their messages (or notifications) sent, by the client's engine
    # Each call's outcome is recorded as it finishes, together with whatever else finished
    # meanwhile (workflows/steps/goals/flight.py): here all four are held until every one has its
    # answer, so they come in at once and are recorded together.
    d = dispatcher()
    answered = threading.Barrier(len(ops))
    attempt = d.attempt

    def together(claim):
        outcome = attempt(claim)
        answered.wait(10)
        return outcome

    d.attempt = together
    with statements_sent(client.engine) as statements:
        outcomes = d.dispatch_many([op.operation_id for op in ops])
    assert sorted(r.outcome for r in outcomes) == ["applied"] * 4
    if backend == "production":
        # The lanes read and the claim, then one record for each group of answers that came
        # in together: mostly one (the same as for one operation), never one per answer
        # unless the threads happened to hand them in one by one.
        assert statements[: len(LANES_READ + CLAIM)] == LANES_READ + CLAIM
        records = statements[len(LANES_READ + CLAIM) :]
        assert records == RECORD * (len(records) // len(RECORD)) and records
    states = {sid: client.goal_state(WS, sid) for sid in ("b0", "b1", "b2", "b3")}
    assert [states[s].sync_status for s in ("b0", "b1", "b2")] == ["synced"] * 3
    assert states["b0"].observed == {"objective": "goal 0 again", "status": "active"}
    assert states["b2"].observed is None and states["b2"].pending_operation_id is None
    assert states["b3"].sync_status == "diverged"
    for op in ops:
        done = client.get_goal_operation(op.operation_id)
        assert (done.status, done.provider_phase) == ("completed", "applied")
        assert done.evidence is not None and done.lease_token is None


def test_accepted_then_an_exact_goal_applied_report_has_the_host_asked(
    client, dispatcher, sim_control
):
    """A report of the goal applied is a hint (docs/lifecycles.md: reconcile): naming exactly
    the operation and revision, it has the session's restore ask the host, whose state answer
    completes the operation."""
    from tests.helpers import eventually, restorer

    sim_control.session(WS, SID, goal_mode="accepted", apply_delay_ms=300, continuation_turns=False)
    op = client.set_goal(WS, SID, "ship it", client_submit_id="s-1")
    assert [r.outcome for r in dispatcher().dispatch(op.operation_id)] == ["accepted"]
    current = client.get_goal_operation(op.operation_id)
    assert (current.status, current.provider_phase) == ("dispatched", "accepted")
    goal = {"objective": "ship it", "status": "active"}
    report = {
        "workspace_id": WS,
        "session_id": SID,
        "occurred_at_ms": 1_764_770_000_000,
        "goal_applied": {"operation_id": op.operation_id, "revision": 2, "goal": goal},
    }
    assert client.report_activity(report) is False  # wrong revision: asks nothing
    report["goal_applied"]["revision"] = 1
    assert client.report_activity({**report, "session_id": "other"}) is False
    eventually(lambda: sim_control.session(WS, SID)["applied_revision"] == 1, what="the apply")
    assert client.report_activity(report) is True
    assert client.get_goal_operation(op.operation_id).status == "dispatched"  # not on its own
    assert restorer(client).restore(WS, SID) == "restored"
    done = client.get_goal_operation(op.operation_id)
    assert (done.status, done.provider_phase) == ("completed", "applied")
    assert client.goal_state(WS, SID).sync_status == "synced"


def test_a_step_releases_its_lanes_with_its_record_or_after_it(
    client, dispatcher, sim_control, backend
):
    """A step whose every call was applied releases its lanes in its record's statement on
    PostgreSQL; one with any other outcome (here an accepted goal, waiting for its report)
    records that outcome and releases in a statement of its own. Either way every lane is
    free after the step, and the applied operation is completed once."""
    sim_control.session(WS, "accepting", goal_mode="accepted", apply_delay_ms=60_000)
    alone = client.set_goal(WS, "alone", "x", client_submit_id="1")
    with statements_sent(client.engine) as statements:
        assert [r.outcome for r in dispatcher().dispatch(alone.operation_id)] == ["applied"]
    if backend == "production":
        assert "UPDATE" not in statements  # no release of its own
    applied = client.set_goal(WS, "applied", "x", client_submit_id="1")
    accepted = client.set_goal(WS, "accepting", "x", client_submit_id="1")
    results = dispatcher().dispatch_many([applied.operation_id, accepted.operation_id])
    assert sorted((r.operation_id, r.outcome) for r in results) == sorted(
        [(applied.operation_id, "applied"), (accepted.operation_id, "accepted")]
    )
    assert set(_lane_tokens(client, ["alone", "applied", "accepting"]).values()) == {None}
    assert client.get_goal_operation(applied.operation_id).status == "completed"
    assert client.get_goal_operation(accepted.operation_id).provider_phase == "accepted"


def test_accepted_without_report_fails_after_its_budget(client, dispatcher, sim_control, clock):
    sim_control.session(WS, SID, goal_mode="accepted", apply_delay_ms=60_000)
    op = client.set_goal(WS, SID, "ship it", client_submit_id="s-1")
    dispatcher().dispatch(op.operation_id)
    clock.advance(119)
    assert [r.outcome for r in dispatcher().dispatch(op.operation_id)] == ["skipped"]
    clock.advance(2)
    assert [r.outcome for r in dispatcher().dispatch(op.operation_id)] == ["failed"]
    failed = client.get_goal_operation(op.operation_id)
    assert failed.status == "failed"
    assert failed.last_error.startswith("budget_exhausted (accepted, no applied report in 120 s)")
    assert client.goal_state(WS, SID).sync_status == "failed"


def test_stale_revision_from_the_runtime_supersedes(client, dispatcher, sim):
    sim.sim.session(WS, SID).revision = 5  # the agent has seen a newer revision
    op = client.set_goal(WS, SID, "ship it", client_submit_id="s-1")
    assert [r.outcome for r in dispatcher().dispatch(op.operation_id)] == ["superseded"]
    assert client.get_goal_operation(op.operation_id).status == "superseded"


@pytest.mark.parametrize(
    "status,error", [(503, "server_error"), (404, "session_not_found"), (409, "busy")]
)
def test_retryable_answers_back_off_exponentially(
    client, dispatcher, sim_control, clock, status, error
):
    sim_control.fault("goal", status=status, error=error, count=3)
    op = client.set_goal(WS, SID, "ship it", client_submit_id="s-1")
    expected_backoffs = [1, 2, 4]
    for attempt, backoff in enumerate(expected_backoffs, start=1):
        assert [r.outcome for r in dispatcher().dispatch(op.operation_id)] == ["retry"]
        row = client.get_goal_operation(op.operation_id)
        assert (row.status, row.attempt, row.lease_token) == ("dispatched", attempt, None)
        assert row.next_attempt_at == clock.now + timedelta(seconds=backoff)
        assert client.goal_state(WS, SID).sync_status == "applying"
        clock.advance(backoff)
    assert [r.outcome for r in dispatcher().dispatch(op.operation_id)] == ["applied"]
    assert client.get_goal_operation(op.operation_id).attempt == 4


def test_backoff_is_capped_at_256_seconds():
    from agent_radar.workflows.budgets import backoff_s

    assert [backoff_s(a) for a in (1, 2, 3, 9, 10, 20)] == [1, 2, 4, 256, 256, 256]


def test_timeout_is_retryable(client, dispatcher, sim_control):
    sim_control.latency("goal", 1000)
    op = client.set_goal(WS, SID, "ship it", client_submit_id="s-1")
    calls = dispatcher(timeout_s=0.3)  # the call is cut well before its answer
    assert [r.outcome for r in calls.dispatch(op.operation_id)] == ["retry"]
    assert "timed out" in client.get_goal_operation(op.operation_id).last_error


def test_other_runtime_errors_fail_for_good(client, dispatcher, sim_control):
    sim_control.fault("goal", status=422, error="rejected", count=1)
    op = client.set_goal(WS, SID, "ship it", client_submit_id="s-1")
    assert [r.outcome for r in dispatcher().dispatch(op.operation_id)] == ["failed"]
    failed = client.get_goal_operation(op.operation_id)
    assert failed.status == "failed" and "rejected" in failed.last_error
    state = client.goal_state(WS, SID)
    assert state.sync_status == "failed" and state.pending_operation_id is None
    assert "rejected" in state.last_error


def test_attempt_budget(client, dispatcher, sim_control, clock):
    sim_control.fault("goal", status=503, count=1000)
    op = client.set_goal(WS, SID, "ship it", client_submit_id="s-1")
    for _ in range(DISPATCH_MAX_ATTEMPTS):
        assert [r.outcome for r in dispatcher().dispatch(op.operation_id)] == ["retry"]
        clock.advance(1)  # keep within the time budget: only attempts run out
    assert [r.outcome for r in dispatcher().dispatch(op.operation_id)] == ["failed"]
    row = client.get_goal_operation(op.operation_id)
    # Under the code every spent budget has (status counts it), with why it kept failing.
    assert row.attempt == DISPATCH_MAX_ATTEMPTS
    assert row.last_error.startswith(f"budget_exhausted ({DISPATCH_MAX_ATTEMPTS} attempts): ")
    assert "server_error" in row.last_error, row.last_error


def test_time_budget(client, dispatcher, sim_control, clock):
    sim_control.fault("goal", status=503, count=1000)
    op = client.set_goal(WS, SID, "ship it", client_submit_id="s-1")
    dispatcher().dispatch(op.operation_id)
    clock.advance(599)
    assert [r.outcome for r in dispatcher().dispatch(op.operation_id)] == ["retry"]
    clock.advance(1)
    assert [r.outcome for r in dispatcher().dispatch(op.operation_id)] == ["failed"]
    last_error = client.get_goal_operation(op.operation_id).last_error
    assert last_error.startswith("budget_exhausted (dispatching for 600 s): "), last_error
    assert "server_error" in last_error, last_error


def test_client_operation_resumes_an_offline_session_whose_fence_is_not_at_its_host(
    client, dispatcher, sim_control
):
    """A fence settled locally while the session was offline is not at its host: the next
    client goal's call installs it first, finds the session offline there, and resumes it
    (the fence preloaded) and applies, as without a fence. It retried until its budget
    failed it (found by a new user's trial)."""
    from tests.helpers import fence_applier

    first = client.set_goal(WS, SID, "shared", client_submit_id="s-1")
    assert [r.outcome for r in dispatcher().dispatch(first.operation_id)] == ["applied"]
    sim_control.session(WS, SID, live=False)
    fence = client.fence_goal_generation(WS, SID, first.operation_id, client_submit_id="f-1")
    applier = fence_applier(client, sim_control.http.base_url)
    assert applier.apply(fence.fence_id) == "completed_offline"
    op = client.set_goal(WS, SID, "after the fence", client_submit_id="s-2")
    assert [r.outcome for r in dispatcher().dispatch(op.operation_id)] == ["applied"]
    resumes = sim_control.effects("resume")
    assert [r["fences"] for r in resumes] == [
        [{"target_operation_id": first.operation_id, "target_revision": 1}]
    ]
    # The fence's clear, settled locally, goes on the return; then the new goal: each once.
    assert [e["objective"] for e in sim_control.effects()] == ["shared", None, "after the fence"]


def test_client_operation_resumes_an_offline_session(client, dispatcher, sim_control):
    sim_control.session(WS, SID, live=False)
    op = client.set_goal(WS, SID, "ship it", client_submit_id="s-1")
    assert [r.outcome for r in dispatcher().dispatch(op.operation_id)] == ["applied"]
    kinds = [e["kind"] for e in sim_control.effects(kind=None) if e["kind"] in ("resume", "goal")]
    assert kinds == ["resume", "goal"]
    assert client.session_info(WS, SID).live is True


def test_a_lane_holder_serializes_the_session(client, dispatcher, clock, settings):
    op = client.set_goal(WS, SID, "ship it", client_submit_id="s-1")
    lane = ids.lane_name(WS, SID)
    from agent_radar.workflows import leases

    token = run_transaction(
        client.engine, lambda s: leases.claim(s, lane, "someone-else", settings.lease_s, clock())
    )
    assert token
    assert dispatcher().dispatch(op.operation_id) == []  # the holder will drain it
    run_transaction(client.engine, lambda s: leases.release(s, lane, token))
    assert [r.outcome for r in dispatcher().dispatch(op.operation_id)] == ["applied"]


def test_an_expired_lease_holder_cannot_write(client, dispatcher, clock, settings, sim_control):
    """Worker A claims, stalls past its lease; B takes over; A's late write is refused."""
    op = client.set_goal(WS, SID, "ship it", client_submit_id="s-1")
    a = dispatcher("worker-a")
    claim = run_transaction(client.engine, lambda s: a.claim(s, op.operation_id))
    answer = a._call_runtime(a.runtime, claim)
    clock.advance(settings.lease_s + 1)
    b = dispatcher("worker-b")
    assert [r.outcome for r in b.dispatch(op.operation_id)] == ["applied"]
    row_after_b = client.get_goal_operation(op.operation_id)
    from agent_radar.workflows.goals import outcomes

    def late(record):
        return run_transaction(client.engine, record).outcome

    assert late(lambda s: outcomes.answer_outcome(s, claim, answer, clock())) == "skipped"
    fault = RuntimeError("late")
    assert late(lambda s: outcomes.fault_outcome(s, claim, fault, True, clock())) == "skipped"
    assert client.get_goal_operation(op.operation_id) == row_after_b
    assert row_after_b.attempt == 2
    assert len(sim_control.effects()) == 1  # the runtime deduped by operation id


BAD_INPUTS = [
    dict(workspace_id=""),
    dict(workspace_id="w" * 256),
    dict(session_id=42),
    dict(session_id="tab\there"),
    dict(client_submit_id=""),
    dict(client_submit_id="x" * 256),
    dict(action="explode"),
    dict(objective="o" * (16 * 1024 + 1)),
    dict(objective=""),
    dict(objective=["not", "text"]),
    dict(expected_revision="1"),
    dict(expected_revision=True),
    dict(expected_revision=-1),
]


@pytest.mark.parametrize(
    "bad", BAD_INPUTS, ids=lambda b: next(iter(b)) + "=" + repr(next(iter(b.values())))[:20]
)
def test_bad_input_is_a_typed_error_and_writes_nothing(client, bad):
    before = row_counts(client.engine)
    args = (
        dict(
            workspace_id=WS,
            session_id=SID,
            action="set",
            objective="ok",
            client_submit_id="s-1",
            expected_revision=None,
        )
        | bad
    )
    with pytest.raises(InvalidArgument):
        client.goal_control(
            args.pop("workspace_id"),
            args.pop("session_id"),
            args.pop("action"),
            args.pop("objective"),
            **args,
        )
    assert row_counts(client.engine) == before


def test_objective_at_the_limit_is_accepted(client):
    op = client.set_goal(WS, SID, "o" * (16 * 1024), client_submit_id="s-1")
    assert op.status == "prepared"


def test_clear_takes_no_objective(client):
    with pytest.raises(InvalidArgument):
        client.goal_control(WS, SID, "clear", "no", client_submit_id="c-1")


def test_unknown_records_are_not_found(client):
    from agent_radar.workflows.errors import NotFound

    with pytest.raises(NotFound):
        client.get_goal_operation(str(uuid.uuid4()))
    with pytest.raises(NotFound):
        client.goal_state(WS, "nobody")


def test_session_fields_from_an_older_report_are_ignored(client):
    def report(at_ms, live, epoch):
        return {
            "workspace_id": WS,
            "session_id": SID,
            "occurred_at_ms": REPORT_EPOCH_MS + at_ms,
            "session": {
                "provider": "claude-code",
                "provider_session_id": "p-1",
                "live": live,
                "runtime_epoch": epoch,
            },
        }

    client.report_activity(report(2_000, True, 3))
    client.report_activity(report(1_000, False, 2))  # arrived late: older facts
    info = client.session_info(WS, SID)
    assert (info.live, info.provider) == (True, "claude-code")
    client.report_activity(report(3_000, False, 4))
    info = client.session_info(WS, SID)
    # An epoch is a claim the host confirms (tests/rules/test_epochs.py); here it would act
    # on nothing, so nothing asks.
    assert (info.live, info.runtime_epoch) == (False, 0)


@pytest.mark.parametrize(
    "report",
    [
        "not a dict",
        {"workspace_id": WS, "session_id": SID},
        {"workspace_id": WS, "session_id": SID, "occurred_at_ms": 1_764_770_000_000, "extra": 1},
        {
            "workspace_id": WS,
            "session_id": SID,
            "occurred_at_ms": 1_764_770_000_000,
            "session": {"live": "yes"},
        },
        {
            "workspace_id": WS,
            "session_id": SID,
            "occurred_at_ms": 1_764_770_000_000,
            "goal_applied": {"operation_id": "x", "revision": 0},
        },
    ],
)
def test_malformed_reports_write_nothing(client, report):
    before = row_counts(client.engine)
    with pytest.raises(InvalidArgument):
        client.report_activity(report)
    assert row_counts(client.engine) == before


def test_a_report_timed_in_seconds_is_refused_and_says_so(client):
    """A host that sends its time in seconds would have its reports taken as of 1970 and
    ignored behind any later one: refused instead, saying what is wrong."""
    before = row_counts(client.engine)
    turn = {"turn_id": "t1", "phase": "running"}
    report = {"workspace_id": WS, "session_id": SID, "occurred_at_ms": 1_764_770_000}
    with pytest.raises(InvalidArgument, match="milliseconds since the Unix epoch"):
        client.report_activity({**report, "turn": turn})
    assert row_counts(client.engine) == before


def test_runtime_bearer_token_is_sent_and_checked(settings):
    from agent_radar.workflows.errors import RuntimeFault
    from agent_radar.workflows.tools.simulator import SimControl, SimServer
    from tests.conftest import free_port

    server = SimServer("127.0.0.1", free_port(), token="s3cret").start()
    try:
        assert HttpRuntime(server.url, token="s3cret").liveness(WS, SID)["live"] is True
        with pytest.raises(RuntimeFault) as err:
            HttpRuntime(server.url, token="wrong").liveness(WS, SID)
        assert err.value.code == "unauthorized" and err.value.retryable is False
        # The control endpoints need the token too: they can take sessions offline and
        # list every effect.
        for token in (None, "wrong", "s3cre", "s3cret2"):
            with pytest.raises(RuntimeFault) as err:
                SimControl(server.url, token).effects()
            assert err.value.code == "unauthorized"
            with pytest.raises(RuntimeFault):
                SimControl(server.url, token).session(WS, SID, live=False)
        assert SimControl(server.url, "s3cret").effects() == []
        assert HttpRuntime(server.url, token="s3cret").liveness(WS, SID)["live"] is True
    finally:
        server.stop()


def test_bearer_tokens_are_compared_in_constant_time():
    from agent_radar.workflows.tools.simulator import bearer_matches

    assert bearer_matches(None, None) and bearer_matches("anything", None)
    assert bearer_matches("Bearer tok", "tok")
    assert not bearer_matches("Bearer tok2", "tok") and not bearer_matches(None, "tok")
    assert not bearer_matches("Bearer t\u00f6k", "tok")


def _turn_report(turn_id, phase, at_ms, outcome=None, **provenance):
    return {
        "workspace_id": WS,
        "session_id": SID,
        "occurred_at_ms": REPORT_EPOCH_MS + at_ms,
        "turn": {
            "turn_id": turn_id,
            "phase": phase,
            "outcome": outcome,
            "origin": "goal_continuation",
            **provenance,
        },
    }


def test_turn_phases_only_move_forward(client):
    from agent_radar.models.tables import Turn

    provenance = {"source_goal_operation_id": "op-1", "source_goal_revision": 1}
    client.report_activity(_turn_report("t1", "running", 1_000, **provenance))
    assert client.session_info(WS, SID).active_turn_id == "t1"
    client.report_activity(_turn_report("t1", "settled", 2_000, outcome="completed"))
    client.report_activity(_turn_report("t1", "running", 3_000))  # late: ignored
    client.report_activity(_turn_report("t1", "settled", 4_000, outcome="failed"))  # final
    turn = run_transaction(client.engine, lambda s: s.get(Turn, (WS, SID, "t1")))
    assert (turn.phase, turn.outcome) == ("settled", "completed")
    assert (turn.source_goal_operation_id, turn.source_goal_revision) == ("op-1", 1)
    assert client.session_info(WS, SID).active_turn_id is None


@pytest.mark.parametrize(
    "turn",
    [
        {"turn_id": "t", "phase": "flying"},
        {"turn_id": "t"},
        {"turn_id": "t", "phase": "settled"},
        {"turn_id": "", "phase": "running"},
        {"turn_id": "t", "phase": "running", "source_goal_revision": 0},
        {"turn_id": "t", "phase": "running", "colour": "red"},
    ],
)
def test_malformed_turn_reports_write_nothing(client, turn):
    before = row_counts(client.engine)
    with pytest.raises(InvalidArgument):
        client.report_activity(
            {
                "workspace_id": WS,
                "session_id": SID,
                "occurred_at_ms": 1_764_770_000_000,
                "turn": turn,
            }
        )
    assert row_counts(client.engine) == before


def _lane_tokens(client, session_ids):
    from agent_radar.models.tables import Lease

    names = [ids.lane_name(WS, sid) for sid in session_ids]
    return run_transaction(
        client.engine,
        lambda s: dict(
            s.execute(select(Lease.name, Lease.token).where(Lease.name.in_(names))).all()
        ),
    )


def test_several_sessions_move_in_one_step(client, dispatcher, sim_control):
    superseded = client.set_goal(WS, "batch-0", "older", client_submit_id="0")
    ops = [client.set_goal(WS, f"batch-{i}", f"goal {i}", client_submit_id="1") for i in range(5)]
    results = dispatcher().dispatch_many(
        [superseded.operation_id] + [op.operation_id for op in ops]
    )
    assert sorted((r.operation_id, r.outcome) for r in results) == sorted(
        (op.operation_id, "applied") for op in ops
    )
    for op in ops:
        done = client.get_goal_operation(op.operation_id)
        assert (done.status, done.attempt, done.lease_token) == ("completed", 1, None)
        assert done.evidence == {"applied_revision": op.goal_revision}
        assert client.goal_state(WS, op.session_id).sync_status == "synced"
    effects = [e["operation_id"] for e in sim_control.effects()]
    assert sorted(effects) == sorted(op.operation_id for op in ops)
    assert set(_lane_tokens(client, [op.session_id for op in ops]).values()) == {None}


def test_a_dispatch_under_a_backlog_takes_other_due_operations_along(
    client, dispatcher, sim_control, clock
):
    ops = [client.set_goal(WS, f"steal-{i}", "x", client_submit_id="1") for i in range(6)]
    clock.advance(1)  # the dispatcher's clock started before the submits
    results = dispatcher().dispatch_many([ops[1].operation_id])
    assert {r.operation_id for r in results if r.outcome == "applied"} == {
        op.operation_id for op in ops
    }
    # The message of an operation taken along now costs one read and does nothing.
    assert dispatcher().dispatch_many([ops[2].operation_id]) == []
    assert len(sim_control.effects()) == 6


def test_a_dispatch_whose_work_is_done_still_takes_due_work_along(
    client, dispatcher, sim_control, clock, backend
):
    """Under load the messages queue behind the work they carry: most find their operation
    already taken along. On PostgreSQL such a message takes whatever is due, so an operation
    waits for the next message any worker takes, not for its own to come up in the queue. On
    SQLite (one writer at a time) it takes nothing: its write transaction would only queue
    behind the dispatch already draining the backlog."""
    done = client.set_goal(WS, "done", "x", client_submit_id="1")
    clock.advance(1)
    dispatcher().dispatch(done.operation_id)
    waiting = client.set_goal(WS, "waiting", "x", client_submit_id="1")
    clock.advance(1)
    results = dispatcher().dispatch_many([done.operation_id])
    if backend == "embedded":
        assert results == []
        assert client.get_goal_operation(waiting.operation_id).status == "prepared"
        return
    assert [(r.operation_id, r.outcome) for r in results] == [(waiting.operation_id, "applied")]
    assert client.get_goal_operation(waiting.operation_id).status == "completed"
    assert [e["operation_id"] for e in sim_control.effects()] == [
        done.operation_id,
        waiting.operation_id,
    ]


def _due_at(client, op, at):
    """Make an operation due at `at` (its next attempt)."""
    run_transaction(
        client.engine,
        lambda s: s.execute(
            update(OPS).where(OPS.c.operation_id == op.operation_id).values(next_attempt_at=at)
        ),
    )


def _during_the_calls(d, act):
    """Run `act()` each time the dispatcher `d` calls the runtime, before the call; what `d`
    called before (to put back)."""
    attempt = d.attempt

    def meanwhile(claim):
        act()
        return attempt(claim)

    d.attempt = meanwhile
    return attempt


@pytest.mark.parametrize("backend", ["production"])  # where a step's end takes work anywhere
def test_a_steps_end_leaves_work_just_come_due_to_its_message(
    client, dispatcher, sim_control, clock
):
    """At a step's end a dispatch that steals takes other sessions' work only once it has
    been due for STEAL_AFTER: work due for less has its message on the way (most often to
    an idle process), which would otherwise wait for the lane this step creates only to
    find its work taken."""
    from agent_radar.workflows.goals.lanes import STEAL_AFTER

    own = client.set_goal(WS, "own", "x", client_submit_id="1")
    fresh = client.set_goal(WS, "fresh", "x", client_submit_id="1")
    stale = client.set_goal(WS, "stale", "x", client_submit_id="1")
    clock.advance(1)

    # Not due when the dispatch starts (its message's read would take them along); both
    # come due during its step, one of them just now, the other STEAL_AFTER ago.
    _due_at(client, fresh, clock.now + timedelta(hours=1))
    _due_at(client, stale, clock.now + timedelta(hours=1))
    d = dispatcher()
    attempt = _during_the_calls(
        d,
        lambda: (
            _due_at(client, fresh, clock.now - STEAL_AFTER / 2),
            _due_at(client, stale, clock.now - STEAL_AFTER),
        ),
    )
    results = d.dispatch_many([own.operation_id])
    assert [(r.operation_id, r.outcome) for r in results] == [
        (own.operation_id, "applied"),
        (stale.operation_id, "applied"),
    ]
    assert client.get_goal_operation(fresh.operation_id).status == "prepared"
    assert set(_lane_tokens(client, ["fresh"]).values()) <= {None}
    # Its own message takes it.
    d.attempt = attempt
    assert [r.outcome for r in d.dispatch_many([fresh.operation_id])] == ["applied"]
    assert len(sim_control.effects()) == 3


@pytest.mark.parametrize("backend", ["production"])  # where a step's end takes work anywhere
def test_a_late_messages_steps_take_work_however_young(client, dispatcher, sim_control, clock):
    """A message that comes after its work was taken says the messages lag behind the work
    (under load they queue, and their work is taken along): the steps of the dispatch it
    starts take every due operation at their ends, however young, rather than leave it
    STEAL_AFTER for a message that is itself late. A message that finds its own work leaves
    such work alone (test_a_steps_end_leaves_work_just_come_due_to_its_message)."""
    from agent_radar.workflows.goals.lanes import STEAL_AFTER

    taken = client.set_goal(WS, "taken", "x", client_submit_id="1")
    fresh = client.set_goal(WS, "fresh", "x", client_submit_id="1")
    clock.advance(1)

    # `taken` was dispatched before its message came; `fresh` comes due during the step
    # that the late message starts with `other`, just now.
    _due_at(client, fresh, clock.now + timedelta(hours=1))
    d = dispatcher()
    assert [r.outcome for r in d.dispatch_many([taken.operation_id])] == ["applied"]
    other = client.set_goal(WS, "other", "x", client_submit_id="1")
    clock.advance(1)
    _during_the_calls(d, lambda: _due_at(client, fresh, clock.now - STEAL_AFTER / 2))
    results = d.dispatch_many([taken.operation_id])
    assert [(r.operation_id, r.outcome) for r in results] == [
        (other.operation_id, "applied"),
        (fresh.operation_id, "applied"),
    ]
    assert [e["operation_id"] for e in sim_control.effects()] == [
        taken.operation_id,
        other.operation_id,
        fresh.operation_id,
    ]


def test_a_batch_skips_a_session_whose_lane_another_worker_holds(
    client, dispatcher, clock, settings
):
    from agent_radar.workflows import leases

    free = client.set_goal(WS, "free", "x", client_submit_id="1")
    busy = client.set_goal(WS, "busy", "x", client_submit_id="1")
    token = run_transaction(
        client.engine,
        lambda s: leases.claim(
            s, ids.lane_name(WS, "busy"), "someone-else", settings.lease_s, clock()
        ),
    )
    results = dispatcher().dispatch_many([free.operation_id, busy.operation_id])
    assert [(r.operation_id, r.outcome) for r in results] == [(free.operation_id, "applied")]
    assert client.get_goal_operation(busy.operation_id).status == "prepared"
    assert _lane_tokens(client, ["busy"]) == {ids.lane_name(WS, "busy"): token}


def test_a_step_takes_no_more_lanes_than_it_calls_at_once(
    client, dispatcher, sim_control, clock, backend
):
    """A dispatch claims at most MAX_LANES_PER_STEP lanes at once, the given operations
    first, and calls no host more than DEFAULT_HOST_CONCURRENCY times at once; on PostgreSQL a
    dispatch that steals then goes on with the rest of the backlog as its calls finish,
    without another message (on SQLite the rest waits for the next message)."""
    from agent_radar.workflows.adapters.config import DEFAULT_HOST_CONCURRENCY
    from agent_radar.workflows.goals.statements import MAX_LANES_PER_STEP

    given = [client.set_goal(WS, f"given-{i}", "x", client_submit_id="1") for i in range(10)]
    others = [
        client.set_goal(WS, f"other-{i}", "x", client_submit_id="1")
        for i in range(MAX_LANES_PER_STEP)
    ]
    clock.advance(1)
    d = dispatcher()
    started: list[str] = []
    at_once = [0, 0]  # now, most
    lock = threading.Lock()
    attempt = d.attempt

    def counted(claim):
        with lock:
            started.append(claim.op.operation_id)
            at_once[0] += 1
            at_once[1] = max(at_once)
        try:
            return attempt(claim)
        finally:
            with lock:
                at_once[0] -= 1

    d.attempt = counted
    results = d.dispatch_many([op.operation_id for op in given])
    drained = backend == "production"
    expected = MAX_LANES_PER_STEP + (10 if drained else 0)
    assert [r.outcome for r in results] == ["applied"] * expected, [
        client.get_goal_operation(r.operation_id).last_error
        for r in results
        if r.outcome != "applied"
    ]
    assert len(started) == expected and at_once[1] <= DEFAULT_HOST_CONCURRENCY
    assert {op.operation_id for op in given} <= set(started[:MAX_LANES_PER_STEP])
    left = [op for op in given + others if op.operation_id not in set(started)]
    assert len(left) == (0 if drained else 10)
    assert {client.get_goal_operation(op.operation_id).status for op in left} <= {"prepared"}
    # Given more operations than one step takes, a dispatch runs them in several steps.
    more = [
        client.set_goal(WS, f"more-{i}", "x", client_submit_id="1")
        for i in range(MAX_LANES_PER_STEP + 8)
    ]
    clock.advance(1)
    results = dispatcher().dispatch_many([op.operation_id for op in more])
    # (On SQLite the last step takes the rest of the backlog along with its own.)
    assert sorted(r.operation_id for r in results) == sorted(op.operation_id for op in more + left)


@pytest.mark.parametrize("backend", ["production"])  # where a dispatch drains a backlog
def test_a_dispatch_lets_go_of_a_backlog_after_its_time(
    client, dispatcher, sim_control, clock, monkeypatch
):
    """A dispatch that steals drains a backlog as its calls finish, but claims nothing more
    after DRAIN_BUDGET_S: what it did not claim stays due, its lanes free, no attempt
    counted."""
    from agent_radar.workflows.goals.statements import MAX_LANES_PER_STEP
    from agent_radar.workflows.steps.goals import flight

    monkeypatch.setattr(flight, "DRAIN_BUDGET_S", 0.0)
    ops = [
        client.set_goal(WS, f"backlog-{i}", "x", client_submit_id="1")
        for i in range(MAX_LANES_PER_STEP + 5)
    ]
    clock.advance(1)
    results = dispatcher().dispatch_many([ops[0].operation_id])
    assert [r.outcome for r in results] == ["applied"] * MAX_LANES_PER_STEP
    left = [op for op in ops if op.operation_id not in {r.operation_id for r in results}]
    assert len(left) == 5
    for op in left:
        back = client.get_goal_operation(op.operation_id)
        assert (back.status, back.attempt, back.lease_token) == ("prepared", 0, None)
    assert set(_lane_tokens(client, [op.session_id for op in ops]).values()) == {None}
    # The next message (whichever) takes them.
    again = dispatcher().dispatch_many([ops[0].operation_id])
    assert sorted(r.operation_id for r in again) == sorted(op.operation_id for op in left)
    assert len(sim_control.effects()) == len(ops)

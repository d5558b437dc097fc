"""Goal generation fences, submit side (docs/lifecycles.md: fences), on both backends."""

import time
import uuid
from datetime import timedelta

import pytest

from agent_radar.beat.sweeper import OUTBOX_GRACE_S, sweep_once
from agent_radar.models.base import utcnow
from agent_radar.models.db import run_transaction
from agent_radar.models.tables import Turn
from agent_radar.workflows import budgets, ids
from agent_radar.workflows.errors import FenceConflict, InvalidArgument, NotFound
from tests.helpers import eventually, fence_applier, row_counts

WS, SID = "ws-fence", "shared"


def test_fence_of_the_current_generation_prepares_a_clear(client):
    target = client.set_goal(WS, SID, "shared goal", client_submit_id="owner-1")
    fence = client.fence_goal_generation(
        WS, SID, target.operation_id, client_submit_id="revoke-1", reason="binding revoked"
    )
    assert fence.fence_id == str(uuid.uuid5(ids.NAMESPACE, f"fence\0{WS}\0{SID}\0revoke-1"))
    assert (fence.status, fence.target_revision, fence.intent_accepted, fence.settled) == (
        "pending",
        1,
        True,
        False,
    )
    clear = client.get_goal_operation(fence.clear_operation_id)
    assert (clear.action, clear.origin, clear.goal_revision) == ("clear", "fence", 2)
    assert clear.client_submit_id == f"goal-generation-fence:{fence.fence_id}"
    state = client.goal_state(WS, SID)
    assert state.tombstoned and state.revision == 2 and state.desired is None
    # the target had not been dispatched yet: it never will be
    assert client.get_goal_operation(target.operation_id).status == "superseded"


def test_fence_never_touches_a_newer_owner_goal(client):
    shared = client.set_goal(WS, SID, "shared goal", client_submit_id="shared-1")
    client.set_goal(WS, SID, "owner's own goal", client_submit_id="owner-2")
    fence = client.fence_goal_generation(WS, SID, shared.operation_id, client_submit_id="revoke-1")
    assert fence.clear_operation_id is None and fence.target_revision == 1
    state = client.goal_state(WS, SID)
    assert state.revision == 2 and not state.tombstoned
    assert state.desired == {"objective": "owner's own goal", "status": "active"}


def test_fence_replay_and_conflicts_write_nothing(client):
    a = client.set_goal(WS, SID, "a", client_submit_id="a")
    b = client.set_goal(WS, SID, "b", client_submit_id="b")
    fence = client.fence_goal_generation(WS, SID, a.operation_id, client_submit_id="f-1")
    before = row_counts(client.engine)
    assert client.fence_goal_generation(WS, SID, a.operation_id, client_submit_id="f-1") == fence
    with pytest.raises(FenceConflict):
        client.fence_goal_generation(WS, SID, b.operation_id, client_submit_id="f-1")
    with pytest.raises(FenceConflict):
        client.fence_goal_generation(WS, SID, a.operation_id, client_submit_id="f-2")
    assert row_counts(client.engine) == before


def test_fence_target_must_belong_to_the_session(client):
    elsewhere = client.set_goal("other-ws", SID, "x", client_submit_id="a")
    other_session = client.set_goal(WS, "other-session", "x", client_submit_id="a")
    before = row_counts(client.engine)
    for target in (elsewhere.operation_id, other_session.operation_id, str(uuid.uuid4())):
        with pytest.raises(NotFound):
            client.fence_goal_generation(WS, SID, target, client_submit_id="f-1")
    with pytest.raises(InvalidArgument):
        client.fence_goal_generation(WS, SID, "", client_submit_id="f-1")
    with pytest.raises(InvalidArgument):
        client.fence_goal_generation(
            WS, SID, other_session.operation_id, client_submit_id="f-1", reason=7
        )
    assert row_counts(client.engine) == before


def test_the_generic_sweep_leaves_a_fence_clear_to_its_fence(client):
    target = client.set_goal(WS, SID, "shared goal", client_submit_id="owner-1")
    fence = client.fence_goal_generation(WS, SID, target.operation_id, client_submit_id="f-1")
    published = []
    later = fence.created_at + timedelta(seconds=OUTBOX_GRACE_S + 1)
    sweep_once(
        client.engine, lambda task, kwargs: published.append(kwargs) or True, later, owner="t"
    )
    assert {"operation_id": fence.clear_operation_id} not in published


def test_a_clear_retried_after_its_fence_completed_is_the_sweeper_s(client, sim_control):
    """The host refused the clear for good: the fence completes (its generation is fenced)
    and the clear fails, in sight. An operator retries the clear once the host is put right;
    the retry's one attempt meets a passing fault. No fence drives the clear any more, so the
    sweeper publishes it again as any due operation, and it reaches the host once."""
    from agent_radar.workflows.steps.goals.dispatch import Dispatcher

    target = client.set_goal(WS, SID, "shared goal", client_submit_id="owner-1")
    fence = client.fence_goal_generation(WS, SID, target.operation_id, client_submit_id="f-1")
    sim_control.fault("goal", status=422, error="rejected", count=1, session_id=SID)
    assert fence_applier(client, sim_control.http.base_url).apply(fence.fence_id) == "completed"
    assert client.get_goal_operation(fence.clear_operation_id).status == "failed"
    client.retry_operation(fence.clear_operation_id, reason="the host is fixed")
    sim_control.fault("goal", status=503, count=1, session_id=SID)
    d = Dispatcher(client.engine, client.runtime, worker_id="d", lease_s=5)
    assert [r.outcome for r in d.dispatch(fence.clear_operation_id)] == ["retry"]
    published = []
    later = utcnow() + timedelta(minutes=5)
    sweep_once(client.engine, lambda task, kw: published.append(kw) or True, later, owner="t")
    assert {"operation_id": fence.clear_operation_id} in published
    assert [r.outcome for r in d.dispatch(fence.clear_operation_id)] == ["applied"]
    assert client.get_goal_operation(fence.clear_operation_id).status == "completed"
    assert client.goal_state(WS, SID).sync_status == "synced"
    clears = [e for e in sim_control.effects() if e["action"] == "clear"]
    assert [e["operation_id"] for e in clears] == [fence.clear_operation_id]


def test_a_clear_whose_lane_another_took_is_not_sent(client, sim_control):
    """The fence applies its clear under the session's lane it holds: if its lease lapsed and
    another took the lane meanwhile (a goal call may be on its way there), the clear is not
    claimed nor sent, and goes again later."""
    from agent_radar.workflows import leases
    from agent_radar.workflows.goals.claims import Lane

    target = client.set_goal(WS, SID, "shared goal", client_submit_id="owner-1")
    fence = client.fence_goal_generation(WS, SID, target.operation_id, client_submit_id="f-1")
    applier = fence_applier(client, sim_control.http.base_url)
    lane = ids.lane_name(WS, SID)
    then = utcnow()
    mine = run_transaction(client.engine, lambda s: leases.claim(s, lane, "fence", 1, then))
    later = then + timedelta(seconds=2)
    assert run_transaction(client.engine, lambda s: leases.claim(s, lane, "other", 30, later))
    outcome = applier.dispatcher.apply_now(fence.clear_operation_id, Lane(WS, SID, mine))
    assert outcome == "retry"
    assert client.get_goal_operation(fence.clear_operation_id).status == "prepared"
    assert [e for e in sim_control.effects() if e["action"] == "clear"] == []


def test_ensure_session_resumes_with_every_fence_and_reinstalls_them(client, sim_control):
    first = client.set_goal(WS, SID, "one", client_submit_id="1")
    second = client.set_goal(WS, SID, "two", client_submit_id="2")
    client.fence_goal_generation(WS, SID, first.operation_id, client_submit_id="f-1")
    client.fence_goal_generation(WS, SID, second.operation_id, client_submit_id="f-2")
    sim_control.session(WS, SID, live=False)
    client.ensure_session(WS, SID)
    effects = sim_control.effects(kind=None)
    resume = next(e for e in effects if e["kind"] == "resume")
    expected = [
        {"target_operation_id": first.operation_id, "target_revision": 1},
        {"target_operation_id": second.operation_id, "target_revision": 2},
    ]
    assert resume["fences"] == expected
    state = sim_control.session(WS, SID)
    assert sorted(map(tuple, state["fences"])) == sorted(
        (f["target_operation_id"], f["target_revision"]) for f in expected
    )


def test_a_fenced_generation_is_refused_by_the_agent(client, sim_control, settings):
    from agent_radar.workflows.adapters.http_runtime import HttpRuntime
    from agent_radar.workflows.steps.goals.dispatch import Dispatcher

    op = client.set_goal(WS, SID, "one", client_submit_id="1")
    sim_control.session(WS, SID)  # the agent host knows the session
    HttpRuntime(settings.runtime_url).install_fence(
        WS, SID, target_operation_id=op.operation_id, target_revision=1, require_live=True
    )
    d = Dispatcher(
        client.engine, HttpRuntime(settings.runtime_url, timeout_s=2), worker_id="w", lease_s=5
    )
    assert [r.outcome for r in d.dispatch(op.operation_id)] == ["failed"]
    assert sim_control.effects() == []


def test_cancel_replay_and_conflict(client):
    from agent_radar.models.base import utcnow
    from agent_radar.models.db import run_transaction
    from agent_radar.workflows.errors import CancelConflict
    from agent_radar.workflows.fences import cancels

    first = run_transaction(
        client.engine, lambda s: cancels.prepare(s, WS, SID, "turn-1", "fence", utcnow())
    )
    assert first.operation_id == ids.cancel_operation_id(WS, SID, "turn-1")
    before = row_counts(client.engine)
    again = run_transaction(
        client.engine, lambda s: cancels.prepare(s, WS, SID, "turn-1", "fence", utcnow())
    )
    assert again.operation_id == first.operation_id
    with pytest.raises(CancelConflict):
        run_transaction(
            client.engine,
            lambda s: cancels.prepare(s, WS, SID, "turn-1", "another reason", utcnow()),
        )
    assert row_counts(client.engine) == before


def _leased_cancel(client, clock_now):
    from agent_radar.models.db import run_transaction
    from agent_radar.workflows.activity.activity import apply_turn
    from agent_radar.workflows.fences import cancels
    from agent_radar.workflows.sessions.rows import lock_session

    def seed(s):
        row = lock_session(s, WS, SID)
        row.live = True
        apply_turn(
            s,
            row,
            {
                "turn_id": "turn-9",
                "phase": "running",
                "outcome": None,
                "origin": "goal_continuation",
                "source_goal_operation_id": None,
                "source_goal_revision": None,
                "prompt_id": None,
            },
            clock_now,
            0,
            clock_now,
        )
        cancel = cancels.prepare(s, WS, SID, "turn-9", "fence", clock_now)
        cancels.claim(s, cancel, "dead-worker", 1, clock_now)
        return cancel.operation_id

    return run_transaction(client.engine, seed)


def _runner(client, sim_control, clock, published=None):
    from agent_radar.workflows.adapters.http_runtime import HttpRuntime
    from agent_radar.workflows.steps.cancel import CancelRunner

    return CancelRunner(
        client.engine,
        HttpRuntime(sim_control.http.base_url),
        worker_id="w",
        lease_s=3,
        publish=lambda task, kwargs: (
            (published if published is not None else []).append((task, kwargs)) or True
        ),
        clock=clock,
    )


def test_a_stale_cancel_of_an_offline_session_waits_then_goes_once_it_is_live(client, sim_control):
    """docs/lifecycles.md: cancels: a disconnected session is no end (the turn may still run behind
    a network fault): the cancel waits, using no budget and never resuming the session, and is
    delivered when the session is live again."""
    from agent_radar.models.db import run_transaction
    from agent_radar.models.operations import CancelOperation
    from agent_radar.models.tables import Turn
    from tests.helpers import Clock

    clock = Clock()
    op_id = _leased_cancel(client, clock.now)
    sim_control.session(WS, SID, live=False)
    clock.advance(5)  # the dead worker's lease is long gone
    runner = _runner(client, sim_control, clock)
    for _ in range(3):
        assert runner.apply(op_id) == "waiting_offline"
        clock.advance(15)
    cancel = run_transaction(client.engine, lambda s: s.get(CancelOperation, op_id))
    assert (cancel.status, cancel.attempt, cancel.lease_token) == ("leased", 1, None)
    assert cancel.next_attempt_at > clock.now - timedelta(seconds=15)
    turn = run_transaction(client.engine, lambda s: s.get(Turn, (WS, SID, "turn-9")))
    assert turn.phase == "running"  # not settled behind the agent's back
    assert {c["call"] for c in sim_control.calls()} == {"liveness"}  # no cancel, no resume
    assert client.session_info(WS, SID).live is False
    sim_control.session(WS, SID, live=True)
    runner.apply(op_id)  # (this host never ran turn-9: it answers not_found, a retry)
    assert [c["call"] for c in sim_control.calls()][-1] == "turns/turn-9/cancel"
    cancel = run_transaction(client.engine, lambda s: s.get(CancelOperation, op_id))
    assert cancel.attempt == 2  # the dead worker's try and this delivery; waits were free


def test_an_offline_answer_written_after_a_newer_live_one_is_dropped(client, sim_control):
    """docs/lifecycles.md: sessions: whether a session is live is the last answer its host gave,
    by when it was asked. A worker told `disconnected` that writes it only after another worker
    was told the session is live (a restore slowed between its call and its write) leaves the
    session live; an answer asked later still counts."""
    from agent_radar.models.base import utcnow
    from agent_radar.workflows.errors import RuntimeDisconnected
    from agent_radar.workflows.fences import restores
    from agent_radar.workflows.sessions.rows import Heard, heard_in
    from agent_radar.workflows.steps.cancel import mark_offline
    from tests.helpers import Clock

    clock = Clock()
    runner = _runner(client, sim_control, clock)
    sim_control.session(WS, SID)
    sim_control.fault("liveness", status=409, error="disconnected", count=1, session_id=SID)
    with pytest.raises(RuntimeDisconnected) as slow:  # the first worker's call: its write waits
        runner.require_live(WS, SID)
    clock.now = utcnow() + timedelta(seconds=1)  # (the step's clock: a second later)
    stale = heard_in(slow.value, clock.now)
    assert stale.at < clock.now  # stamped by the adapter when it was asked
    runner.require_live(WS, SID)  # a second worker asked after it: live, recorded at once
    assert client.session_info(WS, SID).live is True
    clock.advance(1)
    run_transaction(
        client.engine,
        lambda s: restores.finish(s, WS, SID, clock.now, "offline", None, clock.now, stale),
    )
    run_transaction(client.engine, lambda s: mark_offline(s, WS, SID, stale))
    assert client.session_info(WS, SID).live is True  # the older answers are dropped
    run_transaction(client.engine, lambda s: mark_offline(s, WS, SID, Heard(clock.now)))
    assert client.session_info(WS, SID).live is False  # a newer one counts


def test_a_host_s_report_of_liveness_is_ordered_with_its_answers(client):
    """docs/lifecycles.md: sessions: a report's `live` is the host's word at the time it says,
    ordered with the answers to calls: a `disconnected` asked before the report and written
    after it is dropped, and a report saying offline outlasts a live answer asked before it."""
    import time

    from agent_radar.models.base import utcnow
    from agent_radar.workflows.sessions.rows import Heard, lock_session, record_liveness
    from agent_radar.workflows.steps.cancel import mark_offline

    def report(live: bool):
        time.sleep(0.01)  # (reports carry milliseconds)
        said = utcnow()
        client.report_activity(
            {
                "workspace_id": WS,
                "session_id": SID,
                "occurred_at_ms": int(said.timestamp() * 1000),
                "session": {"live": live},
            }
        )
        time.sleep(0.01)
        return said

    offline_asked = utcnow()
    report(True)
    run_transaction(client.engine, lambda s: mark_offline(s, WS, SID, Heard(offline_asked)))
    assert client.session_info(WS, SID).live is True
    live_asked = utcnow()
    report(False)
    run_transaction(
        client.engine,
        lambda s: record_liveness(lock_session(s, WS, SID), True, Heard(live_asked)),
    )
    assert client.session_info(WS, SID).live is False


def test_a_stale_cancel_of_a_vanished_session_settles_its_turns_as_interrupted(client, sim_control):
    """session_not_found is an authoritative end: every turn of the session ends
    interrupted locally, with no cancel call and no resume; waiting work is woken."""
    from agent_radar.models.db import run_transaction
    from agent_radar.models.operations import CancelOperation
    from agent_radar.models.tables import Turn
    from tests.helpers import Clock

    clock = Clock()
    op_id = _leased_cancel(client, clock.now)
    client.report_activity(
        {
            "workspace_id": WS,
            "session_id": SID,
            "occurred_at_ms": int(clock.now.timestamp() * 1000),
            "turn": {"turn_id": "turn-10", "phase": "running"},
        }
    )
    sim_control.session(WS, SID, missing=True)
    clock.advance(5)
    published = []
    assert _runner(client, sim_control, clock, published).apply(op_id) == "interrupted"
    cancel = run_transaction(client.engine, lambda s: s.get(CancelOperation, op_id))
    assert (cancel.status, cancel.result) == ("completed", "interrupted")
    for turn_id in ("turn-9", "turn-10"):
        turn = run_transaction(client.engine, lambda s, t=turn_id: s.get(Turn, (WS, SID, t)))
        assert (turn.phase, turn.outcome) == ("settled", "interrupted")
    assert client.session_info(WS, SID).active_turn_id is None
    assert {c["call"] for c in sim_control.calls()} == {"liveness"}
    assert ("agent_radar.prompt.dispatch", {"workspace_id": WS, "session_id": SID}) in published


def test_a_stale_cancel_fails_past_its_budget(client, sim_control):
    from sqlalchemy import update

    from agent_radar.models.db import run_transaction
    from agent_radar.models.operations import CancelOperation
    from tests.helpers import Clock

    clock = Clock()
    op_id = _leased_cancel(client, clock.now)
    run_transaction(
        client.engine,
        lambda s: s.execute(
            update(CancelOperation).values(attempt=budgets.MAX_ATTEMPTS, last_error="503")
        ),
    )
    clock.advance(5)
    assert _runner(client, sim_control, clock).apply(op_id) == "failed"
    cancel = run_transaction(client.engine, lambda s: s.get(CancelOperation, op_id))
    assert cancel.status == "failed"
    assert cancel.last_error == "budget_exhausted (24 attempts): 503"
    assert sim_control.calls() == []
    from agent_radar.workflows.tools.status import fleet_status, problems

    status = fleet_status(client.engine, clock.now)
    assert status["cancels"] == {"failed": 1}
    # What it was to stop may still run there: `status --check` names it.
    assert "1 cancels failed in the last hour" in problems(status, 2.0)
    (failed,) = status["worst"]["failed_recently"]
    assert (failed["kind"], failed["id"]) == ("turn cancel", op_id)


def test_a_stale_cancel_failing_for_too_long_fails_on_age(client, sim_control):
    from datetime import timedelta

    from sqlalchemy import update

    from agent_radar.models.db import run_transaction
    from agent_radar.models.operations import CancelOperation
    from tests.helpers import Clock

    clock = Clock()
    op_id = _leased_cancel(client, clock.now)
    since = clock.now - timedelta(seconds=budgets.MAX_FAILING_S - 1)
    run_transaction(
        client.engine,
        lambda s: s.execute(
            update(CancelOperation).values(attempt=2, failing_since=since, last_error="503")
        ),
    )
    clock.advance(5)  # past its lease, and now past the age budget too
    assert _runner(client, sim_control, clock).apply(op_id) == "failed"
    cancel = run_transaction(client.engine, lambda s: s.get(CancelOperation, op_id))
    assert cancel.status == "failed"
    assert cancel.last_error.startswith("budget_exhausted (failing for ")
    assert sim_control.calls() == []


def test_a_stale_cancel_of_a_live_session_is_retried_with_backoff(client, sim_control):
    from agent_radar.models.db import run_transaction
    from agent_radar.models.operations import CancelOperation
    from agent_radar.workflows.adapters.http_runtime import HttpRuntime
    from agent_radar.workflows.steps.cancel import CancelRunner
    from tests.helpers import Clock

    clock = Clock()
    op_id = _leased_cancel(client, clock.now)
    clock.advance(5)
    sim_control.fault("turns/turn-9/cancel", status=503, count=1)
    runner = CancelRunner(
        client.engine,
        HttpRuntime(sim_control.http.base_url),
        worker_id="w",
        lease_s=3,
        publish=lambda *a: True,
        clock=clock,
    )
    assert runner.apply(op_id) == "retry"
    cancel = run_transaction(client.engine, lambda s: s.get(CancelOperation, op_id))
    assert cancel.status == "leased" and cancel.lease_token is None
    assert cancel.attempt == 2  # the dead worker's try, then this one
    assert cancel.next_attempt_at == clock.now + timedelta(seconds=2)  # 2^(attempt-1)
    assert "503" in cancel.last_error


def test_a_prepared_targets_fence_is_installed_with_require_live_and_no_resume(client, sim_control):
    """The target was never dispatched: the fence is still installed at the agent (a later
    replay of that generation must be refused there), every background call carries
    require_live, and nothing resumes the session."""
    target = client.set_goal(WS, SID, "shared goal", client_submit_id="owner-1")
    assert client.get_goal_operation(target.operation_id).status == "prepared"
    fence = client.fence_goal_generation(WS, SID, target.operation_id, client_submit_id="f-1")
    assert client.get_goal_operation(target.operation_id).status == "superseded"
    assert fence_applier(client, sim_control.http.base_url).apply(fence.fence_id) == "completed"
    assert sim_control.session(WS, SID)["fences"] == [[target.operation_id, 1]]
    calls = sim_control.calls()
    assert {c["call"] for c in calls} == {"goal-fences", "state", "goal"}
    assert all(c["require_live"] is True for c in calls if c["call"] != "state"), calls
    assert [e["action"] for e in sim_control.effects()] == ["clear"]  # never the target
    assert client.get_fence(fence.fence_id).clear_operation_id == fence.clear_operation_id


def test_an_offline_settle_clears_the_pending_operation(client, sim_control):
    target = client.set_goal(WS, SID, "shared goal", client_submit_id="owner-1")
    sim_control.session(WS, SID, live=False)
    fence = client.fence_goal_generation(WS, SID, target.operation_id, client_submit_id="f-1")
    assert client.goal_state(WS, SID).pending_operation_id == fence.clear_operation_id
    assert (
        fence_applier(client, sim_control.http.base_url).apply(fence.fence_id)
        == "completed_offline"
    )
    state = client.goal_state(WS, SID)
    assert (state.pending_operation_id, state.sync_status) == (None, "unknown")
    clear = client.get_goal_operation(fence.clear_operation_id)
    assert (clear.status, clear.provider_phase) == ("completed", "unknown")
    assert client.get_fence(fence.fence_id).status == "completed"
    assert not [c for c in sim_control.calls() if c["call"] == "resume"]


def test_an_offline_settle_makes_a_look_whether_the_session_is_back_due(client, sim_control):
    """A fence settled locally (offline, no fenced turn to wait on) leaves its install and
    its clear to the session's return: a look whether it is back comes due, for a session
    that comes back without a report (before, only a report's reconcile made it due)."""
    target = client.set_goal(WS, SID, "shared goal", client_submit_id="owner-1")
    sim_control.session(WS, SID, live=False)
    fence = client.fence_goal_generation(WS, SID, target.operation_id, client_submit_id="f-1")
    assert (
        fence_applier(client, sim_control.http.base_url).apply(fence.fence_id)
        == "completed_offline"
    )
    published = []
    later = fence.created_at + timedelta(seconds=OUTBOX_GRACE_S + 1)
    sweep_once(client.engine, lambda *a: published.append(a) or True, later, owner="t")
    restore = ("agent_radar.session.restore", {"workspace_id": WS, "session_id": SID})
    assert restore in published


def test_an_offline_answer_overruled_before_it_is_written_settles_nothing(client, sim_control):
    """The fence's call is told `disconnected`; before that is written, another look finds the
    session live (and records it): the fence does not settle locally on the older answer, and
    goes again, delivered."""
    from agent_radar.workflows.errors import RuntimeDisconnected

    target = client.set_goal(WS, SID, "shared goal", client_submit_id="owner-1")
    sim_control.session(WS, SID, live=False)
    fence = client.fence_goal_generation(WS, SID, target.operation_id, client_submit_id="f-1")
    applier = fence_applier(client, sim_control.http.base_url)
    install = applier.runtime.install_fence

    def told_offline_then_back(*args, **kwargs):
        try:
            return install(*args, **kwargs)
        except RuntimeDisconnected:
            sim_control.session(WS, SID, live=True)
            client.ensure_session(WS, SID)  # another look, recorded first
            raise

    applier.runtime.install_fence = told_offline_then_back
    assert applier.apply(fence.fence_id) == "retry"
    assert client.get_goal_operation(fence.clear_operation_id).status != "completed"
    applier.runtime.install_fence = install
    assert applier.apply(fence.fence_id) == "completed"
    assert [e["action"] for e in sim_control.effects()] == ["clear"]


def test_the_sweeper_publishes_fences_before_goal_operations(client):
    """Fences first (docs/lifecycles.md: leases): a revoked target must never replay before its
    fence."""
    ops = [client.set_goal(WS, f"s{i}", "goal", client_submit_id="g") for i in range(3)]
    fence = client.fence_goal_generation(WS, "s0", ops[0].operation_id, client_submit_id="f-1")
    published = []
    later = fence.created_at + timedelta(seconds=OUTBOX_GRACE_S + 1)
    sweep_once(client.engine, lambda task, kwargs: published.append(task) or True, later, owner="t")
    assert "agent_radar.goal.dispatch" in published
    assert published[0] == "agent_radar.fence.apply"
    assert published.index("agent_radar.fence.apply") < published.index("agent_radar.goal.dispatch")


def _fenced_turn_running(client, target, turn_id="t-fenced"):
    import time

    client.report_activity(
        {
            "workspace_id": WS,
            "session_id": SID,
            "occurred_at_ms": int(time.time() * 1000),
            "turn": {
                "turn_id": turn_id,
                "phase": "running",
                "origin": "goal_continuation",
                "source_goal_operation_id": target.operation_id,
                "source_goal_revision": target.goal_revision,
            },
        }
    )
    return ids.cancel_operation_id(WS, SID, turn_id)


def _cancel_row(client, cancel_id):
    from agent_radar.models.db import run_transaction
    from agent_radar.models.operations import CancelOperation

    return run_transaction(client.engine, lambda s: s.get(CancelOperation, cancel_id))


def test_an_offline_session_with_the_fenced_turn_running_gets_a_durable_cancel_and_waits(
    client, sim_control
):
    """docs/lifecycles.md: fences: the fence does not complete while the fenced turn may still run;
    its cancel is written (delivered once the session is live, never by resuming it), and
    the fence waits for the turn's authoritative end without using budget."""
    target = client.set_goal(WS, SID, "shared goal", client_submit_id="owner-1")
    cancel_id = _fenced_turn_running(client, target)
    fence = client.fence_goal_generation(WS, SID, target.operation_id, client_submit_id="f-1")
    sim_control.session(WS, SID, live=False)
    applier = fence_applier(client, sim_control.http.base_url)
    assert applier.apply(fence.fence_id) == "waiting"
    waiting = client.get_fence(fence.fence_id)
    assert (waiting.status, waiting.cancel_operation_id, waiting.attempt) == (
        "pending",
        cancel_id,
        0,
    )
    assert waiting.last_error == "waiting for the fenced turn to settle"
    assert _cancel_row(client, cancel_id).status == "prepared"
    assert client.get_goal_operation(fence.clear_operation_id).status == "prepared"
    assert not [c for c in sim_control.calls() if c["call"] in ("resume", "goal")]
    # The turn's authoritative end (a settled report) wakes the fence; the session is back.
    import time

    client.report_activity(
        {
            "workspace_id": WS,
            "session_id": SID,
            "occurred_at_ms": int(time.time() * 1000),
            "turn": {"turn_id": "t-fenced", "phase": "settled", "outcome": "completed"},
        }
    )
    sim_control.session(WS, SID, live=True)
    assert applier.apply(fence.fence_id) == "completed"
    done = client.get_fence(fence.fence_id)
    assert (done.status, done.cancel_operation_id) == ("completed", cancel_id)
    assert _cancel_row(client, cancel_id).result == "already_settled"
    assert client.session_info(WS, SID).live is True
    assert [e["action"] for e in sim_control.effects()] == ["clear"]
    assert not [c for c in sim_control.calls() if c["call"] == "resume"]


def test_a_vanished_session_settles_the_fenced_turn_and_records_its_cancel(client, sim_control):
    """docs/lifecycles.md: fences: session_not_found means the session is gone: its running turns
    end interrupted, the fence completes locally and records the cancel of the fenced turn."""
    from agent_radar.models.db import run_transaction
    from agent_radar.models.tables import Turn

    target = client.set_goal(WS, SID, "shared goal", client_submit_id="owner-1")
    cancel_id = _fenced_turn_running(client, target)
    fence = client.fence_goal_generation(WS, SID, target.operation_id, client_submit_id="f-1")
    sim_control.session(WS, SID, missing=True)
    assert (
        fence_applier(client, sim_control.http.base_url).apply(fence.fence_id)
        == "completed_offline"
    )
    done = client.get_fence(fence.fence_id)
    assert (done.status, done.cancel_operation_id) == ("completed", cancel_id)
    cancel = _cancel_row(client, cancel_id)
    assert (cancel.status, cancel.result) == ("completed", "interrupted")
    turn = run_transaction(client.engine, lambda s: s.get(Turn, (WS, SID, "t-fenced")))
    assert (turn.phase, turn.outcome) == ("settled", "interrupted")
    clear = client.get_goal_operation(fence.clear_operation_id)
    assert (clear.status, clear.provider_phase) == ("completed", "unknown")
    assert not [c for c in sim_control.calls() if c["call"] == "resume"]


def test_a_fence_fails_past_its_budget_and_its_clear_with_it(client, sim_control):
    from sqlalchemy import update

    from agent_radar.models.db import run_transaction
    from agent_radar.models.operations import GoalFence

    target = client.set_goal(WS, SID, "shared goal", client_submit_id="owner-1")
    fence = client.fence_goal_generation(WS, SID, target.operation_id, client_submit_id="f-1")
    run_transaction(
        client.engine,
        lambda s: s.execute(
            update(GoalFence).values(attempt=budgets.MAX_ATTEMPTS, last_error="runtime 500")
        ),
    )
    assert fence_applier(client, sim_control.http.base_url).apply(fence.fence_id) == "failed"
    failed = client.wait(client.get_fence(fence.fence_id), timeout=1)
    assert (failed.status, failed.last_error) == (
        "failed",
        "budget_exhausted (24 attempts): runtime 500",
    )
    clear = client.get_goal_operation(fence.clear_operation_id)
    assert clear.status == "failed"
    state = client.goal_state(WS, SID)
    assert (state.sync_status, state.pending_operation_id) == ("failed", None)
    assert sim_control.calls() == []
    from agent_radar.workflows.tools.cli.status import render_status
    from agent_radar.workflows.tools.status import fleet_status

    status = fleet_status(client.engine)
    assert status["fences"] == {"failed": 1}
    assert status["budget_exhausted"] == {
        "goal_operations": 0,  # its clear failed with it, on the fence's budget
        "fences": 1,
        "cancels": 0,
        "prompts": 0,
    }
    rendered = "\n".join(render_status(status))
    assert (
        "fences: failed 1" in rendered and "out of budget: goal operations 0, fences 1" in rendered
    )
    # Named among the last hour's failures, with why, as is the clear that failed with it.
    assert (
        f"  failed: fence {fence.fence_id} ({WS}/{SID}, budget_exhausted (24 attempts)" in rendered
    )
    assert f"  failed: goal operation {clear.operation_id} ({WS}/{SID}, the fence's" in rendered


def test_a_fence_failing_for_too_long_fails_on_age(client, sim_control):
    from datetime import timedelta

    from sqlalchemy import update

    from agent_radar.models.base import utcnow
    from agent_radar.models.db import run_transaction
    from agent_radar.models.operations import GoalFence

    target = client.set_goal(WS, SID, "shared goal", client_submit_id="owner-1")
    fence = client.fence_goal_generation(WS, SID, target.operation_id, client_submit_id="f-1")
    # Three attempts, the first failure eleven minutes ago: the age budget (10 min) is spent.
    since = utcnow() - timedelta(seconds=budgets.MAX_FAILING_S + 60)
    run_transaction(
        client.engine,
        lambda s: s.execute(
            update(GoalFence).values(attempt=3, failing_since=since, last_error="runtime 503")
        ),
    )
    assert fence_applier(client, sim_control.http.base_url).apply(fence.fence_id) == "failed"
    failed = client.get_fence(fence.fence_id)
    assert failed.status == "failed"
    assert failed.last_error.startswith("budget_exhausted (failing for ")
    assert sim_control.calls() == []


def test_a_fence_failure_starts_the_age_clock_and_a_wait_stops_it(client, sim_control):
    from agent_radar.models.db import run_transaction
    from agent_radar.models.operations import GoalFence

    target = client.set_goal(WS, SID, "shared goal", client_submit_id="owner-1")
    fence = client.fence_goal_generation(WS, SID, target.operation_id, client_submit_id="f-1")
    row = lambda: run_transaction(  # noqa: E731
        client.engine, lambda s: s.get(GoalFence, fence.fence_id)
    )
    sim_control.fault("goal-fences", status=503, count=1)
    assert fence_applier(client, sim_control.http.base_url).apply(fence.fence_id) == "retry"
    first = row()
    assert first.attempt == 1 and first.failing_since is not None
    sim_control.fault("goal-fences", status=503, count=1)
    assert fence_applier(client, sim_control.http.base_url).apply(fence.fence_id) == "retry"
    second = row()
    assert second.attempt == 2 and second.failing_since == first.failing_since  # one run

    # The fenced generation's turn runs and the session goes offline: the fence waits for
    # the turn, using no budget, and the failures before the wait no longer count.
    client.report_activity(
        {
            "workspace_id": WS,
            "session_id": SID,
            "occurred_at_ms": int(time.time() * 1000),
            "turn": {
                "turn_id": "t-fenced",
                "phase": "running",
                "origin": "goal_continuation",
                "source_goal_operation_id": target.operation_id,
                "source_goal_revision": 1,
            },
        }
    )
    sim_control.session(WS, SID, live=False)
    assert fence_applier(client, sim_control.http.base_url).apply(fence.fence_id) == "waiting"
    waiting = row()
    assert (waiting.attempt, waiting.failing_since) == (2, None)


def test_every_unsettled_turn_of_the_fenced_generation_is_cancelled(client, sim_control):
    """Issue row: two unsettled turns of one generation on record — a stale one (its settled
    report lost; the host no longer has it) and the one the host runs. The fence cancelled
    one of them (`.limit(1)`), the host said `not_found`, and the fence completed while the
    live turn of the fenced generation went on running. Counted at the host."""
    # The host's turn runs until cancelled.
    target, live_turn = _goal_running_at_host(client, sim_control, turn_duration_ms=0)
    # The stale turn is on record first, and sorts first.
    stale_cancel = _fenced_turn_running(client, target, turn_id="a-stale-turn")
    live_cancel = _fenced_turn_running(client, target, turn_id=live_turn)
    fence = client.fence_goal_generation(WS, SID, target.operation_id, client_submit_id="f-1")
    assert fence_applier(client, sim_control.http.base_url).apply(fence.fence_id) == "completed"
    at_host = sim_control.session(WS, SID)["turns"][live_turn]
    assert (at_host["phase"], at_host["outcome"]) == ("settled", "canceled")
    # The host's state answer does not list the stale one: it ended there unseen, and needs
    # no cancel; the live one was cancelled.
    stale = run_transaction(client.engine, lambda s: s.get(Turn, (WS, SID, "a-stale-turn")))
    assert (stale.phase, stale.outcome) == ("settled", "interrupted")
    assert _cancel_row(client, stale_cancel) is None
    assert _cancel_row(client, live_cancel).result == "canceled"
    assert client.get_fence(fence.fence_id).status == "completed"
    assert [e["action"] for e in sim_control.effects()] == ["set", "clear"]


def _goal_running_at_host(client, sim_control, **sim):
    """A goal dispatched to the host (the session set up with `sim`), whose turn runs there:
    (target, the host's turn id)."""
    from agent_radar.workflows.adapters.http_runtime import HttpRuntime
    from agent_radar.workflows.steps.goals.dispatch import Dispatcher

    sim_control.session(WS, SID, **sim)
    target = client.set_goal(WS, SID, "shared goal", client_submit_id="owner-1")
    runtime = HttpRuntime(sim_control.http.base_url)
    Dispatcher(client.engine, runtime, worker_id="d", lease_s=5).dispatch_many(
        [target.operation_id]
    )
    assert client.wait(client.get_goal_operation(target.operation_id), 5).status == "completed"
    (turn_id,) = sim_control.session(WS, SID)["turns"]
    return target, turn_id


def _fenced_while_its_turn_runs(client, sim_control, **sim):
    """A goal applied at the host, whose turn runs there (and is on record), then a newer
    goal and a fence of the first generation (it clears nothing): (target, turn_id,
    cancel_id, fence)."""
    target, turn_id = _goal_running_at_host(client, sim_control, **sim)
    cancel_id = _fenced_turn_running(client, target, turn_id=turn_id)
    client.set_goal(WS, SID, "owner goal", client_submit_id="owner-2")
    fence = client.fence_goal_generation(WS, SID, target.operation_id, client_submit_id="f-1")
    return target, turn_id, cancel_id, fence


def _turn_settled_at_host_and_reported(client, sim_control, turn_id, outcome):
    eventually(
        lambda: sim_control.session(WS, SID)["turns"][turn_id]["phase"] == "settled",
        what="the turn's end at the host",
    )
    client.report_activity(
        {
            "workspace_id": WS,
            "session_id": SID,
            "occurred_at_ms": int(time.time() * 1000),
            "turn": {"turn_id": turn_id, "phase": "settled", "outcome": outcome},
        }
    )


def test_a_turn_that_settles_while_the_fence_asks_its_cancel_wakes_the_fence(client, sim_control):
    """CI, once: the fenced turn's settled report was recorded while the fence's attempt
    ran, so it found the fence claimed, not waiting, and woke nothing; the attempt then
    parked the fence on that turn until its deadline, and with no sweeper running it
    stayed pending. The turn settles here between the fence's cancel and its wait: the
    fence is due at once and published again, and its next attempt completes."""
    from agent_radar.models.base import utcnow
    from agent_radar.models.operations import GoalFence
    from agent_radar.workflows.adapters.http_runtime import HttpRuntime
    from agent_radar.workflows.steps.fence_apply import FenceApplier

    # The host's turn runs until cancelled; a cancel is accepted, and the turn ends later.
    _target, turn_id, cancel_id, fence = _fenced_while_its_turn_runs(
        client, sim_control, turn_duration_ms=0, cancel_mode="accepted", cancel_delay_ms=200
    )
    runtime = HttpRuntime(sim_control.http.base_url)
    published = []
    applier = FenceApplier(
        client.engine,
        runtime,
        worker_id="a",
        lease_s=5,
        publish=lambda *a: published.append(a) or True,
    )
    asked = applier.cancels.request

    def ask_then_settle(*args, **kwargs):
        state = asked(*args, **kwargs)
        assert state == "waiting"  # the host accepted the cancel; the turn ends later
        _turn_settled_at_host_and_reported(client, sim_control, turn_id, "canceled")
        return state

    applier.cancels.request = ask_then_settle
    assert applier.apply(fence.fence_id) == "woken"
    assert ("agent_radar.fence.apply", {"fence_id": fence.fence_id}) in published
    row = run_transaction(client.engine, lambda s: s.get(GoalFence, fence.fence_id))
    assert (row.status, row.cancel_operation_id, row.attempt) == ("pending", cancel_id, 0)
    assert row.next_attempt_at <= utcnow()  # due now, not at the cancel's deadline
    applier.cancels.request = asked
    assert applier.apply(fence.fence_id) == "completed"
    assert _cancel_row(client, cancel_id).result == "canceled"
    assert [e["action"] for e in sim_control.effects()] == ["set"]  # a newer goal: no clear


def test_a_state_answer_older_than_the_turn_s_end_is_asked_again(client, sim_control, monkeypatch):
    """CI, once: the fence's state answer listed the fenced turn running; the turn then
    ended at the host and its report settled it on record before the fence read its turns.
    The fence found a running turn no cancel reached and parked until its deadline, with no
    sweeper to publish it again. It asks the host once more: the turn has ended there, and
    the fence completes in the same attempt."""
    target, turn_id, _cancel_id, fence = _fenced_while_its_turn_runs(
        client, sim_control, turn_duration_ms=300
    )
    looks = []
    applier = fence_applier(client, sim_control.http.base_url)
    look = applier.host_state

    def then_the_turn_ends(*args, **kwargs):
        answer = look(*args, **kwargs)
        looks.append([t.turn_id for t in answer[0].turns])
        if len(looks) == 1:
            _turn_settled_at_host_and_reported(client, sim_control, turn_id, "completed")
        return answer

    applier.host_state = then_the_turn_ends
    assert applier.apply(fence.fence_id) == "completed"
    assert looks == [[turn_id], []]
    assert client.get_fence(fence.fence_id).status == "completed"
    assert not [e for e in sim_control.effects(kind=None) if e["kind"] == "cancel"]


def test_a_final_refusal_of_the_fence_install_fails_the_fence_with_it(client, host):
    """Issue row: a 403 `forbidden` on goal-fences was retried (each attempt a call to the
    host) until the budget ran out. A 4xx code other than the protocol's retryable ones is a
    final refusal (docs/protocol.md: errors): the fence fails at once with the host's words,
    its clear with it, and shows in `status`; the row still forbids its generation."""

    host.answers[(SID, "liveness")] = (200, b'{"live": true, "runtime_epoch": 1}')
    host.answers[(SID, "goal-fences")] = (403, b'{"error": "forbidden", "detail": "token"}')
    target = client.set_goal(WS, SID, "shared goal", client_submit_id="owner-1")
    fence = client.fence_goal_generation(WS, SID, target.operation_id, client_submit_id="f-1")
    applier = fence_applier(client, host.url)
    assert applier.apply(fence.fence_id) == "failed"
    assert applier.apply(fence.fence_id) == "skipped"
    failed = client.get_fence(fence.fence_id)
    assert failed.status == "failed" and "403 forbidden" in failed.last_error
    clear = client.get_goal_operation(fence.clear_operation_id)
    assert clear.status == "failed" and "403 forbidden" in clear.last_error
    assert sum(1 for sid, _auth in host.seen if sid == SID) == 1  # one call, no retries


def _an_operator_ends_the_run(client, run):
    """The run outlasts its cancel grace (recovery), and an operator ends it."""
    from sqlalchemy import update

    from agent_radar.models.db import run_transaction
    from agent_radar.models.operations import MaintenanceRun

    run_transaction(
        client.engine,
        lambda s: s.execute(
            update(MaintenanceRun)
            .where(MaintenanceRun.run_id == run.run_id)
            .values(status="recovery_required", error_code="cancel_timeout")
        ),
    )
    client.resolve_maintenance(run.run_id, to="failed", reason="test: the run is over")


def test_a_clear_held_by_a_maintenance_run_uses_no_budget(client, sim_control):
    """Issue row: a fence whose clear waited behind a maintenance run counted each look as a
    failed attempt: past 10 minutes (a long run, one in recovery) the fence and its clear
    failed. A hold is a wait: the fence's attempts and age clock stand still, its own fence
    is installed meanwhile, and once the run settles the clear goes."""
    from sqlalchemy import update

    from agent_radar.models.db import run_transaction
    from agent_radar.models.operations import GoalFence
    from agent_radar.workflows.steps.fence_apply import HELD_BY_MAINTENANCE

    target = client.set_goal(WS, SID, "shared goal", client_submit_id="owner-1")
    run = client.start_maintenance(WS, SID, client_submit_id="m-1")
    fence = client.fence_goal_generation(WS, SID, target.operation_id, client_submit_id="f-1")
    applier = fence_applier(client, sim_control.http.base_url)
    for _ in range(budgets.MAX_ATTEMPTS + 2):
        assert applier.apply(fence.fence_id) == "waiting"
        # due again at once, as the sweeper would find it after the recheck
        run_transaction(
            client.engine, lambda s: s.execute(update(GoalFence).values(next_attempt_at=None))
        )
    held = client.get_fence(fence.fence_id)
    assert (held.status, held.attempt, held.last_error) == ("pending", 0, HELD_BY_MAINTENANCE)
    assert client.get_goal_operation(fence.clear_operation_id).status == "prepared"
    assert sim_control.session(WS, SID)["fences"] == [[target.operation_id, 1]]
    # The run outlasts its cancel grace (recovery), and an operator ends it.
    _an_operator_ends_the_run(client, run)
    assert applier.apply(fence.fence_id) == "completed"
    assert [e["action"] for e in sim_control.effects()] == ["clear"]


def test_a_run_that_ends_while_the_fence_finds_its_clear_held_wakes_the_fence(client, sim_control):
    """The run's release woke the fences waiting on it, but this one was still in its
    attempt (claimed, not waiting): it would have parked for HELD_RECHECK_S and, without a
    sweeper, for good. Under the session's lock it sees the run has ended: due now, and
    published again."""

    from agent_radar.models.base import utcnow
    from agent_radar.models.db import run_transaction
    from agent_radar.models.operations import GoalFence
    from agent_radar.workflows.steps.fence_apply import HELD_BY_MAINTENANCE

    target = client.set_goal(WS, SID, "shared goal", client_submit_id="owner-1")
    run = client.start_maintenance(WS, SID, client_submit_id="m-1")
    fence = client.fence_goal_generation(WS, SID, target.operation_id, client_submit_id="f-1")
    published = []
    applier = fence_applier(
        client, sim_control.http.base_url, publish=lambda *a: published.append(a) or True
    )
    dispatcher = applier.dispatcher
    drive = dispatcher.apply_now

    def held_then_the_run_ends(clear_id, lane):
        outcome = drive(clear_id, lane)
        assert outcome == "held"
        # The run ends (here an operator ends it, as the held test above does).
        _an_operator_ends_the_run(client, run)
        return outcome

    dispatcher.apply_now = held_then_the_run_ends
    assert applier.apply(fence.fence_id) == "woken"
    row = run_transaction(client.engine, lambda s: s.get(GoalFence, fence.fence_id))
    assert (row.status, row.last_error) == ("pending", HELD_BY_MAINTENANCE)
    assert row.next_attempt_at <= utcnow()
    assert ("agent_radar.fence.apply", {"fence_id": fence.fence_id}) in published
    dispatcher.apply_now = drive
    assert applier.apply(fence.fence_id) == "completed"
    assert [e["action"] for e in sim_control.effects()] == ["clear"]


def test_a_fence_cancels_a_turn_of_its_generation_that_no_report_told_of(client, sim_control):
    """The host's word decides (docs/lifecycles.md: reconcile): a turn of the fenced generation
    runs at the host and its report was lost. The fence asks the host's state, cancels that
    turn there, and completes only once the host shows none of it running."""
    from agent_radar.workflows.steps.goals.dispatch import Dispatcher

    sim_control.session(WS, SID, continuation_turns=False)
    target = client.set_goal(WS, SID, "shared goal", client_submit_id="owner-1")
    d = Dispatcher(client.engine, client.runtime, worker_id="d", lease_s=5)
    assert [r.outcome for r in d.dispatch(target.operation_id)] == ["applied"]
    sim_control.session(
        WS,
        SID,
        turn={
            "turn_id": "unreported",
            "origin": "goal_continuation",
            "source_goal_operation_id": target.operation_id,
            "source_goal_revision": 1,
        },
    )
    fence = client.fence_goal_generation(WS, SID, target.operation_id, client_submit_id="f-1")
    assert fence_applier(client, sim_control.http.base_url).apply(fence.fence_id) == "completed"
    at_host = sim_control.session(WS, SID)["turns"]["unreported"]
    assert (at_host["phase"], at_host["outcome"]) == ("settled", "canceled")
    assert client.get_fence(fence.fence_id).cancel_operation_id == ids.cancel_operation_id(
        WS, SID, "unreported"
    )


def test_a_clear_the_host_only_accepts_is_waited_for_then_fails_past_its_budget(client, host):
    """Found by a review: a host that answers the fence's clear `accepted` and never applies
    it left the clear open for good (the fence completed, and nothing else claims a fence's
    clear again). The fence waits instead, using no budget; the sweeper brings it back; past
    the accepted budget its attempt fails the clear, without sending it again, and
    completes. The host got the clear once."""
    from agent_radar.models.base import utcnow
    from agent_radar.workflows.goals.operations import ACCEPTED_BUDGET_S
    from agent_radar.workflows.kinds.fence import FENCE_APPLY_TASK
    from agent_radar.workflows.steps.fence_apply import (
        ACCEPTED_RECHECK_S,
        CLEAR_ACCEPTED,
    )
    from tests.hostile import IDLE_STATE

    clears: list[dict] = []
    host.answers[(SID, "liveness")] = (200, b'{"live": true, "runtime_epoch": 1}')
    host.answers[(SID, "goal-fences")] = (200, b"{}")
    host.answers[(SID, "state")] = (200, IDLE_STATE)
    host.answers[(SID, "goal")] = lambda body: (
        clears.append(body) or (200, b'{"phase": "accepted"}')
    )
    target = client.set_goal(WS, SID, "shared goal", client_submit_id="owner-1")
    fence = client.fence_goal_generation(WS, SID, target.operation_id, client_submit_id="f-1")

    def apply(ahead_s: float) -> str:
        clock = lambda: utcnow() + timedelta(seconds=ahead_s)  # noqa: E731
        return fence_applier(client, host.url, clock=clock).apply(fence.fence_id)

    assert apply(0) == "waiting"
    clear = client.get_goal_operation(fence.clear_operation_id)
    assert (clear.status, clear.provider_phase) == ("dispatched", "accepted")
    waiting = client.get_fence(fence.fence_id)
    assert (waiting.status, waiting.last_error, waiting.attempt) == ("pending", CLEAR_ACCEPTED, 0)
    published: list[tuple] = []
    later = utcnow() + timedelta(seconds=ACCEPTED_RECHECK_S + OUTBOX_GRACE_S + 1)
    sweep_once(client.engine, lambda *a: published.append(a) or True, later, owner="t")
    assert (FENCE_APPLY_TASK, {"fence_id": fence.fence_id}) in published
    assert apply(2 * ACCEPTED_RECHECK_S) == "waiting"  # within the clear's budget
    assert apply(ACCEPTED_BUDGET_S + 3 * ACCEPTED_RECHECK_S) == "completed"
    clear = client.get_goal_operation(fence.clear_operation_id)
    assert clear.status == "failed" and "accepted" in (clear.last_error or "")
    assert client.get_fence(fence.fence_id).status == "completed"
    assert len(clears) == 1

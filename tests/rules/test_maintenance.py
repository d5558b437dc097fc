"""Maintenance runs, the session hold and prompts (docs/lifecycles.md: maintenance, prompts), on
both backends."""

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import timedelta

import pytest
from sqlalchemy import select, update

from agent_radar.beat.sweeper import OUTBOX_GRACE_S, REPUBLISH_INTERVAL_S, sweep_once
from agent_radar.models.base import utcnow
from agent_radar.models.db import run_transaction
from agent_radar.models.operations import MaintenanceRun, Prompt
from agent_radar.models.tables import Lease
from agent_radar.workflows import ids, leases
from agent_radar.workflows.adapters.http_runtime import HttpRuntime
from agent_radar.workflows.errors import (
    InvalidArgument,
    MaintenanceBusy,
    MaintenanceConflict,
    MaintenanceRecoveryRequired,
    RuntimeDraining,
    SessionBusy,
)
from agent_radar.workflows.maintenance import runs
from agent_radar.workflows.steps.goals.dispatch import Dispatcher
from agent_radar.workflows.steps.maintenance import MaintenanceExecutor
from tests.helpers import eventually, lock_waits, row_counts

WS, SID = "ws-maint", "s1"


class Published(list):
    def __call__(self, task, kwargs):
        self.append((task, kwargs))
        return True


@pytest.fixture
def executor(client, settings):
    published = Published()
    ex = MaintenanceExecutor(
        client.engine,
        HttpRuntime(settings.runtime_url),
        worker_id="w",
        lease_s=settings.lease_s,
        publish=published,
        poll_s=0.02,
    )
    ex.published = published
    return ex


def records_of(client, run_id):
    rows = [r for r in client.history(WS, SID) if r.record_id == f"maintenance:{run_id}"]
    assert len(rows) == 1
    return rows[0]


def statuses(client, run_id):
    from sqlalchemy import select

    from agent_radar.models.tables import SessionEvent

    return run_transaction(
        client.engine,
        lambda s: [
            (e.revision, e.payload["record"]["status"])
            for e in s.execute(
                select(SessionEvent)
                .where(SessionEvent.record_id == f"maintenance:{run_id}")
                .order_by(SessionEvent.sequence)
            ).scalars()
        ],
    )


def test_admission_rules(client):
    run = client.start_maintenance(WS, SID, client_submit_id="m1")
    assert (run.status, run.revision) == ("running", 1)
    assert records_of(client, run.run_id).pending  # r1 is durable before the call returned
    assert client.start_maintenance(WS, SID, client_submit_id="m1") == run
    before = row_counts(client.engine)
    with pytest.raises(MaintenanceConflict):
        client.start_maintenance(
            WS, SID, "summarize_up_to", client_submit_id="m1", args={"turn": 3}
        )
    with pytest.raises(MaintenanceBusy) as busy:
        client.start_maintenance(WS, SID, client_submit_id="m2")
    assert busy.value.run_id == run.run_id
    assert row_counts(client.engine) == before


def test_admission_recovery_draining_and_busy_turn(client):
    run = client.start_maintenance(WS, SID, client_submit_id="m1")
    later = utcnow() + timedelta(hours=1)
    # seed the point where the executing worker stopped heartbeating
    run_transaction(
        client.engine,
        lambda s: s.execute(
            update(MaintenanceRun).values(lease_owner="gone", lease_expires_at=utcnow())
        ),
    )
    sweep_once(client.engine, lambda *a: True, later, owner="t")
    assert client.get_maintenance(run.run_id).status == "recovery_required"
    with pytest.raises(MaintenanceRecoveryRequired) as err:
        client.start_maintenance(WS, SID, client_submit_id="m2")
    assert err.value.run_id == run.run_id
    client.report_activity(
        {
            "workspace_id": WS,
            "session_id": "busy",
            "occurred_at_ms": 1_764_770_000_000,
            "turn": {"turn_id": "t1", "phase": "running"},
        }
    )
    with pytest.raises(SessionBusy):
        client.start_maintenance(WS, "busy", client_submit_id="m1")
    client.set_goal(WS, "drained", "known", client_submit_id="g1")  # a session it knows
    client.drain_session(WS, "drained")
    with pytest.raises(RuntimeDraining):
        client.start_maintenance(WS, "drained", client_submit_id="m1")
    with pytest.raises(InvalidArgument):
        client.start_maintenance(WS, "other", "defragment", client_submit_id="m1")
    with pytest.raises(InvalidArgument):
        client.start_maintenance(WS, "other", "summarize_from", client_submit_id="m1")


def test_a_caller_on_an_older_runtime_epoch_is_refused(client, sim_control):
    """docs/lifecycles.md: maintenance, sessions: a session whose host moved to a newer epoch than
    the caller expected is draining for that caller; nothing is written. The replay check comes
    first."""
    sim_control.session(WS, SID, restart=True)
    sim_control.session(WS, SID, restart=True)
    assert client.ensure_session(WS, SID).runtime_epoch == 3  # learnt from the host
    before = row_counts(client.engine)
    with pytest.raises(RuntimeDraining) as err:
        client.start_maintenance(WS, SID, client_submit_id="m1", expected_runtime_epoch=2)
    assert (err.value.runtime_epoch, err.value.expected_runtime_epoch) == (3, 2)
    assert row_counts(client.engine) == before
    run = client.start_maintenance(WS, SID, client_submit_id="m1", expected_runtime_epoch=3)
    assert run.status == "running" and run.runtime_epoch == 3
    again = client.start_maintenance(WS, SID, client_submit_id="m1", expected_runtime_epoch=0)
    assert again.run_id == run.run_id  # a replay returns the run, whatever the caller expects
    for bad in (-1, "3", 2**31, True):
        with pytest.raises(InvalidArgument):
            client.start_maintenance(WS, "s2", client_submit_id="m", expected_runtime_epoch=bad)


@pytest.mark.parametrize(
    "outcome,status,error_code",
    [
        ("applied", "completed", None),
        ("noop", "noop", "no_history"),
        ("error:model overloaded", "failed", "summary_failed"),
        ("cancelled", "cancelled", "cancelled"),
    ],
)
def test_a_run_that_ends_on_its_own_writes_three_records(
    client, executor, sim_control, outcome, status, error_code
):
    sim_control.session(WS, SID, maintenance_duration_ms=50, maintenance_outcome=outcome)
    run = client.start_maintenance(WS, SID, client_submit_id="m1")
    assert executor.execute(run.run_id) == status
    done = client.get_maintenance(run.run_id)
    assert (done.status, done.revision, done.error_code) == (status, 3, error_code)
    if outcome.startswith("error:"):
        assert done.detail == "model overloaded"
    if outcome == "applied":
        assert (done.result_tokens, done.summary) == (800, "conversation compacted")
    assert statuses(client, run.run_id) == [(1, "running"), (2, "finalizing"), (3, status)]
    row = records_of(client, run.run_id)
    assert (row.revision, row.pending) == (3, False)


def test_cancel_during_the_work_writes_four_records(client, executor, sim_control):
    sim_control.session(WS, SID, maintenance_duration_ms=5000)
    run = client.start_maintenance(WS, SID, client_submit_id="m1")
    worker = threading.Thread(
        target=lambda: setattr(worker, "result", executor.execute(run.run_id))
    )
    worker.start()
    eventually(lambda: client.get_maintenance(run.run_id).lease_token, what="the run to start")
    cancelling = client.cancel_maintenance(run.run_id)
    assert (cancelling.status, cancelling.revision) == ("cancelling", 2)
    again = client.cancel_maintenance(run.run_id)  # already cancelling: ignored
    if again.status == "cancelling":
        # the executor's heartbeat may renew the lease in between; nothing else may change
        assert replace(again, lease_expires_at=None) == replace(cancelling, lease_expires_at=None)
    else:
        # The executor (polling every 20 ms) saw the cancel between the two calls and has
        # moved the run on; the second cancel wrote nothing (the records below say so).
        assert again.status in ("finalizing", "cancelled"), again
    worker.join(10)
    assert worker.result == "cancelled"
    assert statuses(client, run.run_id) == [
        (1, "running"),
        (2, "cancelling"),
        (3, "finalizing"),
        (4, "cancelled"),
    ]
    assert client.cancel_maintenance(run.run_id).revision == 4  # terminal: unchanged


def test_a_late_cancel_never_reopens_finalizing(client, sim_control):
    run = client.start_maintenance(WS, SID, client_submit_id="m1")
    run_transaction(
        client.engine,
        lambda s: s.execute(update(MaintenanceRun).values(status="finalizing", revision=2)),
    )
    assert client.cancel_maintenance(run.run_id).status == "finalizing"
    assert client.get_maintenance(run.run_id).cancel_requested_at is None


@pytest.mark.parametrize("named", [False, True], ids=["unnamed", "named"])
@pytest.mark.parametrize("backend", ["production"])
def test_a_claim_that_waited_for_the_session_sees_the_run_admitted_meanwhile(
    client, settings, sim_control, named
):
    """A claim waits for the session lock while a maintenance run's admission holds it. On
    PostgreSQL it must read the session's holds after it has the lock (a read in the
    locking statement sees the database as it was before the wait): the operation is held,
    and the agent gets no goal call during the run. So must a named message's claim, whose
    lane, lock and read are one call of a server-side function (named_claim): its read is
    a statement of its own in that function, with a snapshot of its own."""
    from sqlalchemy.orm import Session

    from agent_radar.workflows.maintenance import runs

    op = client.set_goal(WS, SID, "not during maintenance", client_submit_id="g1")
    d = Dispatcher(
        client.engine, HttpRuntime(settings.runtime_url, timeout_s=2), worker_id="d", lease_s=5
    )
    request = runs.MaintenanceRequest.parse(WS, SID, "compact", client_submit_id="m1")
    pool = ThreadPoolExecutor(1)
    try:
        with Session(client.engine) as admission, admission.begin():
            runs.start(admission, request, utcnow())  # the session row stays locked
            outcome = pool.submit(
                d.dispatch_many, [op.operation_id], session_of=(WS, SID) if named else None
            )

            eventually(
                lambda: lock_waits(client.engine) > 0,
                what="the claim to wait for the session lock",
            )
        assert [r.outcome for r in outcome.result(timeout=30)] == ["held"]
    finally:
        pool.shutdown()
    assert sim_control.effects() == []
    assert client.get_goal_operation(op.operation_id).status == "prepared"
    lane = run_transaction(client.engine, lambda s: s.get(Lease, ids.lane_name(WS, SID)))
    assert lane is None or lane.token is None  # the named claim let its lane go again


def test_goal_operations_wait_for_the_run_without_using_budget(
    client, executor, settings, sim_control
):
    sim_control.session(WS, SID, maintenance_duration_ms=50)
    run = client.start_maintenance(WS, SID, client_submit_id="m1")
    first = client.set_goal(WS, SID, "after maintenance", client_submit_id="g1")
    d = Dispatcher(
        client.engine, HttpRuntime(settings.runtime_url, timeout_s=2), worker_id="d", lease_s=5
    )
    assert [r.outcome for r in d.dispatch(first.operation_id)] == ["held"]
    held = client.get_goal_operation(first.operation_id)
    assert (held.status, held.attempt, held.first_dispatched_at) == ("prepared", 0, None)
    assert executor.execute(run.run_id) == "completed"
    assert ("agent_radar.goal.dispatch", {"operation_id": first.operation_id}) in executor.published
    assert [r.outcome for r in d.dispatch(first.operation_id)] == ["applied"]
    assert sim_control.effects()[0]["revision"] == 1


def test_prompts_wait_for_maintenance_then_go_one_at_a_time(
    client, executor, settings, sim_control
):
    from agent_radar.workflows.steps import prompt_dispatch

    runtime = HttpRuntime(settings.runtime_url)
    sim_control.session(WS, SID, maintenance_duration_ms=50, turn_duration_ms=0)
    run = client.start_maintenance(WS, SID, client_submit_id="m1")
    p1 = client.submit_prompt(WS, SID, "first", client_submit_id="p1")
    p2 = client.submit_prompt(WS, SID, "second", client_submit_id="p2")
    assert (p1.position, p2.position) == (1, 2)
    assert client.submit_prompt(WS, SID, "first", client_submit_id="p1") == p1
    assert prompt_dispatch.dispatch_next(client.engine, runtime, WS, SID) == "held"
    executor.execute(run.run_id)
    assert prompt_dispatch.dispatch_next(client.engine, runtime, WS, SID) == "dispatched"
    assert prompt_dispatch.dispatch_next(client.engine, runtime, WS, SID) == "busy"
    turn_id = client.get_prompt(p1.prompt_id).turn_id
    sim_control.session(WS, SID, settle_turn=turn_id)  # it ends at the host: reported below
    eventually(
        lambda: sim_control.session(WS, SID)["turns"][turn_id]["phase"] == "settled",
        what="the first prompt's turn to end at the host",
    )
    client.report_activity(
        {
            "workspace_id": WS,
            "session_id": SID,
            "occurred_at_ms": 1_764_770_000_010,
            "turn": {
                "turn_id": turn_id,
                "phase": "settled",
                "outcome": "completed",
                "prompt_id": p1.prompt_id,
            },
        }
    )
    assert client.get_prompt(p1.prompt_id).status == "completed"
    assert prompt_dispatch.dispatch_next(client.engine, runtime, WS, SID) == "dispatched"
    assert [e["text"] for e in sim_control.effects("prompt")] == ["first", "second"]


def test_the_sweeper_pushes_a_prompt_queue_only_when_it_could_move(
    client, executor, settings, sim_control
):
    from agent_radar.workflows.prompts import queue as prompts
    from agent_radar.workflows.steps import prompt_dispatch

    runtime = HttpRuntime(settings.runtime_url)
    sim_control.session(WS, SID, maintenance_duration_ms=50, turn_duration_ms=0)

    def pushed():  # with no re-publish interval, every call answers afresh
        return prompts.sessions_with_queued_prompts(
            client.engine, utcnow(), 60, 100, republish_interval_s=0
        )

    def turn(turn_id, phase, at_ms, **fields):
        client.report_activity(
            {
                "workspace_id": WS,
                "session_id": SID,
                "occurred_at_ms": 1_764_770_000_000 + at_ms,
                "turn": {"turn_id": turn_id, "phase": phase, **fields},
            }
        )

    run = client.start_maintenance(WS, SID, client_submit_id="m1")
    p1 = client.submit_prompt(WS, SID, "first", client_submit_id="p1")
    client.submit_prompt(WS, SID, "second", client_submit_id="p2")
    assert pushed() == []  # held: the run's release pushes the queue
    executor.execute(run.run_id)
    assert pushed() == [(WS, SID)]  # released; in case that push was lost
    assert prompt_dispatch.dispatch_next(client.engine, runtime, WS, SID) == "dispatched"
    assert pushed() == []  # one in flight: its turn's settle pushes the queue
    turn(
        client.get_prompt(p1.prompt_id).turn_id,
        "settled",
        10,
        outcome="completed",
        prompt_id=p1.prompt_id,
    )
    assert pushed() == [(WS, SID)]
    turn("t-own", "running", 20, origin="goal_continuation")
    assert pushed() == []  # the agent's own turn runs: its settle pushes the queue
    turn("t-own", "settled", 30, outcome="completed")
    assert pushed() == [(WS, SID)]


def test_waiting_runs_and_prompt_queues_are_republished_once_per_interval(client):
    """A run no worker has claimed yet (a busy maintenance queue) and a prompt queue whose
    push is on the way get one message per reservation interval, not one per sweep."""
    run = client.start_maintenance(WS, SID, client_submit_id="m1")
    client.submit_prompt(WS, "other", "hello", client_submit_id="p1")
    published = []

    def sweep(at):
        sweep_once(
            client.engine,
            lambda task, kwargs: published.append((task, kwargs)) or True,
            at,
            owner="t",
        )
        sent, published[:] = list(published), []
        return sorted(task for task, _ in sent)

    start = run.started_at + timedelta(seconds=OUTBOX_GRACE_S)
    assert sweep(start) == ["agent_radar.maintenance.execute", "agent_radar.prompt.dispatch"]
    assert sweep(start + timedelta(seconds=1)) == []
    assert sweep(start + timedelta(seconds=REPUBLISH_INTERVAL_S - 1)) == []
    again = start + timedelta(seconds=REPUBLISH_INTERVAL_S)
    assert sweep(again) == ["agent_radar.maintenance.execute", "agent_radar.prompt.dispatch"]
    # once the work is done, its expired reservations are dropped
    run_transaction(
        client.engine,
        lambda s: (
            s.execute(update(MaintenanceRun).values(status="completed", finished_at=again)),
            s.execute(update(Prompt).values(status="completed")),
        ),
    )
    assert sweep(again + timedelta(seconds=REPUBLISH_INTERVAL_S)) == []
    assert (
        run_transaction(
            client.engine,
            lambda s: s.scalars(
                select(Lease.name).where(Lease.name.startswith(leases.REPUBLISH_PREFIX))
            ).all(),
        )
        == []
    )


def test_a_failed_terminal_write_is_recovered(client, executor, sim_control, monkeypatch):
    """The database refuses the terminal record: the run is left in recovery with
    operation_persist_failed once the database answers, and recovery writes it again."""
    from sqlalchemy.exc import OperationalError

    from agent_radar.models import db
    from agent_radar.workflows.maintenance import runs

    monkeypatch.setattr(db, "TRANSACTION_ATTEMPTS", 2)
    real = runs.transition
    failures = []

    def flaky(session, run, to, now, token=None, **fields):
        if to in runs.TERMINAL and len(failures) < 2:
            failures.append(to)
            raise OperationalError("UPDATE maintenance_runs", {}, Exception("database gone"))
        return real(session, run, to, now, token=token, **fields)

    monkeypatch.setattr(runs, "transition", flaky)
    sim_control.session(WS, SID, maintenance_duration_ms=20)
    run = client.start_maintenance(WS, SID, client_submit_id="m1")
    assert executor.execute(run.run_id) == "persist_failed"
    stuck = client.get_maintenance(run.run_id)
    assert (stuck.status, stuck.error_code) == ("recovery_required", "operation_persist_failed")
    with pytest.raises(MaintenanceRecoveryRequired):
        client.start_maintenance(WS, SID, client_submit_id="m2")  # still held
    assert executor.execute(run.run_id) == "completed"  # recovery asks the runtime again
    assert [s for _, s in statuses(client, run.run_id)] == [
        "running",
        "finalizing",
        "recovery_required",
        "finalizing",
        "completed",
    ]


def test_a_fence_installs_at_once_but_its_clear_waits_for_the_run(
    client, executor, settings, sim_control
):
    from agent_radar.workflows.steps.fence_apply import FenceApplier

    # No continuation turn: the run may not start beside one (the host is asked).
    sim_control.session(WS, SID, maintenance_duration_ms=20, continuation_turns=False)
    target = client.set_goal(WS, SID, "shared", client_submit_id="g1")
    d = Dispatcher(
        client.engine, HttpRuntime(settings.runtime_url, timeout_s=2), worker_id="d", lease_s=5
    )
    d.dispatch(target.operation_id)
    run = client.start_maintenance(WS, SID, client_submit_id="m1")
    fence = client.fence_goal_generation(WS, SID, target.operation_id, client_submit_id="f1")
    applier = FenceApplier(
        client.engine,
        HttpRuntime(settings.runtime_url),
        worker_id="a",
        lease_s=5,
        publish=lambda *a: True,
    )
    assert applier.apply(fence.fence_id) == "waiting"  # a hold: no budget used
    waiting = client.get_fence(fence.fence_id)
    assert waiting.status == "pending" and not waiting.settled and waiting.attempt == 0
    assert sim_control.session(WS, SID)["fences"] == [[target.operation_id, 1]]  # installed
    assert client.get_goal_operation(fence.clear_operation_id).status == "prepared"
    assert executor.execute(run.run_id) == "completed"
    assert ("agent_radar.fence.apply", {"fence_id": fence.fence_id}) in executor.published
    assert applier.apply(fence.fence_id) == "completed"
    assert client.get_goal_operation(fence.clear_operation_id).status == "completed"
    assert [e["action"] for e in sim_control.effects()] == ["set", "clear"]


def test_records_are_optional_diagnostics_of_type_session_maintenance_v1(
    client, executor, sim_control
):
    from agent_radar.models.tables import SessionEvent

    sim_control.session(WS, SID, maintenance_duration_ms=20)
    run = client.start_maintenance(WS, SID, client_submit_id="m1")
    assert executor.execute(run.run_id) == "completed"
    events = run_transaction(
        client.engine,
        lambda s: [
            (e.kind, e.optional, e.payload["type"], e.idempotency_key, e.revision)
            for e in s.execute(
                select(SessionEvent)
                .where(SessionEvent.record_id == f"maintenance:{run.run_id}")
                .order_by(SessionEvent.sequence)
            ).scalars()
        ],
    )
    assert events == [
        ("diagnostic", True, "session-maintenance-v1", f"session-maintenance:{run.run_id}:{n}", n)
        for n in (1, 2, 3)
    ]


def test_a_run_leaves_turns_and_prompts_untouched(client, executor, sim_control):
    from agent_radar.models.tables import Turn

    now_ms = int(utcnow().timestamp() * 1000)
    for phase, outcome in (("running", None), ("settled", "completed")):
        client.report_activity(
            {
                "workspace_id": WS,
                "session_id": SID,
                "occurred_at_ms": now_ms,
                "turn": {"turn_id": "t1", "phase": phase, "outcome": outcome},
            }
        )
    sim_control.session(WS, SID, maintenance_duration_ms=20)
    run = client.start_maintenance(WS, SID, client_submit_id="m1")
    prompt = client.submit_prompt(WS, SID, "after the compaction", client_submit_id="p1")

    def snapshot(s):
        turns = [(t.turn_id, t.phase, t.outcome) for t in s.execute(select(Turn)).scalars()]
        prompts = [(p.prompt_id, p.status, p.turn_id) for p in s.execute(select(Prompt)).scalars()]
        return turns, prompts

    before = run_transaction(client.engine, snapshot)
    assert executor.execute(run.run_id) == "completed"
    assert run_transaction(client.engine, snapshot) == before
    assert before[1] == [(prompt.prompt_id, "queued", None)]


@pytest.mark.parametrize(
    "outcome, status", [("noop", "noop"), ("error:boom", "failed"), ("cancelled", "cancelled")]
)
def test_the_session_is_released_after_noop_failed_and_cancelled(
    client, executor, sim_control, outcome, status
):
    from agent_radar.workflows.maintenance import runs

    sim_control.session(WS, SID, maintenance_duration_ms=20, maintenance_outcome=outcome)
    run = client.start_maintenance(WS, SID, client_submit_id="m1")
    held = client.set_goal(WS, SID, "waits for the run", client_submit_id="g1")
    assert run_transaction(client.engine, lambda s: runs.session_held(s, WS, SID))
    assert executor.execute(run.run_id) == status
    assert not run_transaction(client.engine, lambda s: runs.session_held(s, WS, SID))
    assert ("agent_radar.goal.dispatch", {"operation_id": held.operation_id}) in executor.published
    assert (
        "agent_radar.prompt.dispatch",
        {"workspace_id": WS, "session_id": SID},
    ) in executor.published


def test_a_cancel_is_ignored_in_recovery_required(client):
    run = client.start_maintenance(WS, SID, client_submit_id="m1")
    run_transaction(
        client.engine,
        lambda s: s.execute(
            update(MaintenanceRun).values(lease_owner="gone", lease_expires_at=utcnow())
        ),
    )
    sweep_once(client.engine, lambda *a: True, utcnow() + timedelta(hours=1), owner="t")
    stuck = client.get_maintenance(run.run_id)
    assert stuck.status == "recovery_required"
    assert client.cancel_maintenance(run.run_id) == stuck
    assert client.get_maintenance(run.run_id).cancel_requested_at is None


def test_a_second_executor_cannot_claim_a_run_with_a_live_lease(client, executor, sim_control):
    run = client.start_maintenance(WS, SID, client_submit_id="m1")
    run_transaction(
        client.engine,
        lambda s: s.execute(
            update(MaintenanceRun).values(
                lease_owner="other-worker",
                lease_token="their-token",
                lease_expires_at=utcnow() + timedelta(minutes=5),
            )
        ),
    )
    assert executor.execute(run.run_id) == "skipped"
    assert sim_control.calls() == []  # it never reached the agent
    row = client.get_maintenance(run.run_id)
    assert (row.lease_owner, row.status, row.revision) == ("other-worker", "running", 1)


def test_two_concurrent_starts_give_one_run_and_one_busy(client):
    barrier = threading.Barrier(2)
    results: dict[str, object] = {}

    def start(submit_id):
        barrier.wait()
        try:
            results[submit_id] = client.start_maintenance(WS, SID, client_submit_id=submit_id)
        except MaintenanceBusy as exc:
            results[submit_id] = exc

    threads = [threading.Thread(target=start, args=(sid,)) for sid in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    runs_ = [r for r in results.values() if not isinstance(r, Exception)]
    busy = [r for r in results.values() if isinstance(r, MaintenanceBusy)]
    assert len(runs_) == 1 and len(busy) == 1, results
    assert busy[0].run_id == runs_[0].run_id
    assert (
        len(run_transaction(client.engine, lambda s: s.execute(select(MaintenanceRun)).all())) == 1
    )


def test_a_cancel_between_finalizing_and_the_terminal_record_never_reopens_it(
    client, executor, sim_control, monkeypatch
):
    from agent_radar.workflows.steps import maintenance as executor_module

    sim_control.session(WS, SID, maintenance_duration_ms=20)
    run = client.start_maintenance(WS, SID, client_submit_id="m1")
    real = executor_module.run_transaction
    cancelled = []

    def interleave(engine, work, *args, **kwargs):
        if getattr(work, "__name__", "") == "terminal" and not cancelled:
            # finalizing is committed; a cancel arrives before the terminal record
            cancelled.append(client.cancel_maintenance(run.run_id))
        return real(engine, work, *args, **kwargs)

    monkeypatch.setattr(executor_module, "run_transaction", interleave)
    assert executor.execute(run.run_id) == "completed"
    assert cancelled[0].status == "finalizing"
    assert statuses(client, run.run_id) == [(1, "running"), (2, "finalizing"), (3, "completed")]
    assert client.get_maintenance(run.run_id).cancel_requested_at is None
    assert not [c for c in sim_control.calls() if c["call"].endswith("/cancel")]


def test_recovery_asks_the_host_first_and_a_lost_run_ends_runtime_restarted(
    client, executor, sim_control
):
    """docs/lifecycles.md: maintenance: recovery asks the runtime for the run's outcome; a host that
    no longer has the run (it restarted) ends it interrupted (runtime_restarted) instead of running
    it again, and the session is released."""
    sim_control.session(WS, SID, maintenance_duration_ms=60_000)
    run = client.start_maintenance(WS, SID, client_submit_id="m1")
    held = client.set_goal(WS, SID, "waits for the run", client_submit_id="g1")
    # a first worker started the run at the host, then was lost (its lease expired)
    run_transaction(
        client.engine,
        lambda s: s.execute(
            update(MaintenanceRun).values(lease_owner="gone", lease_expires_at=utcnow())
        ),
    )
    HttpRuntime(sim_control.http.base_url).start_maintenance(
        WS, SID, run_id=run.run_id, kind="compact", args=None
    )
    sweep_once(client.engine, lambda *a: True, utcnow() + timedelta(hours=1), owner="t")
    assert client.get_maintenance(run.run_id).status == "recovery_required"
    sim_control.session(WS, SID, restart=True)  # the host restarts: the run is gone there
    starts_before = len([e for e in sim_control.effects(kind=None) if e["kind"] == "maintenance"])
    assert executor.execute(run.run_id) == "interrupted"
    ended = client.get_maintenance(run.run_id)
    assert (ended.status, ended.error_code) == ("interrupted", "runtime_restarted")
    starts_after = len([e for e in sim_control.effects(kind=None) if e["kind"] == "maintenance"])
    assert starts_after == starts_before  # never started again
    from agent_radar.workflows.maintenance import runs

    assert not run_transaction(client.engine, lambda s: runs.session_held(s, WS, SID))
    assert ("agent_radar.goal.dispatch", {"operation_id": held.operation_id}) in executor.published


def test_recovery_re_attaches_to_a_run_the_host_still_runs(client, executor, sim_control):
    sim_control.session(WS, SID, maintenance_duration_ms=300)
    run = client.start_maintenance(WS, SID, client_submit_id="m1")
    HttpRuntime(sim_control.http.base_url).start_maintenance(
        WS, SID, run_id=run.run_id, kind="compact", args=None
    )
    run_transaction(
        client.engine,
        lambda s: s.execute(
            update(MaintenanceRun).values(lease_owner="gone", lease_expires_at=utcnow())
        ),
    )
    sweep_once(client.engine, lambda *a: True, utcnow() + timedelta(hours=1), owner="t")
    assert client.get_maintenance(run.run_id).status == "recovery_required"
    assert executor.execute(run.run_id) == "completed"
    assert [e["kind"] for e in sim_control.effects(kind=None)].count("maintenance") == 1


@pytest.mark.parametrize("backend", ["production"])
def test_a_cancel_that_commits_inside_finish_costs_no_lease_wait(
    client, executor, sim_control, monkeypatch
):
    """The run's outcome is in; between finish's read of the run and its change to
    `finalizing`, a cancel commits (PostgreSQL reads each statement afresh). finish reads
    again and goes on: the run was sent through recovery (worker_lost) after a lease wait."""
    import threading

    sim_control.session(WS, SID, maintenance_duration_ms=50)
    run = client.start_maintenance(WS, SID, client_submit_id="m1")
    transition = runs.transition
    raced: list[str] = []

    def cancel_first(session, row, to, *args, **kwargs):
        if to == "finalizing" and not raced:
            # Another caller's cancel, committed on its own connection, right now.
            worker = threading.Thread(target=lambda: client.cancel_maintenance(run.run_id))
            worker.start()
            worker.join()
            raced.append(row.status)
        return transition(session, row, to, *args, **kwargs)

    monkeypatch.setattr(runs, "transition", cancel_first)
    outcome = executor.execute(run.run_id)
    assert raced == ["running"]
    done = client.get_maintenance(run.run_id)
    assert outcome == done.status == "completed", (outcome, done.status, done.error_code)
    assert done.lease_token is None

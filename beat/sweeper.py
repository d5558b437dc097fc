"""The sweeper (docs/lifecycles.md: leases): finishes what a crash, a lost message or an outage left
behind.

`sweep_once(now, limit)` is a plain function: the clock is passed in, every row is handled on
its own (one bad row is logged and skipped), and the beat task only wraps it.
"""

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import or_, select
from sqlalchemy.engine import Engine

from ..models.db import run_transaction
from ..models.operations import GoalOperation
from ..workflows import leases
from ..workflows.activity.reconcile import to_reconcile
from ..workflows.fences import restores
from ..workflows.fences.fencing import no_fence_drives
from ..workflows.goals.operations import open_due, settle_or_reserve
from ..workflows.kinds import KINDS, due_to_republish, reserve_republish
from ..workflows.kinds.base import Kind, Republish
from ..workflows.kinds.goal import DISPATCH_TASK
from ..workflows.operators import counts as operation_counts
from ..workflows.prompts.queue import sessions_with_queued_prompts
from ..workflows.steps.maintenance_sweep import sweep_maintenance
from ..workflows.task_names import COALESCE_MAX_ITEMS, PROMPT_TASK, RESTORE_TASK, Publish

log = logging.getLogger(__name__)

SWEEPER_LEASE = "sweeper"
# A freshly submitted operation is published right after its commit; the sweeper leaves it
# alone this long so it only re-publishes what that publish really lost.
OUTBOX_GRACE_S = 2.0
# After re-publishing, an operation is not re-published again for this long (its task is
# on the way); a message lost again is caught on the next round.
REPUBLISH_INTERVAL_S = 10.0
# Rows handled per kind per sweep; bounded so one sweep stays short under a backlog.
BATCH_LIMIT = 500
# Transactions of counting (operation_counts.COUNT_BATCH rows of each kind) per sweep: up to
# 10,000 rows of each kind a sweep, 5,000 a second at the default 2 s interval (the history
# an upgrade finds uncounted takes some sweeps more; the counts are exact meanwhile).
COUNT_ROUNDS = 10


@dataclass
class SweepCounts:
    ran: bool = True
    republished: int = 0
    failed: int = 0
    errors: int = 0
    details: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "ran": self.ran,
            "republished": self.republished,
            "failed": self.failed,
            "errors": self.errors,
        }


def sweep_once(
    engine: Engine,
    publish: Publish,
    now: datetime,
    *,
    owner: str,
    limit: int = BATCH_LIMIT,
    lease_s: float = 60.0,
    cancel_grace_s: float = 15.0,
) -> SweepCounts:
    """One sweep under the sweeper lease: at most one sweep runs at a time, even with two
    beats. Returns what it did; `ran` is False when another sweep held the lease."""
    token = run_transaction(engine, lambda s: leases.claim(s, SWEEPER_LEASE, owner, lease_s, now))
    if token is None:
        return SweepCounts(ran=False)
    counts = SweepCounts()
    try:
        # Fences first (the kinds' order): a revoked target must never replay before its
        # fence.
        for kind in KINDS.values():
            if kind.republish is not None:
                _republish_due(engine, publish, now, limit, counts, kind, kind.republish)
        sweep_stale_mirrors(engine, now, limit, counts)
        sweep_restores(engine, publish, now, limit, counts)
        sweep_goal_operations(engine, publish, now, limit, counts)
        run_transaction(engine, lambda s: leases.prune_republish(s, now))
        maintenance = sweep_maintenance(
            engine,
            publish,
            now,
            cancel_grace_s=cancel_grace_s,
            outbox_grace_s=OUTBOX_GRACE_S,
            republish_interval_s=REPUBLISH_INTERVAL_S,
            limit=limit,
        )
        counts.republished += maintenance["republished"]
        counts.details["maintenance_recovery"] = maintenance["recovery"]
        for workspace_id, session_id in sessions_with_queued_prompts(
            engine, now, lease_s, limit, republish_interval_s=REPUBLISH_INTERVAL_S
        ):
            publish(PROMPT_TASK, {"workspace_id": workspace_id, "session_id": session_id})
            counts.republished += 1
        counts.details["counted"] = count_settled(engine)
        # The sweep finished: `status` and the metrics show its age, so a dead beat shows.
        run_transaction(engine, lambda s: leases.heartbeat(s, SWEEPER_LEASE, owner, now))
    finally:
        run_transaction(engine, lambda s: leases.release(s, SWEEPER_LEASE, token))
    return counts


def count_settled(engine: Engine) -> int:
    """What settled since the last sweep into the kept counts (workflows/operators/counts.py),
    a bounded batch per transaction, at most COUNT_ROUNDS of them; the rows counted."""
    moved = 0
    for _ in range(COUNT_ROUNDS):
        batch = run_transaction(engine, operation_counts.count_settled)
        moved += batch
        if batch < operation_counts.COUNT_BATCH:
            break
    return moved


def due_goal_operations(engine: Engine, now: datetime, limit: int) -> list[str]:
    """Open operations whose next attempt is due, that no live lease holds and no fence
    drives (a fence's clear is its fence's until the fence settles: fencing.no_fence_drives).

    Served by the (status, next_attempt_at) index, so the cost follows the due work, not
    the size of history. Only a never-dispatched operation gets the outbox grace: a retry
    or an expired lease has no publish of its own on the way."""
    cutoff = now - timedelta(seconds=OUTBOX_GRACE_S)
    return run_transaction(
        engine,
        lambda s: list(
            s.execute(
                select(GoalOperation.operation_id)
                .where(
                    *open_due(now),
                    no_fence_drives(),
                    or_(GoalOperation.attempt > 0, GoalOperation.next_attempt_at <= cutoff),
                )
                .order_by(GoalOperation.next_attempt_at)
                .limit(limit)
            ).scalars()
        ),
    )


def sweep_goal_operations(
    engine: Engine, publish: Publish, now: datetime, limit: int, counts: SweepCounts
) -> None:
    """Re-publish due prepared/dispatched work (the operation row is the outbox), take over
    expired leases, and fail operations whose budget ran out even if no worker runs them."""
    reserved: list[str] = []
    until = now + timedelta(seconds=REPUBLISH_INTERVAL_S)
    for operation_id in due_goal_operations(engine, now, limit):
        try:
            action = run_transaction(
                engine, lambda s, op_id=operation_id: settle_or_reserve(s, op_id, now, until)
            )
            if action == "republish":
                reserved.append(operation_id)
            elif action == "failed":
                counts.failed += 1
        except Exception:  # noqa: BLE001 - one bad row must not stop the sweep
            counts.errors += 1
            log.exception("sweeper: goal operation %s", operation_id)
    # A backlog goes out as messages of up to COALESCE_MAX_ITEMS ids, one dispatch step each;
    # a message lost here is caught again once its reservation runs out.
    for start in range(0, len(reserved), COALESCE_MAX_ITEMS):
        chunk = reserved[start : start + COALESCE_MAX_ITEMS]
        try:
            publish(
                DISPATCH_TASK,
                {"operation_id": chunk[0]} if len(chunk) == 1 else {"operation_ids": chunk},
            )
            counts.republished += len(chunk)
        except Exception:  # noqa: BLE001 - the rest of the sweep still runs
            counts.errors += 1
            log.exception("sweeper: publishing dispatch for %s", ", ".join(chunk))


def _republish_due(
    engine: Engine,
    publish: Publish,
    now: datetime,
    limit: int,
    counts: SweepCounts,
    kind: Kind,
    spec: Republish,
) -> None:
    """Re-publish rows of a kind that are due and unleased (Kind.republish: pending fences
    whose publish was lost or whose retry is due, cancels whose lease expired, ...),
    reserving each for REPUBLISH_INTERVAL_S with a conditional update so two sweeps never
    both publish it."""
    cutoff = now - timedelta(seconds=OUTBOX_GRACE_S)
    until = now + timedelta(seconds=REPUBLISH_INTERVAL_S)
    ids_due = run_transaction(engine, lambda s: due_to_republish(s, kind, now, cutoff, limit))
    for row_id in ids_due:
        try:
            reserved = run_transaction(
                engine,
                lambda s, row_id=row_id: reserve_republish(s, kind, row_id, now, cutoff, until),
            )
            if reserved:
                publish(spec.task, {spec.kwarg: row_id})
                counts.republished += 1
        except Exception:  # noqa: BLE001 - one bad row must not stop the sweep
            counts.errors += 1
            log.exception("sweeper: %s %s", kind.noun, row_id)


def sweep_stale_mirrors(engine: Engine, now: datetime, limit: int, counts: SweepCounts) -> None:
    """Sessions whose mirror may be wrong get their restore, which asks the host what it runs
    (docs/lifecycles.md: reconcile; reconcile.to_reconcile says which, and how often), a
    bounded batch a sweep; sweep_restores publishes them in this same sweep."""

    def request(s) -> int:
        keys = s.execute(to_reconcile(now).limit(limit)).all()
        return restores.request_reconcile(s, keys, now - timedelta(seconds=OUTBOX_GRACE_S), now)

    try:
        counts.details["reconcile"] = run_transaction(engine, request)
    except Exception:  # noqa: BLE001 - the rest of the sweep still runs
        counts.errors += 1
        log.exception("sweeper: sessions to reconcile")


def sweep_restores(
    engine: Engine, publish: Publish, now: datetime, limit: int, counts: SweepCounts
) -> None:
    """Sessions whose restore is due (workflows/steps/restore.py) and whose message was
    lost, whose restore met a fault, or whose restoring worker died: published again, each
    reserved for REPUBLISH_INTERVAL_S first so two sweeps never both publish it."""
    cutoff = now - timedelta(seconds=OUTBOX_GRACE_S)
    due = run_transaction(engine, lambda s: restores.due(s, cutoff, limit))
    until = now + timedelta(seconds=REPUBLISH_INTERVAL_S)
    for workspace_id, session_id, due_at in due:
        try:
            reserved = run_transaction(
                engine,
                lambda s, key=(workspace_id, session_id), due_at=due_at: restores.reserve(
                    s, *key, due_at, until
                ),
            )
            if reserved:
                publish(RESTORE_TASK, {"workspace_id": workspace_id, "session_id": session_id})
                counts.republished += 1
        except Exception:  # noqa: BLE001 - one bad row must not stop the sweep
            counts.errors += 1
            log.exception("sweeper: restore of %s/%s", workspace_id, session_id)

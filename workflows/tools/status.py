"""`agent-radar status`: the fleet at a glance, straight from the database."""

from datetime import datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from ...models.base import utcnow
from ...models.coordination import HostCircuit
from ...models.db import run_read
from ...models.enums import SyncStatus
from ...models.operations import CancelOperation, GoalFence, GoalOperation, MaintenanceRun, Prompt
from ...models.tables import AgentSession, GoalState, RuntimeHost
from .. import budgets, leases
from ..activity.reconcile import wedged
from ..kinds.cancel import OPEN_CANCEL_STATUSES, RUN_STILL_STOPPING, RUN_STOP_SLOW_S
from ..kinds.fence import FenceStatus
from ..kinds.goal import OPEN_OPERATION_STATUSES
from ..kinds.maintenance import LIVE_MAINTENANCE_STATUSES, MaintenanceStatus
from ..kinds.prompt import PromptStatus
from ..operators.counts import Counts, by_status, operation_counts
from ..sessions import hosts
from ..steps.fence_apply import WAITING_FOR_TURN

# The sweep's heartbeat (beat/sweeper.py records it under the sweeper lease's name).
SWEEP_HEARTBEAT = "sweeper"
# status --check fails when no sweep finished for this many sweep intervals.
STALE_SWEEPS = 5
# How many of each kind of offender `status` names.
WORST = 5
# Due work older than this is "overdue": the sweeper (every 2 s by default) should have
# picked it up long before.
OVERDUE_S = 30
# `status --check` fails while a goal operation or fence failed this recently: a failure is
# news for this long (the alert AgentRadarOperationsFailing looks back 15 minutes).
FAILED_RECENTLY_S = 3600


def fleet_status(engine: Engine, now: datetime | None = None) -> dict:
    """The fleet at a glance, in one read-only transaction."""
    return run_read(engine, lambda s: fleet_facts(s, now or utcnow()))


def fleet_facts(s: Session, now: datetime, counts: Counts | None = None) -> dict:
    """What `status` shows and `metrics` exports, read in the caller's transaction; `counts`:
    operation_counts, if the caller read them already. Every read is of open work, of
    failures, or of kept counts (docs/operations.md: counts), never of the whole history."""
    counts = operation_counts(s) if counts is None else counts
    per_status = by_status(counts, "goal")
    due_filter = (
        GoalOperation.status.in_(OPEN_OPERATION_STATUSES),
        GoalOperation.next_attempt_at <= now,
        leases.unheld(GoalOperation, now),
    )
    due = s.execute(select(func.count()).where(*due_filter)).scalar_one()
    overdue = s.execute(
        select(func.count()).where(
            *due_filter, GoalOperation.next_attempt_at <= now - timedelta(seconds=OVERDUE_S)
        )
    ).scalar_one()
    oldest = s.execute(
        select(func.min(GoalOperation.next_attempt_at)).where(*due_filter)
    ).scalar_one()
    in_flight = s.execute(
        select(func.count()).where(
            GoalOperation.status.in_(OPEN_OPERATION_STATUSES),
            GoalOperation.lease_expires_at > now,
        )
    ).scalar_one()
    runs = by_status(counts, "maintenance")
    held = s.execute(
        select(
            func.count(func.distinct(MaintenanceRun.workspace_id + "/" + MaintenanceRun.session_id))
        ).where(MaintenanceRun.status.in_(LIVE_MAINTENANCE_STATUSES))
    ).scalar_one()
    fences = by_status(counts, "fence")
    cancels = by_status(counts, "cancel")
    prompts = by_status(counts, "prompt")
    queued_prompts = prompts.get(PromptStatus.QUEUED, 0)
    # Background rows that ran out of budget (budgets.py), by kind.
    exhausted = {
        kind: s.execute(
            select(func.count()).where(
                table.status == "failed",  # the status index narrows the scan
                table.last_error.like(f"{budgets.BUDGET_EXHAUSTED}%"),
            )
        ).scalar_one()
        for kind, table in (
            ("goal_operations", GoalOperation),
            ("fences", GoalFence),
            ("cancels", CancelOperation),
            ("prompts", Prompt),
        )
    }
    since = now - timedelta(seconds=FAILED_RECENTLY_S)
    worst = {
        "overdue_operations": [
            {
                "operation_id": r.operation_id,
                "session": f"{r.workspace_id}/{r.session_id}",
                "overdue_s": round((now - r.next_attempt_at).total_seconds(), 1),
                "attempt": r.attempt,
                "last_error": r.last_error,
            }
            for r in s.execute(
                select(GoalOperation)
                .where(
                    *due_filter,
                    GoalOperation.next_attempt_at <= now - timedelta(seconds=OVERDUE_S),
                )
                .order_by(GoalOperation.next_attempt_at)
                .limit(WORST)
            ).scalars()
        ],
        "runs_in_recovery": [
            {
                "run_id": r.run_id,
                "session": f"{r.workspace_id}/{r.session_id}",
                "error_code": r.error_code,
                "started_at": r.started_at.isoformat(),
            }
            for r in s.execute(
                select(MaintenanceRun)
                .where(MaintenanceRun.status == MaintenanceStatus.RECOVERY_REQUIRED)
                .order_by(MaintenanceRun.started_at)
                .limit(WORST)
            ).scalars()
        ],
        # Prompts whose sends keep failing: each blocks its session's queue until it is
        # sent or its budget ends it.
        "prompts_retrying": [
            {
                "prompt_id": r.prompt_id,
                "session": f"{r.workspace_id}/{r.session_id}",
                "attempt": r.attempt,
                "last_error": r.last_error,
            }
            for r in s.execute(
                select(Prompt)
                .where(Prompt.status == PromptStatus.QUEUED, Prompt.failing_since.is_not(None))
                .order_by(Prompt.failing_since)
                .limit(WORST)
            ).scalars()
        ],
        "restores_out_of_budget": [
            {"session": f"{r.workspace_id}/{r.session_id}", "last_error": r.restore_error}
            for r in s.execute(
                select(AgentSession)
                .where(AgentSession.restore_attempt > 0, _restore_spent())
                .order_by(AgentSession.restore_failing_since)
                .limit(WORST)
            ).scalars()
        ],
        "diverged_goals": [
            {"session": f"{r.workspace_id}/{r.session_id}", "revision": r.revision}
            for r in s.execute(
                select(GoalState)
                .where(GoalState.sync_status == SyncStatus.DIVERGED)
                .order_by(GoalState.workspace_id, GoalState.session_id)
                .limit(WORST)
            ).scalars()
        ],
        "wedged_sessions": [
            f"{ws}/{sid}" for ws, sid in s.execute(wedged(now).order_by(None).limit(WORST))
        ],
        # What failed in the last hour, newest first: what `status --check` fails on, by name.
        "failed_recently": [
            {
                "kind": kind,
                "id": getattr(r, key),
                "session": f"{r.workspace_id}/{r.session_id}",
                "last_error": r.last_error,
            }
            for kind, table, key in (
                ("goal operation", GoalOperation, "operation_id"),
                ("fence", GoalFence, "fence_id"),
                ("turn cancel", CancelOperation, "operation_id"),
            )
            for r in s.execute(
                select(table)
                .where(table.status == "failed", table.completed_at >= since)
                .order_by(table.completed_at.desc())
                .limit(WORST)
            ).scalars()
        ],
        "fences_waiting_on_a_turn": [
            {
                "fence_id": r.fence_id,
                "session": f"{r.workspace_id}/{r.session_id}",
                "cancel_operation_id": r.cancel_operation_id,
            }
            for r in s.execute(
                select(GoalFence)
                .where(
                    GoalFence.status == FenceStatus.PENDING,
                    GoalFence.last_error == WAITING_FOR_TURN,
                )
                .order_by(GoalFence.created_at)
                .limit(WORST)
            ).scalars()
        ],
    }
    failed_recently = {
        kind: s.execute(
            select(func.count()).where(
                table.status == "failed",  # the status index narrows the scan
                table.completed_at >= since,
            )
        ).scalar_one()
        for kind, table in (
            ("goal_operations", GoalOperation),
            ("fences", GoalFence),
            ("cancels", CancelOperation),  # a turn or a run that may still run there
        )
    }
    heartbeat = leases.heartbeat_age_s(s, SWEEP_HEARTBEAT, now)
    waiting_on_a_turn = s.execute(
        select(func.count()).where(
            GoalFence.status == FenceStatus.PENDING, GoalFence.last_error == WAITING_FOR_TURN
        )
    ).scalar_one()
    # Hosts a worker skips for now: their calls kept failing (workflows/steps/goals/flight.py).
    hosts_skipped = [
        {
            "host_id": c.host_id,
            "for_s": round((c.open_until - now).total_seconds(), 1),
            "failures": c.failures,
            "last_error": c.last_error,
        }
        for c in s.execute(
            select(HostCircuit).where(HostCircuit.open_until > now).order_by(HostCircuit.host_id)
        ).scalars()
    ]
    return {
        **_host_truth(s, now),
        "goal_operations": per_status,
        "maintenance_runs": runs,
        "fences": fences,
        "cancels": cancels,
        "held_sessions": held,
        "sessions_in_recovery": runs.get(MaintenanceStatus.RECOVERY_REQUIRED, 0),
        "queued_prompts": queued_prompts,
        "prompts": prompts,
        "budget_exhausted": exhausted,
        "failed_last_hour": failed_recently,
        "due": due,
        "overdue": overdue,
        "in_flight": in_flight,
        # How behind workers and sweeper are: the oldest due operation nobody works on.
        "sweeper_lag_s": round((now - oldest).total_seconds(), 3) if oldest else 0.0,
        # Seconds since a sweep last finished (None: never): a dead beat shows here.
        "sweeper_heartbeat_age_s": None if heartbeat is None else round(heartbeat, 3),
        "fences_waiting_on_a_turn": waiting_on_a_turn,
        "hosts_skipped": hosts_skipped,
        "worst": worst,
    }


def _restore_spent():
    return AgentSession.restore_error.like(f"{budgets.BUDGET_EXHAUSTED}%")


def _host_truth(s: Session, now: datetime) -> dict:
    """Where the mirror and the hosts disagree, or could not be made to agree
    (docs/lifecycles.md: reconcile): goals by sync status `diverged` and `unknown`, restores
    failing and out of budget, wedged sessions."""
    unsure = dict(
        s.execute(
            select(GoalState.sync_status, func.count())
            .where(GoalState.sync_status.in_((SyncStatus.UNKNOWN, SyncStatus.DIVERGED)))
            .group_by(GoalState.sync_status)
        ).all()
    )
    failing, spent = (
        s.execute(
            select(func.count()).where(AgentSession.restore_attempt > 0, *condition)
        ).scalar_one()
        for condition in ((), (_restore_spent(),))
    )
    return {
        # Registered hosts without a token: their reports are taken unsigned (development
        # only; docs/protocol.md: signing a report).
        "unsigned_report_hosts": list(
            s.execute(
                select(RuntimeHost.host_id)
                .where(RuntimeHost.token.is_(None))
                .order_by(RuntimeHost.host_id)
                .limit(WORST)
            ).scalars()
        ),
        "report_refusals": hosts.refusals(s, WORST),
        "goals_diverged": unsure.get(SyncStatus.DIVERGED, 0),
        "goals_unknown": unsure.get(SyncStatus.UNKNOWN, 0),
        "restores_retrying": failing - spent,
        "restores_out_of_budget": spent,
        "wedged_sessions": s.execute(
            select(func.count()).select_from(wedged(now).subquery())
        ).scalar_one(),
        # Runs a move or a restart ended here that their host still runs, asked to stop.
        "runs_not_stopping": s.execute(
            select(func.count()).where(
                CancelOperation.status.in_(OPEN_CANCEL_STATUSES),
                CancelOperation.last_error.like(RUN_STILL_STOPPING.format(run_id="%", host_id="%")),
                CancelOperation.created_at <= now - timedelta(seconds=RUN_STOP_SLOW_S),
            )
        ).scalar_one(),
    }


def problems(status: dict, sweep_interval_s: float) -> list[str]:
    """What `status --check` fails on: overdue work, goal operations, fences or cancels that
    failed in the last hour, runs needing recovery, a host skipped because its calls keep failing, a
    sweeper that has not finished a sweep for 5 intervals (or ever), a goal the host holds
    otherwise than desired, a session's restore out of budget, a wedged session, a run its
    host does not stop."""
    found = []
    for key, text in (
        ("goals_diverged", "goal(s) diverged: the host holds another goal than desired"),
        ("restores_out_of_budget", "session restore(s) out of budget"),
        ("wedged_sessions", "session(s) wedged: a turn on record its host was not asked about"),
        ("runs_not_stopping", "maintenance run(s) still running at a host asked to stop them"),
    ):
        if status.get(key):
            found.append(f"{status[key]} {text}")
    for kind, count in status.get("failed_last_hour", {}).items():
        if count:
            found.append(f"{count} {kind.replace('_', ' ')} failed in the last hour")
    if status["overdue"]:
        found.append(f"{status['overdue']} goal operation(s) overdue")
    if status["sessions_in_recovery"]:
        found.append(f"{status['sessions_in_recovery']} maintenance run(s) need recovery")
    for host in status.get("hosts_skipped", []):
        found.append(f"host {host['host_id']} skipped: its calls keep failing")
    stale = sweeper_problem(status["sweeper_heartbeat_age_s"], sweep_interval_s)
    if stale:
        found.append(stale)
    return found


def sweeper_problem(age_s: float | None, sweep_interval_s: float) -> str | None:
    """Why the sweeper counts as not running (no sweep finished for STALE_SWEEPS intervals,
    or ever); None while it runs."""
    if age_s is None:
        return "the sweeper has never run (is beat up?)"
    if age_s > STALE_SWEEPS * sweep_interval_s:
        return f"the sweeper last ran {age_s:.0f} s ago (is beat up?)"
    return None

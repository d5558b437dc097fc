"""Reconcile (docs/lifecycles.md: reconcile): the turns and goal on record are a mirror built from
reports, which get lost, reordered or forged; the host's answer to the state call is the truth.
`apply_state` makes the mirror of one session agree with that answer, in the caller's transaction:

- an epoch newer than the one known is confirmed (it is the host's own answer);
- a turn on record as unsettled, seen before the host was asked, that the host does not list
  ended there unseen: it ends `interrupted`, and what waited on it goes on;
- a turn the host lists that the mirror never saw is recorded, and gets its durable cancel if
  its generation is fenced;
- a dispatched goal operation the host says it applied completes, and a goal state `unknown`
  or `diverged` learns what the host holds;
- a prompt sent long before the host was asked whose turn is on record nowhere (its reports
  lost) and that the host does not list ended there unseen: the prompt ends, the queue goes on.

An answer is applied only while the session is still at the host that gave it.
"""

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import or_, select, union
from sqlalchemy.orm import Session

from ...models.enums import SyncStatus, TurnOutcome, TurnPhase
from ...models.operations import GoalOperation, Prompt
from ...models.tables import AgentSession, GoalState, Turn
from ..adapters.answers import HostState, HostTurn
from ..fences import cancels
from ..goals.operations import complete_applied, sync_of
from ..kinds.goal import OperationStatus
from ..prompts import queue as prompts
from ..sessions import turns
from ..sessions.rows import Heard, lock_session, record_liveness, same_session
from .epochs import EpochEffects, observe_epoch

# A turn on record as unsettled for this long gets its session's host asked what it runs, at most
# once per RECONCILE_INTERVAL_S per session: a turn may run for hours, and each look is one call.
STALE_TURN_S = 120.0
RECONCILE_INTERVAL_S = 300.0
# A session whose mirror has held a stale turn this long with no answer from its host since is
# wedged: `status --check` says so (the host fails the state call, or nothing asks it).
WEDGED_S = STALE_TURN_S + 2 * RECONCILE_INTERVAL_S


@dataclass
class Reconciled:
    """What the host's answer set in motion, for the caller to publish after commit."""

    ended: list[str] = field(default_factory=list)  # turns it ended unseen
    recorded: list[str] = field(default_factory=list)  # turns the mirror never saw
    cancels: list[str] = field(default_factory=list)  # durable cancels of fenced turns
    woken_fences: list[str] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)  # goal operations it completed
    prompts_ended: list[str] = field(default_factory=list)  # prompts whose turn ended unseen
    epoch: EpochEffects = field(default_factory=EpochEffects)

    @property
    def wake_prompts(self) -> bool:
        return bool(self.ended or self.prompts_ended) or self.epoch.newer


def apply_state(
    session: Session,
    workspace_id: str,
    session_id: str,
    state: HostState,
    asked_at: datetime,
    now: datetime,
    *,
    asked_host: str,
) -> Reconciled:
    """Make the session's mirror agree with the answer of `asked_host`, asked at `asked_at`;
    nothing, if the session is no longer there (it moved while the host was asked) or the
    answer tells of an older process than one known since (a restart meanwhile)."""
    row = lock_session(session, workspace_id, session_id)
    done = Reconciled()
    if row.host_id != asked_host:
        return done
    record_liveness(row, state.live, Heard(asked_at, asked_host))
    if state.runtime_epoch < (row.runtime_epoch or 0):
        return done  # an older process's answer, written late: what it ran ended with it
    row.reconciled_at = now
    done.epoch = observe_epoch(session, row, state.runtime_epoch, now)
    done.woken_fences += done.epoch.woken_fences
    # Each turn the host lists, by its record key: (host, epoch, id) is a turn's identity.
    listed = {
        turns.turn_key(
            session, workspace_id, session_id, row.host_id, turn.runtime_epoch, turn.turn_id
        ): turn
        for turn in state.turns
    }
    unseen = _ended_unseen(session, workspace_id, session_id, set(listed), asked_at)
    if unseen:
        done.ended = unseen
        done.woken_fences += cancels.interrupt_turns(session, workspace_id, session_id, unseen, now)
    for key, turn in listed.items():
        recorded = session.get(Turn, (workspace_id, session_id, key))
        if recorded is None:
            _record(session, row, key, turn, now)
            done.recorded.append(key)
        elif not recorded.runtime_epoch:  # a prompt's turn: the host says which epoch
            recorded.runtime_epoch = turn.runtime_epoch
        cancel_id = cancels.cancel_if_fenced(session, workspace_id, session_id, key, now)
        if cancel_id is not None:
            done.cancels.append(cancel_id)
    _reconcile_goal(session, workspace_id, session_id, state, now, done)
    done.prompts_ended = _prompts_ended_unseen(session, row, state, asked_at)
    return done


def _prompts_ended_unseen(session: Session, row, state: HostState, asked_at: datetime) -> list[str]:
    """The session's prompts sent STALE_TURN_S before the host was asked, whose turn is on
    record nowhere and that the host does not list: that turn ended there unseen, and each
    prompt ends (`completed`, as its turn ending `interrupted` ends it)."""
    listed = {t.turn_id for t in state.turns} | {t.prompt_id for t in state.turns}
    found = session.execute(
        select(Prompt.prompt_id, Prompt.turn_id).where(
            Prompt.workspace_id == row.workspace_id,
            Prompt.session_id == row.session_id,
            *prompts.unrecorded(asked_at - timedelta(seconds=STALE_TURN_S)),
        )
    ).all()
    ended = [prompt_id for prompt_id, turn_id in found if not {prompt_id, turn_id} & listed]
    for prompt_id in ended:
        prompts.on_turn_settled(
            session, row.workspace_id, row.session_id, prompt_id, TurnOutcome.INTERRUPTED
        )
    return ended


def _ended_unseen(
    session: Session, workspace_id: str, session_id: str, listed: set[str], asked_at: datetime
) -> list[str]:
    """The unsettled turns on record that were seen before the host was asked and that it
    does not list (a turn first seen after it was asked may have started since)."""
    unsettled = turns.unsettled_turns(
        session, workspace_id, session_id, or_(Turn.seen_at.is_(None), Turn.seen_at < asked_at)
    )
    return sorted(turn_id for turn_id in unsettled if turn_id not in listed)


def _record(session: Session, row, key: str, turn: HostTurn, now: datetime) -> None:
    session.add(
        Turn(
            workspace_id=row.workspace_id,
            session_id=row.session_id,
            turn_id=key,
            host_id=row.host_id,
            host_turn_id=None if key == turn.turn_id else turn.turn_id,
            phase=turn.phase,
            origin=turn.origin,
            source_goal_operation_id=turn.source_goal_operation_id,
            source_goal_revision=turn.source_goal_revision,
            prompt_id=turn.prompt_id,
            runtime_epoch=turn.runtime_epoch,
            started_at=now,
            seen_at=now,
        )
    )
    if turn.phase == TurnPhase.RUNNING:
        row.active_turn_id = key
    session.flush()


def _reconcile_goal(
    session: Session,
    workspace_id: str,
    session_id: str,
    state: HostState,
    now: datetime,
    done: Reconciled,
) -> None:
    """The goal the host says it applied last: its dispatched operation completes with the
    host's answer as the evidence; a goal state `unknown` or `diverged` at that revision learns
    what the host holds now."""
    applied = state.goal
    if applied is None:
        return
    goal = (
        None
        if applied.objective is None
        else {"objective": applied.objective, "status": applied.status}
    )
    op = session.get(GoalOperation, applied.operation_id, populate_existing=True)
    if (
        op is not None
        and (op.workspace_id, op.session_id) == (workspace_id, session_id)
        and op.goal_revision == applied.revision
        and op.status == OperationStatus.DISPATCHED
        and complete_applied(session, op, goal, {"state": "applied"}, now)
    ):
        done.completed.append(op.operation_id)
    goal_state = session.get(GoalState, (workspace_id, session_id), populate_existing=True)
    if (
        goal_state is not None
        and goal_state.sync_status in (SyncStatus.UNKNOWN, SyncStatus.DIVERGED)
        and goal_state.pending_operation_id is None
        and goal_state.revision == applied.revision
    ):
        goal_state.observed = goal
        goal_state.sync_status = sync_of(
            goal, goal_state.desired, f"session {workspace_id}/{session_id}"
        )


def _stale_turns(now: datetime, older_than_s: float):
    """The sessions with a turn on record as unsettled, first seen more than `older_than_s`
    before `now` (the settled_at index finds the unsettled ones)."""
    return select(Turn.workspace_id, Turn.session_id).where(
        Turn.settled_at.is_(None),
        Turn.phase != TurnPhase.SETTLED,
        Turn.seen_at < now - timedelta(seconds=older_than_s),
    )


def _sessions(keys, asked_before: datetime):
    """The live (as far as is known) sessions among `keys` whose host was not asked what it
    runs since `asked_before`, and no restore is due for."""
    found = keys.subquery()
    return (
        select(AgentSession.workspace_id, AgentSession.session_id)
        .join(found, same_session(found.c, AgentSession))
        .where(
            AgentSession.live.is_not(False),
            or_(AgentSession.reconciled_at.is_(None), AgentSession.reconciled_at < asked_before),
        )
        .distinct()
    )


def to_reconcile(now: datetime):
    """SQL: the sessions whose mirror may be wrong and whose host is due to be asked — a turn
    on record as unsettled for STALE_TURN_S (its settled report lost, or a forged one), a
    prompt sent as long ago whose turn is on record nowhere, a goal state `unknown` or
    `diverged` — at most once per RECONCILE_INTERVAL_S each."""
    unsure = select(GoalState.workspace_id, GoalState.session_id).where(
        GoalState.sync_status.in_((SyncStatus.UNKNOWN, SyncStatus.DIVERGED)),
        GoalState.pending_operation_id.is_(None),
    )
    stale_prompts = select(Prompt.workspace_id, Prompt.session_id).where(
        *prompts.unrecorded(now - timedelta(seconds=STALE_TURN_S))
    )
    return _sessions(
        union(_stale_turns(now, STALE_TURN_S), unsure, stale_prompts),
        now - timedelta(seconds=RECONCILE_INTERVAL_S),
    ).where(AgentSession.restore_due_at.is_(None))


def wedged(now: datetime):
    """SQL: the wedged sessions: a stale turn on record for WEDGED_S and the host not asked
    for twice RECONCILE_INTERVAL_S (it fails the state call, or nothing asks it)."""
    return _sessions(_stale_turns(now, WEDGED_S), now - timedelta(seconds=2 * RECONCILE_INTERVAL_S))

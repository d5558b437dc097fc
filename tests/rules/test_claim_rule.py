"""The claim rule has one source of truth (workflows/goals/claim_rule.py); on PostgreSQL the
claim's read and claim are one statement (LOOKUP_AND_CLAIM) whose conditions say the same, and
so is a named message's claim (NAMED_CLAIM, the function of migration 0016). This proves the
three equal, state by state: for every combination of the states the rule looks at, each
takes exactly the operations the rule lets go."""

import itertools
import uuid
from datetime import timedelta

import pytest
from sqlalchemy.orm import Session

from agent_radar.models.base import utcnow
from agent_radar.models.operations import GoalOperation, MaintenanceRun
from agent_radar.models.tables import AgentSession, GoalState
from agent_radar.workflows.goals.claim_rule import obstacle
from agent_radar.workflows.goals.operations import (
    ACCEPTED_BUDGET_S,
    DISPATCH_BUDGET_S,
    DISPATCH_MAX_ATTEMPTS,
)
from agent_radar.workflows.goals.statements import (
    LOOKUP_AND_CLAIM,
    NAMED_CLAIM,
    lookup_and_claim_params,
    named_claim_params,
)
from agent_radar.workflows.kinds.goal import OperationStatus, ProviderPhase
from agent_radar.workflows.kinds.maintenance import MaintenanceStatus

WS = "ws-claim-rule"


def _states(now):
    """Every combination of what the rule reads: status, lease, the goal state's revision
    and pending operation, a maintenance hold, the provider phase (with how long ago an
    accepted one was acknowledged), attempts, and the time since the first dispatch."""
    return itertools.product(
        [OperationStatus.PREPARED, OperationStatus.DISPATCHED, OperationStatus.COMPLETED],
        [None, now - timedelta(seconds=1), now + timedelta(seconds=60)],
        [True, False],  # the goal state is at the operation's revision
        [True, False],  # the goal state's pending operation is this one
        [False, True],  # a live maintenance run holds the session
        [
            (ProviderPhase.DISPATCHED, None),
            (ProviderPhase.ACCEPTED, now - timedelta(seconds=10)),
            (ProviderPhase.ACCEPTED, now - timedelta(seconds=ACCEPTED_BUDGET_S + 1)),
        ],
        [0, DISPATCH_MAX_ATTEMPTS - 1, DISPATCH_MAX_ATTEMPTS],
        [None, now - timedelta(seconds=10), now - timedelta(seconds=DISPATCH_BUDGET_S + 1)],
    )


@pytest.mark.parametrize("backend", ["production"])
def test_the_claim_statement_takes_exactly_what_the_claim_rule_lets_go(client):
    now = utcnow()
    ops = []
    with Session(client.engine) as s, s.begin():
        for n, state in enumerate(_states(now)):
            status, lease, at_revision, pending, held, (phase, accepted), attempt, first = state
            sid, op_id = f"s-{n}", str(uuid.uuid4())
            s.add(AgentSession(workspace_id=WS, session_id=sid, live=True))
            s.add(
                GoalState(
                    workspace_id=WS,
                    session_id=sid,
                    revision=1 if at_revision else 2,
                    pending_operation_id=op_id if pending else "another",
                )
            )
            s.add(
                GoalOperation(
                    operation_id=op_id,
                    workspace_id=WS,
                    session_id=sid,
                    client_submit_id=f"c-{n}",
                    origin="client",
                    action="set",
                    objective="x",
                    goal_revision=1,
                    status=status,
                    provider_phase=phase,
                    attempt=attempt,
                    next_attempt_at=now,
                    first_dispatched_at=first,
                    accepted_at=accepted,
                    created_at=now,
                    lease_owner="w" if lease else None,
                    lease_token="t" if lease else None,
                    lease_expires_at=lease,
                )
            )
            if held:
                s.add(
                    MaintenanceRun(
                        run_id=str(uuid.uuid4()),
                        workspace_id=WS,
                        session_id=sid,
                        client_submit_id=f"m-{n}",
                        kind="compact",
                        status=MaintenanceStatus.RUNNING,
                        revision=1,
                        runtime_epoch=0,
                        started_at=now,
                    )
                )
            ops.append((op_id, state))
    assert len(ops) == 3 * 3 * 2 * 2 * 2 * 3 * 3 * 3

    params = lookup_and_claim_params([op for op, _ in ops], now, "worker", "token", now)
    with Session(client.engine) as s, s.begin():
        rows = {row.operation_id: row for row in s.connection().execute(LOOKUP_AND_CLAIM, params)}
        s.rollback()
    assert len(rows) == len(ops)
    disagree = [
        (state, obstacle(rows[op], op, now), rows[op].taken)
        for op, state in ops
        if bool(rows[op].taken) != (obstacle(rows[op], op, now) is None)
    ]
    assert disagree == []
    # Both verdicts occur: the grid reaches the cases that go and the cases that do not.
    taken = sum(bool(row.taken) for row in rows.values())
    assert 0 < taken < len(ops)
    # The named claim takes the same, one operation at a time, and returns the row as the
    # statement read it (before the claim).
    with Session(client.engine) as s, s.begin():
        conn = s.connection()
        for op, state in ops:
            claim = lookup_and_claim_params([op], now, "worker", "token", now)
            key = (WS, rows[op].session_id)
            named = conn.execute(
                NAMED_CLAIM, named_claim_params(op, key, f"lane-{op}", "lane-token", claim)
            ).all()
            assert bool(named) == bool(rows[op].taken), state
            if named:
                read = rows[op]._asdict()
                del read["taken"]
                assert named[0]._asdict() == read
        s.rollback()

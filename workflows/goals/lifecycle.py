"""A goal operation's states as one table (docs/lifecycles.md: goals): `prepared` until a
dispatch claims it (`dispatched`, taken over once its lease runs out, given back `prepared`
when it was not called), then `completed`, `superseded` by a newer goal, or `failed` past its
budget or refused for good; an operator's retry makes a failed one `prepared` again. A fence
that settles its clear without the agent completes a `prepared` one too.

The moves of Python code go through `GOAL.move`. The dispatch's prebuilt statements
(statements.py, operations.py: a claim, a give-back, a completion, a supersede) move within
this table; those whose `from` states are all the table allows take them from `GOAL.sources`.
"""

from ...models.operations import GoalOperation
from ..kinds.goal import OperationStatus
from ..transitions import Machine

S = OperationStatus
GOAL = Machine(
    GoalOperation,
    GoalOperation.operation_id,
    GoalOperation.status,
    {
        S.PREPARED: frozenset({S.DISPATCHED, S.COMPLETED, S.SUPERSEDED, S.FAILED}),
        S.DISPATCHED: frozenset({S.DISPATCHED, S.PREPARED, S.COMPLETED, S.SUPERSEDED, S.FAILED}),
        S.FAILED: frozenset({S.PREPARED}),
    },
)

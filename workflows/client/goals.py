"""The client's goal control and fences (docs/lifecycles.md; docs/packaging.md)."""

import logging
from functools import cached_property

from sqlalchemy import select

from ...models.base import utcnow
from ...models.db import run_transaction
from ...models.dialects import dialect_of
from ...models.operations import GoalOperation as GoalOperationRow
from ...models.tables import GoalState as GoalStateRow
from .. import ids, records
from ..errors import NotFound
from ..fences.fencing import FenceRequest, submit_fence
from ..goals import pullers
from ..goals.submit import GoalRequest, load_operation, submit
from ..kinds.fence import FENCE_APPLY_TASK, Fence
from ..kinds.goal import DISPATCH_TASK, GoalOperation
from ..records import GoalState
from ..validation import check_id
from .base import ClientBase

log = logging.getLogger(__name__)


def _dispatch_message(named: list[pullers.Named]) -> dict:
    """A dispatch message's arguments for these (operation, workspace, session): one
    operation alone names its session too, and the worker then takes the session's lane
    without reading it first (a claim it checks)."""
    if len(named) == 1:
        ((operation_id, workspace_id, session_id),) = named
        return {
            "operation_ids": [operation_id],
            "workspace_id": workspace_id,
            "session_id": session_id,
        }
    return {"operation_ids": [operation_id for operation_id, _ws, _sid in named]}


class GoalCalls(ClientBase):
    # -- goal control ----------------------------------------------------------------------
    def goal_control(
        self,
        workspace_id: str,
        session_id: str,
        action: str,
        objective: str | None = None,
        *,
        client_submit_id: str,
        expected_revision: int | None = None,
    ) -> GoalOperation:
        request = GoalRequest.parse(
            workspace_id,
            session_id,
            action,
            objective,
            client_submit_id=client_submit_id,
            expected_revision=expected_revision,
        )
        return self._accept(
            lambda s: submit(s, request, utcnow()),
            DISPATCH_TASK,
            lambda op: (op.operation_id, op.workspace_id, op.session_id),
            pack=_dispatch_message,
            divert=self._notify_pullers if self._pulls else None,
        )

    @cached_property
    def _pulls(self) -> bool:
        return self.settings.pull and dialect_of(self.engine).notifies

    def _notify_pullers(self, named: list[pullers.Named]) -> list[pullers.Named]:
        """The sender's divert of dispatch items (docs/dispatch.md: pulling): committed
        operations are notified to the workers that pull, their messages not sent; those
        no puller was told of, for messages."""
        try:
            # Once: if the database is away, the message is the cheaper way (the sender
            # waits for this).
            told = run_transaction(
                self.engine, lambda s: pullers.notify(s, named), attempts=1, direct=True
            )
        except Exception as exc:  # noqa: BLE001 - the messages carry them all
            log.warning("%d operations go by message: %s: %s", len(named), type(exc).__name__, exc)
            return named
        return [one for one in named if one[0] not in told]

    def set_goal(
        self, workspace_id, session_id, objective, *, client_submit_id, expected_revision=None
    ) -> GoalOperation:
        return self.goal_control(
            workspace_id,
            session_id,
            "set",
            objective,
            client_submit_id=client_submit_id,
            expected_revision=expected_revision,
        )

    def clear_goal(
        self, workspace_id, session_id, *, client_submit_id, expected_revision=None
    ) -> GoalOperation:
        return self.goal_control(
            workspace_id,
            session_id,
            "clear",
            client_submit_id=client_submit_id,
            expected_revision=expected_revision,
        )

    def pause_goal(
        self, workspace_id, session_id, *, client_submit_id, expected_revision=None
    ) -> GoalOperation:
        return self.goal_control(
            workspace_id,
            session_id,
            "pause",
            client_submit_id=client_submit_id,
            expected_revision=expected_revision,
        )

    def resume_goal(
        self, workspace_id, session_id, *, client_submit_id, expected_revision=None
    ) -> GoalOperation:
        return self.goal_control(
            workspace_id,
            session_id,
            "resume",
            client_submit_id=client_submit_id,
            expected_revision=expected_revision,
        )

    def find_goal_operation(
        self, workspace_id: str, session_id: str, client_submit_id: str
    ) -> GoalOperation | None:
        operation_id = ids.goal_operation_id(
            check_id("workspace_id", workspace_id),
            check_id("session_id", session_id),
            check_id("client_submit_id", client_submit_id),
        )
        return run_transaction(self.engine, lambda s: load_operation(s, operation_id))

    def get_goal_operation(
        self, operation_id: str, *, workspace_id: str | None = None
    ) -> GoalOperation:
        return self._load("goal", operation_id, workspace_id)

    def goal_state(self, workspace_id: str, session_id: str) -> GoalState:
        key = (check_id("workspace_id", workspace_id), check_id("session_id", session_id))

        def load(s):
            row = s.get(GoalStateRow, key)
            if row is None:
                raise NotFound(f"session {workspace_id}/{session_id} has no goal state")
            return records.from_row(GoalState, row)

        return run_transaction(self.engine, load)

    def list_goal_operations(self, workspace_id: str, session_id: str) -> list[GoalOperation]:
        check_id("workspace_id", workspace_id)
        check_id("session_id", session_id)
        return run_transaction(
            self.engine,
            lambda s: [
                records.from_row(GoalOperation, row)
                for row in s.execute(
                    select(GoalOperationRow)
                    .where(
                        GoalOperationRow.workspace_id == workspace_id,
                        GoalOperationRow.session_id == session_id,
                    )
                    .order_by(GoalOperationRow.goal_revision)
                ).scalars()
            ],
        )

    # -- fences ----------------------------------------------------------------------------
    def fence_goal_generation(
        self,
        workspace_id: str,
        session_id: str,
        target_operation_id: str,
        *,
        client_submit_id: str,
        reason: str = "",
    ) -> Fence:
        """Forbid one exact goal generation forever, and clear it if it is still current.
        The returned fence is accepted (durable); delivery to the agent follows."""
        request = FenceRequest.parse(
            workspace_id,
            session_id,
            target_operation_id,
            client_submit_id=client_submit_id,
            reason=reason,
        )

        def accept(s):
            row, created = submit_fence(s, request, utcnow())
            return Fence.from_row(row), created

        return self._accept(accept, FENCE_APPLY_TASK, lambda f: {"fence_id": f.fence_id})

    def get_fence(self, fence_id: str, *, workspace_id: str | None = None) -> Fence:
        return self._load("fence", fence_id, workspace_id)

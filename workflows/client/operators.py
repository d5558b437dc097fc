"""The client's operator calls (docs/operations.md): any operation by id, listing, retry, resolving
a maintenance run, pruning history."""

import time
from typing import Any

from ...models.base import utcnow
from ...models.db import run_transaction
from ..kinds.fence import FENCE_APPLY_TASK
from ..kinds.goal import DISPATCH_TASK
from ..kinds.maintenance import MaintenanceRun
from ..operators import actions, catalog, retention
from ..records import OperationSummary
from ..steps.wake import release_session
from ..validation import (
    MAX_WAIT_S,
    check_id,
    check_int,
    check_limit,
    check_seconds,
)
from .sessions import SessionCalls

# Batches one prune may run (beat's runs stop at their time budget long before).
MAX_PRUNE_BATCHES = 100_000


class OperatorCalls(SessionCalls):
    # -- operators (docs/operations.md) ----------------------------------------------------
    def get_operation(self, operation_id: str, *, workspace_id: str | None = None) -> Any:
        """The operation with this id, of any kind (its record has the kind's fields); with
        `workspace_id`, one of another workspace is NotFound."""
        check_id("operation_id", operation_id)
        if workspace_id is not None:
            check_id("workspace_id", workspace_id)
        return run_transaction(
            self.engine, lambda s: catalog.show(s, operation_id, workspace_id)[1]
        )

    def find_operations(
        self, workspace_id: str, session_id: str, client_submit_id: str
    ) -> list[Any]:
        """Every operation submitted under this client submit ID in the session, one per
        family that has one (IDs are scoped per family)."""
        check_id("workspace_id", workspace_id)
        check_id("session_id", session_id)
        check_id("client_submit_id", client_submit_id)
        return [
            record
            for _kind, record in run_transaction(
                self.engine,
                lambda s: catalog.find(s, workspace_id, session_id, client_submit_id),
            )
        ]

    def list_operations(
        self,
        *,
        kind: str | None = None,
        status: str | None = None,
        workspace_id: str | None = None,
        session_id: str | None = None,
        older_than_s: float | None = None,
        limit: int = 50,
        newer_than_s: float | None = None,
        newest_first: bool = False,
    ) -> list[OperationSummary]:
        """Operations of every kind (or one), oldest first (or `newest_first`), filtered by
        status (one some kind has: any other is InvalidArgument), workspace, session and age
        (accepted at least `older_than_s`, at most `newer_than_s` seconds ago)."""
        query = catalog.ListQuery.parse(
            kind=kind,
            status=status,
            workspace_id=workspace_id,
            session_id=session_id,
            older_than_s=older_than_s,
            limit=limit,
            newer_than_s=newer_than_s,
            newest_first=newest_first,
        )
        return run_transaction(self.engine, lambda s: catalog.list_operations(s, query, utcnow()))

    def retry_operation(
        self, operation_id: str, *, reason: str, workspace_id: str | None = None
    ) -> Any:
        """An operator retries a `failed` goal operation or fence: same id, a fresh budget;
        audited with the reason. Returns its record."""
        check_id("operation_id", operation_id)
        reason = actions.check_operator_reason(reason)
        if workspace_id is not None:
            check_id("workspace_id", workspace_id)
        done = run_transaction(
            self.engine,
            lambda s: actions.retry(s, operation_id, reason, utcnow(), workspace_id),
        )
        if done.kind == "fence":
            self.publisher.publish_after_commit(FENCE_APPLY_TASK, {"fence_id": operation_id})
        else:
            self.publisher.publish_after_commit(DISPATCH_TASK, {"operation_id": operation_id})
        return self.get_operation(operation_id)

    def resolve_maintenance(
        self, run_id: str, *, to: str, reason: str, workspace_id: str | None = None
    ) -> MaintenanceRun:
        """An operator ends a run in `recovery_required` as `failed` or `completed`; the
        session's held work goes on. Audited with the reason."""
        check_id("run_id", run_id)
        reason = actions.check_operator_reason(reason)
        if workspace_id is not None:
            check_id("workspace_id", workspace_id)
        done = run_transaction(
            self.engine,
            lambda s: actions.resolve(s, run_id, to, reason, utcnow(), workspace_id),
        )
        release_session(
            self.engine,
            self.publisher.publish_after_commit,
            done.workspace_id,
            done.session_id,
            utcnow(),
        )
        return self.get_maintenance(run_id)

    def prune(
        self,
        *,
        dry_run: bool = False,
        retention_days: float | None = None,
        batch: int = retention.BATCH,
        max_batches: int = 1,
        budget_s: float | None = None,
    ) -> dict:
        """Retention (docs/operations.md): delete settled operations and events older than the
        window, up to `max_batches` batches of `batch` rows of each kind, each batch its own
        transaction, and none begun once `budget_s` seconds have passed. A dry run counts one batch
        and deletes nothing."""
        days = retention.check_retention_days(
            self.settings.retention_days if retention_days is None else retention_days
        )
        check_limit(batch)
        check_int("max_batches", max_batches, minimum=1, maximum=MAX_PRUNE_BATCHES)
        if budget_s is not None:
            budget_s = check_seconds("budget_s", budget_s, maximum=MAX_WAIT_S)
        totals: dict[str, int] = {}
        cutoff = None
        started = time.monotonic()
        for _ in range(1 if dry_run else max_batches):
            result = run_transaction(
                self.engine,
                lambda s: retention.prune_batch(s, utcnow(), days, batch, dry_run),
            )
            cutoff = result.cutoff
            for name, count in result.rows.items():
                totals[name] = totals.get(name, 0) + count
            if max(result.rows.values(), default=0) < batch:
                break  # nothing more of any kind
            if budget_s is not None and time.monotonic() - started >= budget_s:
                break  # the next run goes on
        return {
            "cutoff": cutoff.isoformat() if cutoff else None,
            "dry_run": dry_run,
            "rows": totals,
        }

"""The Python client (DESIGN 7.1): `from workflows.client import AgentRadar`."""

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from sqlalchemy import select

from models.base import utcnow
from models.db import engine_for, run_transaction
from models.tables import GoalFence as GoalFenceRow
from models.tables import GoalOperation as GoalOperationRow
from models.tables import GoalState as GoalStateRow
from models.tables import MaintenanceRun as MaintenanceRunRow
from models.tables import Prompt as PromptRow
from models.tables import SessionStop as SessionStopRow
from workflows import ids, records
from workflows.adapters.broker import FLUSH_TIMEOUT_S, TaskPublisher
from workflows.adapters.config import Settings
from workflows.adapters.runtime import HostRouter, RuntimePort
from workflows.errors import InvalidArgument, NotFound
from workflows.fences.restore import restore_fences
from workflows.fences.submit import FenceRequest, submit_fence
from workflows.goals.submit import GoalRequest, load_operation, submit
from workflows.maintenance import runs
from workflows.operators import actions, catalog, retention
from workflows.records import (
    Fence,
    GoalOperation,
    GoalState,
    HistoryRow,
    Host,
    MaintenanceRun,
    OperationSummary,
    SessionInfo,
)
from workflows.records import Prompt as PromptRecord
from workflows.records import SessionStop as SessionStopRecord
from workflows.sessions import hosts, prompts, stops
from workflows.sessions.activity import apply_report, parse_report
from workflows.sessions.control import durable_fences, load_session, record_live, resume_if_offline
from workflows.sessions.epochs import EpochEffects, bind_host
from workflows.sessions.history import session_history
from workflows.sessions.prompts import PromptRequest
from workflows.sessions.release import publish_epoch_effects, release_session
from workflows.task_names import (
    CANCEL_APPLY_TASK,
    DISPATCH_TASK,
    EXECUTE_TASK,
    FENCE_APPLY_TASK,
    PROMPT_TASK,
    RESTORE_TASK,
)
from workflows.validation import MAX_WAIT_S, check_id, check_limit, check_seconds, check_url

# How often `wait` looks at the database; the database is the source of truth.
WAIT_POLL_S = 0.05
# The longest `flush` may be asked to wait.
MAX_FLUSH_S = 3600.0


def _label(record: Any) -> str:
    """What an operator knows a message by: workspace/session and the client submit ID."""
    submit = getattr(record, "client_submit_id", None)
    return f"{record.workspace_id}/{record.session_id}" + (f" submit={submit}" if submit else "")


class AgentRadar:
    def __init__(
        self,
        database_url: str | None = None,
        broker_url: str | None = None,
        *,
        settings: Settings | None = None,
        runtime: RuntimePort | None = None,
        publisher: TaskPublisher | None = None,
    ) -> None:
        base = settings or Settings.from_env()
        self.settings = replace(
            base,
            database_url=database_url or base.database_url,
            broker_url=broker_url or base.broker_url,
        )
        if self.settings.database_url.startswith("sqlite"):
            self.settings.home.mkdir(parents=True, exist_ok=True)
        self.engine = engine_for(self.settings.database_url)
        self.publisher = publisher or TaskPublisher(self.settings)
        self.runtime = runtime or HostRouter(
            self.settings.runtime_url,
            hosts.locator(self.engine),
            self.settings.runtime_token,
            self.settings.runtime_timeout_s,
            self.settings.host_concurrency,
        )

    @classmethod
    def from_env(cls) -> "AgentRadar":
        return cls()

    def _accept(self, work, task: str, message, coalesce_into: str | None = None) -> Any:
        """Commit an intent (`work(session) -> (record, created)`), then publish its task.
        A replay publishes nothing; a failed publish is left to the sweeper (the row is
        the outbox). With `coalesce_into`, `message(record)` is one item of that list
        argument, handed to the publisher's sender thread, which shares a message among the
        submits of this process; the call returns after the commit (`flush` waits for the
        message, and `close` or the end of the process publishes what is left)."""
        if coalesce_into:
            with self.publisher.coalescing(task, coalesce_into) as publish:
                record, created = run_transaction(self.engine, work, direct=True)
                if created:
                    publish(message(record), _label(record))
            return record
        record, created = run_transaction(self.engine, work)
        if created:
            self.publisher.publish_after_commit(task, message(record), _label(record))
        return record

    def _load(
        self,
        row_type,
        record_type,
        key,
        what: str,
        workspace_id: str | None = None,
        build: Callable[[Any, Any], Any] | None = None,
        **error_attrs,
    ) -> Any:
        """Load a record by id. With `workspace_id` (DESIGN 4.10), a record of another
        workspace is NotFound, exactly as a missing one. `build(session, row)` makes a record
        that needs more than its row."""
        if workspace_id is not None:
            check_id("workspace_id", workspace_id)

        def load(s):
            row = s.get(row_type, key)
            if row is None or workspace_id is not None and row.workspace_id != workspace_id:
                raise NotFound(f"no {what} {key}", **error_attrs)
            if build is not None:
                return build(s, row)
            return records.record_of(record_type, row)

        return run_transaction(self.engine, load)

    def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
        """Wait until the messages of this process's goal submits are at the broker (a goal
        submit returns once its intent is committed); False if some still wait after
        `timeout_s`: the sweeper publishes those."""
        return self.publisher.flush(check_seconds("timeout_s", timeout_s, maximum=MAX_FLUSH_S))

    def close(self) -> None:
        self.publisher.close()

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
            lambda op: op.operation_id,
            coalesce_into="operation_ids",
        )

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
        return self._load(
            GoalOperationRow,
            GoalOperation,
            check_id("operation_id", operation_id),
            "goal operation",
            workspace_id,
            operation_id=operation_id,
        )

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
        return self._load(
            GoalFenceRow,
            Fence,
            check_id("fence_id", fence_id),
            "fence",
            workspace_id,
            fence_id=fence_id,
        )

    # -- prompts ---------------------------------------------------------------------------
    def submit_prompt(
        self, workspace_id: str, session_id: str, text: str, *, client_submit_id: str
    ) -> PromptRecord:
        request = PromptRequest.parse(
            workspace_id, session_id, text, client_submit_id=client_submit_id
        )

        def queue(s):
            row, created = prompts.submit(s, request, utcnow())
            return records.from_row(PromptRecord, row), created

        return self._accept(
            queue,
            PROMPT_TASK,
            lambda p: {"workspace_id": p.workspace_id, "session_id": p.session_id},
        )

    def get_prompt(self, prompt_id: str, *, workspace_id: str | None = None) -> PromptRecord:
        return self._load(
            PromptRow,
            PromptRecord,
            check_id("prompt_id", prompt_id),
            "prompt",
            workspace_id,
            prompt_id=prompt_id,
        )

    def drain_session(
        self, workspace_id: str, session_id: str, *, reason: str = "drained"
    ) -> SessionInfo:
        """Stop admitting maintenance on this session (RuntimeDraining from now on); an
        operator action, audited in the session's events with its reason (DESIGN 4.10)."""
        return self._set_admission(workspace_id, session_id, "draining", reason)

    def undrain_session(self, workspace_id: str, session_id: str, *, reason: str) -> SessionInfo:
        """Admit maintenance on this session again; audited with its reason."""
        return self._set_admission(workspace_id, session_id, "open", reason)

    def _set_admission(
        self, workspace_id: str, session_id: str, admission: str, reason: str
    ) -> SessionInfo:
        check_id("workspace_id", workspace_id)
        check_id("session_id", session_id)
        reason = actions.check_operator_reason(reason)
        run_transaction(
            self.engine,
            lambda s: actions.set_admission(
                s, workspace_id, session_id, admission, reason, utcnow()
            ),
        )
        return self.session_info(workspace_id, session_id)

    # -- maintenance -----------------------------------------------------------------------
    def start_maintenance(
        self,
        workspace_id: str,
        session_id: str,
        kind: str = "compact",
        *,
        client_submit_id: str,
        args: dict | None = None,
        expected_runtime_epoch: int | None = None,
    ) -> MaintenanceRun:
        """Admit an exclusive maintenance run; its first record is durable on return. With
        `expected_runtime_epoch`, a session whose agent host has moved to a newer epoch
        since is draining for this caller (RuntimeDraining, nothing written)."""
        request = runs.MaintenanceRequest.parse(
            workspace_id,
            session_id,
            kind,
            client_submit_id=client_submit_id,
            args=args,
            expected_runtime_epoch=expected_runtime_epoch,
        )

        def admit(s):
            row, created = runs.start(s, request, utcnow())
            return records.from_row(MaintenanceRun, row), created

        return self._accept(admit, EXECUTE_TASK, lambda run: {"run_id": run.run_id})

    def cancel_maintenance(self, run_id: str, *, workspace_id: str | None = None) -> MaintenanceRun:
        check_id("run_id", run_id)
        if workspace_id is not None:
            check_id("workspace_id", workspace_id)

        def cancel(s):
            row = runs.request_cancel(s, run_id, utcnow(), workspace_id)
            if row is None:
                raise NotFound(f"no maintenance run {run_id}", run_id=run_id)
            return records.from_row(MaintenanceRun, row)

        return run_transaction(self.engine, cancel)

    def get_maintenance(self, run_id: str, *, workspace_id: str | None = None) -> MaintenanceRun:
        return self._load(
            MaintenanceRunRow,
            MaintenanceRun,
            check_id("run_id", run_id),
            "maintenance run",
            workspace_id,
            run_id=run_id,
        )

    def history(self, workspace_id: str, session_id: str, limit: int = 50) -> list[HistoryRow]:
        check_id("workspace_id", workspace_id)
        check_id("session_id", session_id)
        limit = check_limit(limit)
        return run_transaction(
            self.engine, lambda s: session_history(s, workspace_id, session_id, limit)
        )

    # -- sessions --------------------------------------------------------------------------
    def ensure_session(
        self, workspace_id: str, session_id: str, *, host_id: str | None = None
    ) -> SessionInfo:
        """User-triggered: resume an offline session with every durable fence preloaded,
        then wake its prepared goal operations. A live session whose host moved to a newer
        runtime epoch gets its fences installed there again; at the same epoch nothing is
        reinstalled (DESIGN 4.9). With `host_id` (a registered host), the session is bound
        to that host first; another host than its own is a move, a new epoch there."""
        check_id("workspace_id", workspace_id)
        check_id("session_id", session_id)
        if host_id is not None:
            hosts.check_host_id(host_id)
            moved = run_transaction(
                self.engine,
                lambda s: bind_host(s, workspace_id, session_id, host_id, utcnow()),
            )
            self._publish_epoch(workspace_id, session_id, moved)
        fences = run_transaction(self.engine, lambda s: durable_fences(s, workspace_id, session_id))
        resumed, epoch = resume_if_offline(
            self.runtime, workspace_id, session_id, [fence for _id, fence in fences]
        )
        installed = [fence_id for fence_id, _fence in fences] if resumed else []
        wake, effects = run_transaction(
            self.engine,
            lambda s: record_live(s, workspace_id, session_id, epoch, utcnow(), installed),
        )
        self._publish_epoch(workspace_id, session_id, effects)
        # Whatever fence is not known to be at this (host, epoch) goes there, and a clear
        # settled locally is delivered: the user's own call, so require_live false.
        restore_fences(self.engine, self.runtime, workspace_id, session_id, require_live=False)
        for operation_id in wake:
            self.publisher.publish_after_commit(DISPATCH_TASK, {"operation_id": operation_id})
        return self.session_info(workspace_id, session_id)

    def _publish_epoch(self, workspace_id: str, session_id: str, effects: EpochEffects) -> None:
        publish_epoch_effects(
            self.engine,
            self.publisher.publish_after_commit,
            workspace_id,
            session_id,
            effects,
            utcnow(),
        )

    def stop_session(
        self, workspace_id: str, session_id: str, *, client_submit_id: str, reason: str = ""
    ) -> SessionStopRecord:
        """Cancel the session's running turn (a durable cancel) and its active maintenance run,
        in one idempotent operation; queued prompts and goal operations stay queued. The
        record settles when both have ended (DESIGN 4.9)."""
        request = stops.StopRequest.parse(
            workspace_id, session_id, client_submit_id=client_submit_id, reason=reason
        )

        def accept(s):
            row, created = stops.stop(s, request, utcnow())
            return stops.record(s, row), created

        record, created = run_transaction(self.engine, accept)
        if created and record.cancel_operation_id is not None:
            self.publisher.publish_after_commit(
                CANCEL_APPLY_TASK, {"operation_id": record.cancel_operation_id}
            )
        return record

    def get_session_stop(
        self, stop_id: str, *, workspace_id: str | None = None
    ) -> SessionStopRecord:
        return self._load(
            SessionStopRow,
            SessionStopRecord,
            check_id("stop_id", stop_id),
            "session stop",
            workspace_id,
            build=stops.record,
            stop_id=stop_id,
        )

    # -- operators (DESIGN 4.10) -------------------------------------------------------------
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
    ) -> list[OperationSummary]:
        """Operations of every kind (or one), oldest first, filtered by status, workspace,
        session and age (accepted at least `older_than_s` seconds ago)."""
        query = catalog.ListQuery.parse(kind, status, workspace_id, session_id, older_than_s, limit)
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
    ) -> dict:
        """Retention (DESIGN 4.10): delete settled operations and events older than the
        window, up to `max_batches` batches of `batch` rows of each kind, each batch its own
        transaction. A dry run counts one batch and deletes nothing."""
        days = retention.check_retention_days(
            self.settings.retention_days if retention_days is None else retention_days
        )
        check_limit(batch)
        totals: dict[str, int] = {}
        cutoff = None
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
        return {
            "cutoff": cutoff.isoformat() if cutoff else None,
            "dry_run": dry_run,
            "rows": totals,
        }

    # -- agent hosts (DESIGN 4.9) ------------------------------------------------------------
    def add_host(
        self, host_id: str, url: str, *, replace: bool = False, token: str | None = None
    ) -> Host:
        """Register an agent host, with the bearer token that host alone accepts (calls to
        it carry that one, never another host's). The same URL and token again change
        nothing; others are a Conflict unless `replace`. The host `default` is
        AGENT_RADAR_RUNTIME_URL, with AGENT_RADAR_RUNTIME_TOKEN."""
        host_id = hosts.check_host_id(host_id, allow_default=False)
        url = check_url(url)
        if token is not None:
            check_id("token", token)
            if any(c.isspace() for c in token):
                raise InvalidArgument("token must not contain spaces", field="token")
        return run_transaction(
            self.engine, lambda s: hosts.add_host(s, host_id, url, utcnow(), replace, token)
        )

    def remove_host(self, host_id: str) -> Host:
        """Unregister an agent host that no session is bound to."""
        host_id = hosts.check_host_id(host_id, allow_default=False)
        return run_transaction(self.engine, lambda s: hosts.remove_host(s, host_id))

    def list_hosts(self) -> list[Host]:
        """Every host, `default` first, with the number of sessions bound to each."""
        return run_transaction(
            self.engine, lambda s: hosts.list_hosts(s, self.settings.runtime_url)
        )

    def session_info(self, workspace_id: str, session_id: str) -> SessionInfo:
        check_id("workspace_id", workspace_id)
        check_id("session_id", session_id)

        def load(s):
            row = load_session(s, workspace_id, session_id)
            if row is None:
                raise NotFound(f"unknown session {workspace_id}/{session_id}")
            return records.from_row(SessionInfo, row)

        return run_transaction(self.engine, load)

    def report_activity(self, report: dict[str, Any]) -> list[str]:
        """Apply an agent host's report; returns the goal operations it completed."""
        parsed = parse_report(report, utcnow())
        effects = run_transaction(self.engine, lambda s: apply_report(s, parsed, utcnow()))
        for fence_id in effects.wake_fences:
            self.publisher.publish_after_commit(FENCE_APPLY_TASK, {"fence_id": fence_id})
        for operation_id in effects.cancels:
            self.publisher.publish_after_commit(CANCEL_APPLY_TASK, {"operation_id": operation_id})
        if effects.restore:
            self.publisher.publish_after_commit(
                RESTORE_TASK, {"workspace_id": parsed.workspace_id, "session_id": parsed.session_id}
            )
        if effects.epoch.released:
            self._publish_epoch(parsed.workspace_id, parsed.session_id, EpochEffects(released=True))
        if effects.wake_prompts:
            self.publisher.publish_after_commit(
                PROMPT_TASK, {"workspace_id": parsed.workspace_id, "session_id": parsed.session_id}
            )
        return effects.completed

    # -- waiting ---------------------------------------------------------------------------
    def wait(self, record: Any, timeout: float = 30.0) -> Any:
        """Poll until the record reaches a terminal status; TimeoutError after `timeout`
        seconds (0 to MAX_WAIT_S) otherwise."""
        timeout = check_seconds("timeout", timeout, maximum=MAX_WAIT_S)
        reload: Callable[[], Any]
        if isinstance(record, GoalOperation):
            reload, name = (
                lambda: self.get_goal_operation(record.operation_id),
                f"goal operation {record.operation_id}",
            )
        elif isinstance(record, Fence):
            reload, name = lambda: self.get_fence(record.fence_id), f"fence {record.fence_id}"
        elif isinstance(record, MaintenanceRun):
            reload, name = (
                lambda: self.get_maintenance(record.run_id),
                f"maintenance run {record.run_id}",
            )
        elif isinstance(record, SessionStopRecord):
            reload, name = (
                lambda: self.get_session_stop(record.stop_id),
                f"session stop {record.stop_id}",
            )
        else:
            raise InvalidArgument(f"cannot wait on {type(record).__name__}")
        deadline = time.monotonic() + timeout
        while True:
            current = reload()
            if current.settled:
                return current
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{name} is still {current.status} after {timeout} s")
            time.sleep(WAIT_POLL_S)

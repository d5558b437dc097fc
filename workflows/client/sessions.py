"""The client's sessions: prompts, maintenance, admission, resume and stop, history, agent
hosts and activity reports (docs/lifecycles.md; docs/packaging.md)."""

from typing import Any

from ...models.base import utcnow
from ...models.db import run_read, run_transaction
from .. import records
from ..activity import stops
from ..activity.activity import apply_report, parse_report
from ..activity.control import durable_fences, load_session, record_live
from ..activity.epochs import EpochEffects, bind_host
from ..adapters import metrics, report_auth
from ..errors import AgentRadarError, InvalidArgument, NotFound
from ..fences.moves import stops_due_at
from ..kinds import stop
from ..kinds.cancel import CANCEL_APPLY_TASK
from ..kinds.fence import FENCE_APPLY_TASK
from ..kinds.goal import DISPATCH_TASK
from ..kinds.maintenance import EXECUTE_TASK, MaintenanceRun
from ..kinds.prompt import Prompt as PromptRecord
from ..kinds.stop import SessionStop as SessionStopRecord
from ..maintenance import runs
from ..operators import actions
from ..prompts import queue as prompts
from ..prompts.queue import PromptRequest
from ..records import HistoryRow, Host, SessionInfo
from ..sessions import hosts
from ..sessions.history import session_history
from ..sessions.rows import Heard
from ..steps import pin
from ..steps.cancel import CancelRunner
from ..steps.fence_install import resume_if_offline
from ..steps.restore import restore_fences
from ..steps.wake import publish_epoch_effects
from ..task_names import PROMPT_TASK, RESTORE_TASK
from ..validation import check_id, check_limit, check_url
from .base import ClientBase


class SessionCalls(ClientBase):
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
        return self._load("prompt", prompt_id, workspace_id)

    def drain_session(
        self, workspace_id: str, session_id: str, *, reason: str = "drained"
    ) -> SessionInfo:
        """Stop admitting maintenance on this session (RuntimeDraining from now on); an
        operator action, audited in the session's events with its reason (docs/operations.md)."""
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
        return self._load("maintenance", run_id, workspace_id)

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
        """User-triggered: resume an offline session with every durable fence preloaded, then wake
        its prepared goal operations. A live session whose host moved to a newer runtime epoch gets
        its fences installed there again; at the same epoch nothing is reinstalled
        (docs/lifecycles.md: sessions). With `host_id` (a registered host), the session is bound to
        that host first; another host than its own is a move, a new epoch there."""
        check_id("workspace_id", workspace_id)
        check_id("session_id", session_id)
        if host_id is not None:
            hosts.check_host_id(host_id)
            self._deliver_stops_owed(workspace_id, session_id, host_id)
            moved = run_transaction(
                self.engine,
                lambda s: bind_host(s, workspace_id, session_id, host_id, utcnow()),
            )
            self._publish_epoch(workspace_id, session_id, moved)
        fences = run_transaction(self.engine, lambda s: durable_fences(s, workspace_id, session_id))
        # Asked by name: a move meanwhile leaves the answer unrecorded (control.record_live).
        there = pin(self.engine, self.runtime, workspace_id, session_id)
        asked_at = utcnow()
        resumed, epoch = resume_if_offline(
            there.port, workspace_id, session_id, [fence for _id, fence in fences]
        )
        if resumed:
            # Live from when the resume answered: an offline answer asked during it is older.
            asked_at = utcnow()
        installed = [fence_id for fence_id, _fence in fences] if resumed else []
        heard = Heard(asked_at, there.host_id)
        wake, effects = run_transaction(
            self.engine,
            lambda s: record_live(s, workspace_id, session_id, epoch, utcnow(), installed, heard),
        )
        self._publish_epoch(workspace_id, session_id, effects)
        # Whatever fence is not known to be at this (host, epoch) goes there, and a clear
        # settled locally is delivered: the user's own call, so require_live false.
        restore_fences(
            self.engine,
            self.runtime,
            workspace_id,
            session_id,
            require_live=False,
            lease_s=self.settings.lease_s,
        )
        for operation_id in wake:
            self.publisher.publish_after_commit(DISPATCH_TASK, {"operation_id": operation_id})
        return self.session_info(workspace_id, session_id)

    def _deliver_stops_owed(self, workspace_id: str, session_id: str, host_id: str) -> None:
        """Before a move back to `host_id`, the stops an earlier move owes it go there now (a
        session live there again at the same epoch still runs what they stop). One that finds
        the session offline there waits, and the move resumes it: a new epoch. One that fails
        stays owed, and bind_host refuses the move until it is delivered."""
        now = utcnow()
        owed = run_read(
            self.engine, lambda s: stops_due_at(s, workspace_id, session_id, host_id, now)
        )
        if owed:
            runner = CancelRunner(
                self.engine,
                self.runtime,
                worker_id="client",
                lease_s=self.settings.lease_s,
                publish=self.publisher.publish_after_commit,
            )
            for cancel_id in owed:
                runner.apply(cancel_id)

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
        record settles when both have ended (docs/lifecycles.md: sessions)."""
        request = stops.StopRequest.parse(
            workspace_id, session_id, client_submit_id=client_submit_id, reason=reason
        )

        def accept(s):
            row, created = stops.stop(s, request, utcnow())
            return stop.read(s, row), created

        record, created = run_transaction(self.engine, accept)
        if created and record.cancel_operation_id is not None:
            self.publisher.publish_after_commit(
                CANCEL_APPLY_TASK, {"operation_id": record.cancel_operation_id}
            )
        return record

    def get_session_stop(
        self, stop_id: str, *, workspace_id: str | None = None
    ) -> SessionStopRecord:
        return self._load("stop", stop_id, workspace_id)

    # -- agent hosts (docs/lifecycles.md: sessions) ----------------------------------------
    def add_host(
        self, host_id: str, url: str, *, replace: bool = False, token: str | None = None
    ) -> Host:
        """Register an agent host, with the bearer token that host alone accepts (calls to
        it carry that one, never another host's). The same URL and token again change
        nothing; others are a Conflict unless `replace`. The host `default` is
        AGENT_RADAR_RUNTIME_URL, with AGENT_RADAR_RUNTIME_TOKEN."""
        host_id = hosts.check_host_id(host_id, allow_default=False, new=True)
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

    def report_activity(self, report: dict[str, Any]) -> bool:
        """Report as an agent host's own Python process would: the report is signed with the
        token of the host it names (`signed_by`, or `session.host_id`), else of the session's
        host, read as the worker reads it, then received (`receive_report`). A host registered
        without a token takes it unsigned (development only). True when it asked the host to
        be asked what it runs (docs/lifecycles.md: reconcile)."""
        parsed = parse_report(report, utcnow())  # checked before it is signed
        if "signature" not in report:
            report = run_read(self.engine, lambda s: self._signed(s, parsed, report))
        return self.receive_report(report)

    def _signed(self, s, parsed, report: dict[str, Any]) -> dict[str, Any]:
        host_id = (
            parsed.signed_by
            or (parsed.session or {}).get("host_id")
            or hosts.session_host(s, parsed.workspace_id, parsed.session_id)
        )
        token = hosts.token_of(s, host_id, self.settings.runtime_token)
        return report if token is None else report_auth.sign(report, host_id, token)

    def _refused_from(self, report: Any) -> str:
        """The refused report's host, as its metric's label (hosts.named_by_report)."""
        try:
            return run_read(self.engine, lambda s: hosts.named_by_report(s, report))
        except Exception:  # noqa: BLE001 - the database is away: the refusal still counts
            return hosts.UNREGISTERED

    def receive_report(self, report: Any) -> bool:
        """Apply a report as `agent_radar.report_activity` receives it from a host: refused
        (InvalidArgument, nothing written) unless it is signed by the session's host
        (docs/protocol.md: reports). True when it asked for the host's state."""
        try:
            parsed = parse_report(report, utcnow())
            effects = run_transaction(
                self.engine,
                lambda s: apply_report(s, parsed, utcnow(), self.settings.runtime_token),
            )
        except AgentRadarError as exc:
            host = self._refused_from(report)
            metrics.REPORTS_REFUSED.labels(host, exc.code).inc()
            self.refusals.add(self.engine, host, exc.code, utcnow())  # for `status`
            raise
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
        return effects.restore

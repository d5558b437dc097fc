"""Maintenance runs (docs/lifecycles.md: maintenance): admission, the state machine and its records.

Every accepted status change is one guarded UPDATE (expected status and revision, and the
holder's lease token where a worker writes) that bumps `revision` and appends exactly one
optional diagnostic record to the session's events.
"""

import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import exists, select, update
from sqlalchemy.orm import Session

from ...models.db import rowcount
from ...models.operations import MaintenanceRun
from .. import accept, ids
from ..errors import (
    InvalidArgument,
    MaintenanceBusy,
    MaintenanceConflict,
    MaintenanceRecoveryRequired,
    RuntimeDraining,
    SessionBusy,
)
from ..kinds.maintenance import (
    LIVE_MAINTENANCE_STATUSES,
    TERMINAL_MAINTENANCE_STATUSES,
    MaintenanceError,
    MaintenanceStatus,
)
from ..sessions.rows import append_event, lock_session, may_reach_the_host
from ..validation import (
    check_choice,
    check_id,
    check_int,
    check_optional_int,
    check_submit_id,
    check_text,
)

log = logging.getLogger(__name__)

S = MaintenanceStatus
TERMINAL = frozenset(TERMINAL_MAINTENANCE_STATUSES)
# The one table of allowed transitions. `running` only as the first record; `cancelling`
# only from running; recovery from any live status; finalizing and terminal statuses from
# running, cancelling or recovery (and terminal from finalizing); nothing after terminal.
ALLOWED: dict[str | None, frozenset] = {
    None: frozenset({S.RUNNING}),
    S.RUNNING: frozenset({S.CANCELLING, S.RECOVERY_REQUIRED, S.FINALIZING}) | TERMINAL,
    S.CANCELLING: frozenset({S.RECOVERY_REQUIRED, S.FINALIZING}) | TERMINAL,
    S.RECOVERY_REQUIRED: frozenset({S.FINALIZING}) | TERMINAL,
    S.FINALIZING: frozenset({S.RECOVERY_REQUIRED}) | TERMINAL,
}
KINDS = {"compact": False, "summarize_up_to": True, "summarize_from": True}  # needs {"turn"}
RECORD_TYPE = "session-maintenance-v1"
RECORD_FIELDS = (
    "run_id",
    "kind",
    "args",
    "status",
    "error_code",
    "detail",
    "revision",
    "runtime_epoch",
    "applied",
    "input_tokens",
    "result_tokens",
    "summary",
)


@dataclass(frozen=True)
class MaintenanceRequest:
    workspace_id: str
    session_id: str
    kind: str
    client_submit_id: str
    args: dict[str, Any] | None
    # The runtime epoch the caller saw; a session at a newer one is draining for it.
    expected_runtime_epoch: int | None = None

    @classmethod
    def parse(
        cls,
        workspace_id: Any,
        session_id: Any,
        kind: Any,
        *,
        client_submit_id: Any,
        args: Any = None,
        expected_runtime_epoch: Any = None,
    ) -> "MaintenanceRequest":
        kind = check_choice("kind", kind, KINDS)
        if KINDS[kind]:
            if not isinstance(args, dict) or set(args) != {"turn"}:
                raise InvalidArgument(f'{kind} takes args {{"turn": N}}', field="args")
            check_int("args.turn", args["turn"], minimum=1)
        elif args not in (None, {}):
            raise InvalidArgument(f"{kind} takes no args", field="args")
        return cls(
            check_id("workspace_id", workspace_id),
            check_id("session_id", session_id),
            kind,
            check_submit_id("client_submit_id", client_submit_id),
            dict(args) if KINDS[kind] else None,
            check_optional_int("expected_runtime_epoch", expected_runtime_epoch),
        )

    @property
    def run_id(self) -> str:
        return ids.maintenance_run_id(self.workspace_id, self.session_id, self.client_submit_id)


def _live(workspace_id, session_id) -> tuple:
    """SQL conditions: a run of this session that is not terminal (recovery included)."""
    return (
        MaintenanceRun.workspace_id == workspace_id,
        MaintenanceRun.session_id == session_id,
        MaintenanceRun.status.in_(LIVE_MAINTENANCE_STATUSES),
    )


def live_run(session: Session, workspace_id: str, session_id: str) -> MaintenanceRun | None:
    return session.execute(
        select(MaintenanceRun).where(*_live(workspace_id, session_id)).limit(1)
    ).scalar_one_or_none()


def holds(workspace_id, session_id):
    """SQL condition: a live run holds the session (docs/lifecycles.md: prompts). The ids are values
    or columns of an enclosing query."""
    return exists().where(*_live(workspace_id, session_id))


def session_held(session: Session, workspace_id: str, session_id: str) -> bool:
    return session.execute(select(holds(workspace_id, session_id))).scalar_one()


def _record(session: Session, run: MaintenanceRun, now: datetime) -> None:
    lock_session(session, run.workspace_id, run.session_id)
    append_event(
        session,
        run.workspace_id,
        run.session_id,
        kind="diagnostic",
        record_id=f"maintenance:{run.run_id}",
        idempotency_key=f"session-maintenance:{run.run_id}:{run.revision}",
        revision=run.revision,
        optional=True,
        now=now,
        payload={"type": RECORD_TYPE, "record": {f: getattr(run, f) for f in RECORD_FIELDS}},
    )


def start(
    session: Session, request: MaintenanceRequest, now: datetime
) -> tuple[MaintenanceRun, bool]:
    """Admission (one transaction, session row locked). Returns (run, created)."""
    row = lock_session(session, request.workspace_id, request.session_id)
    existing = accept.find_replay(
        session,
        MaintenanceRun,
        request.run_id,
        (request.kind, request.args),
        lambda r: (r.kind, r.args),
        lambda r: MaintenanceConflict(
            f"client_submit_id {request.client_submit_id!r} was used for {r.kind} {r.args}",
            run_id=r.run_id,
        ),
    )
    if existing is not None:
        return existing, False
    if row.admission == "draining":
        raise RuntimeDraining(f"session {request.workspace_id}/{request.session_id} is draining")
    epoch = row.runtime_epoch or 0
    if request.expected_runtime_epoch is not None and epoch > request.expected_runtime_epoch:
        # The agent host restarted since the caller looked: what it meant to compact is gone.
        raise RuntimeDraining(
            f"session {request.workspace_id}/{request.session_id} is at runtime epoch {epoch}, "
            f"newer than the expected {request.expected_runtime_epoch}",
            runtime_epoch=epoch,
            expected_runtime_epoch=request.expected_runtime_epoch,
        )
    current = live_run(session, request.workspace_id, request.session_id)
    if current is not None:
        if current.status == S.RECOVERY_REQUIRED:
            raise MaintenanceRecoveryRequired(
                f"run {current.run_id} needs recovery first", run_id=current.run_id
            )
        raise MaintenanceBusy(f"run {current.run_id} is {current.status}", run_id=current.run_id)
    if row.active_turn_id is not None:
        raise SessionBusy(
            f"cannot {request.kind} while a turn is running", turn_id=row.active_turn_id
        )
    busy = may_reach_the_host(session, request.workspace_id, request.session_id, now)
    if busy is not None:
        raise SessionBusy(f"cannot {request.kind} while {busy[0]}", **busy[1])
    run = MaintenanceRun(
        run_id=request.run_id,
        workspace_id=request.workspace_id,
        session_id=request.session_id,
        client_submit_id=request.client_submit_id,
        kind=request.kind,
        args=request.args,
        status=S.RUNNING,
        revision=1,
        runtime_epoch=row.runtime_epoch or 0,
        started_at=now,
    )
    session.add(run)
    session.flush()
    _record(session, run, now)
    return run, True


# Transitions an operator wants to hear of (recovery, and ends that are not a success).
WARN_ON = frozenset({S.RECOVERY_REQUIRED, S.FAILED, S.INTERRUPTED, S.PARTIALLY_COMPLETED})


def transition(
    session: Session,
    run: MaintenanceRun,
    to: MaintenanceStatus,
    now: datetime,
    token: str | None = None,
    **fields: Any,
) -> bool:
    """One guarded status change and its record; False if the row moved meanwhile."""
    if to not in ALLOWED.get(run.status, frozenset()):
        return False
    was = run.status  # the update's fetch refreshes `run`
    conditions = [
        MaintenanceRun.run_id == run.run_id,
        MaintenanceRun.status == was,
        MaintenanceRun.revision == run.revision,
    ]
    if token is not None:
        conditions.append(MaintenanceRun.lease_token == token)
    values = dict(fields, status=to, revision=run.revision + 1)
    if to in TERMINAL:
        values.update(finished_at=now, lease_owner=None, lease_token=None, lease_expires_at=None)
    result = session.execute(
        update(MaintenanceRun)
        .where(*conditions)
        .values(**values)
        .execution_options(synchronize_session="fetch")
    )
    if rowcount(result) != 1:
        return False
    _record(session, reload(session, run.run_id), now)
    if to in WARN_ON:
        log.warning(
            "maintenance run %s: %s -> %s (%s): %s",
            run.run_id,
            was,
            to,
            fields.get("error_code"),
            fields.get("detail"),
            extra={
                "workspace_id": run.workspace_id,
                "session_id": run.session_id,
                "run_id": run.run_id,
            },
        )
    return True


def reload(session: Session, run_id: str) -> MaintenanceRun:
    """A run row as the database has it now; runs are never deleted while referenced."""
    run = session.get(MaintenanceRun, run_id, populate_existing=True)
    if run is None:
        raise LookupError(f"maintenance run {run_id} disappeared")
    return run


def end_for_restart(
    session: Session,
    workspace_id: str,
    session_id: str,
    epoch: int | None,
    now: datetime,
    moved_to: str | None = None,
) -> MaintenanceRun | None:
    """The session's host reported a newer runtime epoch (or, with `moved_to`, the session moved to
    another host): a live run of an older one is gone with the process that ran it and ends
    `interrupted` (runtime_restarted), releasing the session (docs/lifecycles.md: maintenance,
    sessions). The run that ended, if one did."""
    run = live_run(session, workspace_id, session_id)
    if run is None or (moved_to is None and (run.runtime_epoch or 0) >= (epoch or 0)):
        return None
    detail = (
        f"the session moved to host {moved_to!r}"
        if moved_to is not None
        else f"the agent host restarted (runtime epoch {run.runtime_epoch} -> {epoch})"
    )
    ended = transition(
        session,
        run,
        S.INTERRUPTED,
        now,
        error_code=MaintenanceError.RUNTIME_RESTARTED,
        detail=detail,
    )
    return run if ended else None


def request_cancel(
    session: Session, run_id: str, now: datetime, workspace_id: str | None = None
) -> MaintenanceRun | None:
    """`cancel_maintenance`: running → cancelling; anything else is left unchanged. With
    `workspace_id`, a run of another workspace is not found (None)."""
    run = session.get(MaintenanceRun, run_id, populate_existing=True)
    if run is not None and workspace_id is not None and run.workspace_id != workspace_id:
        return None
    if run is None or run.status != S.RUNNING:
        return run
    transition(session, run, S.CANCELLING, now, cancel_requested_at=now)
    return session.get(MaintenanceRun, run_id, populate_existing=True)


# What a run keeps of the runtime's answer: a summary is the compacted context, an error a
# sentence; both bounded so a host cannot grow a row without limit.
MAX_SUMMARY_BYTES = 256 * 1024
MAX_ERROR_BYTES = 4096


def check_outcome(outcome: dict[str, Any]) -> dict[str, Any]:
    """The runtime's final answer as values the database can store; InvalidArgument if
    any is ill-typed, out of range or not storable text."""
    checked: dict[str, Any] = {}
    for name in ("applied", "cancelled"):
        value = outcome.get(name)
        if value is not None and not isinstance(value, bool):
            raise InvalidArgument(f"{name} must be a boolean", field=name)
        checked[name] = bool(value)
    for name in ("input_tokens", "result_tokens"):
        checked[name] = check_optional_int(name, outcome.get(name))
    summary, error = outcome.get("summary"), outcome.get("error")
    checked["summary"] = (
        None
        if summary is None
        else check_text("summary", summary, MAX_SUMMARY_BYTES, allow_empty=True)
    )
    checked["error"] = None if error in (None, "") else check_text("error", error, MAX_ERROR_BYTES)
    return checked


def terminal_for(answer: dict[str, Any]) -> tuple[MaintenanceStatus, dict[str, Any]]:
    """The terminal status and fields for the runtime's final answer (docs/lifecycles.md:
    maintenance). An answer that cannot be stored ends the run `failed` (invalid_runtime_answer):
    asking again would only get the same answer, and the session must not stay held."""
    try:
        outcome = check_outcome(answer)
    except InvalidArgument as exc:
        return S.FAILED, {
            "applied": False,
            "error_code": MaintenanceError.INVALID_RUNTIME_ANSWER,
            "detail": f"the runtime's outcome could not be stored: {exc}",
        }
    applied, cancelled, error = outcome["applied"], outcome["cancelled"], outcome["error"]
    fields: dict[str, Any] = {"applied": applied, "input_tokens": outcome["input_tokens"]}
    if applied:
        fields.update(result_tokens=outcome["result_tokens"], summary=outcome["summary"])
    if not error and not cancelled and applied:
        return S.COMPLETED, fields  # even if a cancel arrived late
    if cancelled:
        status = S.PARTIALLY_COMPLETED if applied else S.CANCELLED
        return status, dict(fields, error_code=MaintenanceError.CANCELLED)
    if error:
        return S.FAILED, dict(fields, error_code=MaintenanceError.SUMMARY_FAILED, detail=str(error))
    return S.NOOP, dict(fields, error_code=MaintenanceError.NO_HISTORY)

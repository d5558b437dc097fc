"""Activity reports from agent hosts (docs/lifecycles.md: turns): session fields and goal-applied
evidence."""

import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from sqlalchemy import exists, or_, select
from sqlalchemy.orm import Session

from ...models.enums import TURN_PHASE_ORDER, TurnOrigin, TurnOutcome, TurnPhase
from ...models.operations import GoalFence, GoalOperation
from ...models.tables import Turn
from ..adapters import report_auth
from ..errors import InvalidArgument
from ..fences import cancels, restores
from ..fences.reinstall import needs_restore
from ..kinds.goal import OperationStatus
from ..maintenance import runs
from ..prompts import queue as prompts
from ..sessions import hosts, turns
from ..sessions.rows import Heard, lock_session, record_liveness
from ..validation import (
    check_choice,
    check_id,
    check_int,
    check_json_object,
    check_optional_int,
    check_report_time,
)
from .epochs import EpochEffects, move_host

SIGNATURE = re.compile(f"[0-9a-f]{{{report_auth.SIGNATURE_HEX_CHARS}}}")
SESSION_FIELDS = {"provider", "provider_session_id", "live", "runtime_epoch", "host_id"}
REPORT_PARTS = {
    "workspace_id",
    "session_id",
    "occurred_at_ms",
    "session",
    "turn",
    "goal_applied",
    "signed_by",
    "signature",
}
TURN_FIELDS = {
    "turn_id",
    "phase",
    "outcome",
    "origin",
    "source_goal_operation_id",
    "source_goal_revision",
    "prompt_id",
}


@dataclass(frozen=True)
class Report:
    workspace_id: str
    session_id: str
    occurred_at: datetime
    session: dict[str, Any] | None
    goal_applied: dict[str, Any] | None
    turn: dict[str, Any] | None = None
    signed_by: str | None = None
    body: dict[str, Any] = field(default_factory=dict)  # as received: what was signed


def _check_dict(name: str, value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidArgument(f"{name} must be an object", field=name)
    return value


def parse_report(report: Any, now: datetime) -> Report:
    """Parse an untrusted report into typed values (docs/lifecycles.md: turns); InvalidArgument for
    anything else, before any write. `now` is the control plane's clock: a report dated
    more than a minute ahead of it is refused."""
    if not isinstance(report, dict):
        raise InvalidArgument("report must be a JSON object", field="report")
    unknown = set(report) - REPORT_PARTS
    if unknown:
        raise InvalidArgument(f"unknown report fields: {sorted(unknown)}", field="report")
    occurred_at = check_report_time("occurred_at_ms", report.get("occurred_at_ms"), now)
    session = _check_dict("session", report.get("session"))
    if session is not None:
        extra = set(session) - SESSION_FIELDS
        if extra:
            raise InvalidArgument(f"unknown session fields: {sorted(extra)}", field="session")
        for key in ("provider", "provider_session_id", "host_id"):
            if session.get(key) is not None:
                check_id(f"session.{key}", session[key])
        if "live" in session and not isinstance(session["live"], bool):
            raise InvalidArgument("session.live must be a boolean", field="session.live")
        if "runtime_epoch" in session:
            check_int("session.runtime_epoch", session["runtime_epoch"])
    applied = _check_dict("goal_applied", report.get("goal_applied"))
    if applied is not None:
        check_id("goal_applied.operation_id", applied.get("operation_id"))
        extra = set(applied) - {"operation_id", "revision", "goal"}
        if extra:
            raise InvalidArgument(
                f"unknown goal_applied fields: {sorted(extra)}", field="goal_applied"
            )
        check_int("goal_applied.revision", applied.get("revision"), minimum=1)
        check_json_object("goal_applied.goal", applied.get("goal"))
    turn = _parse_turn(report.get("turn"))
    signed_by = report.get("signed_by")
    if signed_by is not None:
        check_id("signed_by", signed_by)
    signature = report.get("signature")
    if signature is not None and not (
        isinstance(signature, str) and SIGNATURE.fullmatch(signature)
    ):
        raise InvalidArgument("signature must be 64 lowercase hex digits", field="signature")
    return Report(
        workspace_id=check_id("workspace_id", report.get("workspace_id")),
        session_id=check_id("session_id", report.get("session_id")),
        occurred_at=occurred_at,
        session=session,
        goal_applied=applied,
        turn=turn,
        signed_by=signed_by,
        body=report,
    )


def _check_choice(name: str, value: Any, choices: type[StrEnum]) -> str | None:
    if value is None:
        return None
    return check_choice(name, value, {c.value for c in choices})


def _parse_turn(value: Any) -> dict[str, Any] | None:
    turn = _check_dict("turn", value)
    if turn is None:
        return None
    extra = set(turn) - TURN_FIELDS
    if extra:
        raise InvalidArgument(f"unknown turn fields: {sorted(extra)}", field="turn")
    parsed: dict[str, Any] = {
        "turn_id": check_id("turn.turn_id", turn.get("turn_id")),
        "phase": _check_choice("turn.phase", turn.get("phase"), TurnPhase),
        "outcome": _check_choice("turn.outcome", turn.get("outcome"), TurnOutcome),
        "origin": _check_choice("turn.origin", turn.get("origin"), TurnOrigin),
        "source_goal_operation_id": None,
        "source_goal_revision": None,
        "prompt_id": None,
    }
    if parsed["phase"] is None:
        raise InvalidArgument("turn.phase is required", field="turn.phase")
    if parsed["phase"] == TurnPhase.SETTLED and parsed["outcome"] is None:
        raise InvalidArgument("a settled turn needs an outcome", field="turn.outcome")
    for key in ("source_goal_operation_id", "prompt_id"):
        if turn.get(key) is not None:
            parsed[key] = check_id(f"turn.{key}", turn[key])
    parsed["source_goal_revision"] = check_optional_int(
        "turn.source_goal_revision", turn.get("source_goal_revision"), minimum=1
    )
    return parsed


@dataclass
class ReportEffects:
    wake_fences: list[str]  # fences that waited on a turn this report settled
    wake_prompts: bool = False  # a prompt's turn settled: the session's queue may move on
    cancels: list[str] = field(default_factory=list)  # turn cancels this report made
    restore: bool = False  # the session's restore is due: publish it
    epoch: EpochEffects = field(default_factory=EpochEffects)  # a newer runtime epoch


def apply_report(
    session: Session, report: Report, now: datetime, default_token: str | None = None
) -> ReportEffects:
    """Apply one report in the caller's transaction: first its proof that it comes from the
    session's host (check_signed_by); `default_token` is the host `default`'s."""
    row = lock_session(session, report.workspace_id, report.session_id)
    # Served: a client operation was accepted for it, its host was given, or reported.
    served = row.host_bound or (row.event_sequence or 0) > 0
    facts = dict(report.session or {})
    newest = row.last_report_at is None or report.occurred_at >= row.last_report_at
    signer = check_signed_by(session, row, report, facts.pop("host_id", None), now, default_token)
    epoch = EpochEffects()
    if signer != row.host_id:
        # A report never moves a session already served by a host (ensure_session(host_id=)
        # does): only a session nothing was asked of yet is bound by one.
        if served:
            raise InvalidArgument(
                f"session {report.workspace_id}/{report.session_id} is bound to host"
                f" {row.host_id!r}; a report cannot move it (ensure_session(host_id=) does)",
                field="session.host_id",
            )
        epoch = move_host(session, row, signer, now)
    # A host that reported for the session serves it: no other host's report takes it.
    row.host_bound = True
    # An epoch in a report is a claim (docs/lifecycles.md: sessions): one newer than the one known
    # is confirmed with the session's own host (the restore's liveness look) before anything acts on
    # it, and only if something would: a forged value changes nothing.
    claimed = facts.pop("runtime_epoch", None)
    confirm = (
        claimed is not None
        and claimed > (row.runtime_epoch or 0)
        and _epoch_would_act(session, row, claimed)
    )
    if facts and newest:
        # Older session facts than the last applied ones are ignored: reports can arrive
        # out of order through the broker. Liveness is ordered with the host's answers, by
        # when the host said it (docs/lifecycles.md: sessions).
        if "live" in facts:
            record_liveness(row, facts.pop("live"), Heard(min(report.occurred_at, now)))
        for key, value in facts.items():
            setattr(row, key, value)
        row.last_report_at = report.occurred_at
    wake: list[str] = list(epoch.woken_fences)
    wake_prompts = False
    new_cancels: list[str] = []
    turn = report.turn
    # A turn runs in the epoch its host claims (else the one known): confirming a newer
    # epoch must not end it as a turn of an older one, and a late report of a turn of an
    # older epoch than the one known tells of a turn that ended with its process.
    known = row.runtime_epoch or 0
    turn_epoch = known if claimed is None else claimed
    settled, doubted = None, False
    if turn is not None:  # its record key: (host, epoch, id) is a turn's identity
        key = turns.turn_key(
            session, row.workspace_id, row.session_id, row.host_id, turn_epoch, turn["turn_id"]
        )
        turn = dict(turn, key=key)
        # Another generation or prompt than the turn on record under its key: an older turn's
        # report (docs/lifecycles.md: turns), not applied; the host's answer decides.
        recorded = session.get(
            Turn, (row.workspace_id, row.session_id, key), populate_existing=True
        )
        doubted = turns.another_turn(recorded, turn, None if claimed else report.occurred_at)
        turn = None if doubted else turn
    if turn is not None:
        settled = apply_turn(session, row, turn, report.occurred_at, turn_epoch, now)
    if turn is not None and settled is not None:
        ws, sid, outcome = report.workspace_id, report.session_id, turn["outcome"]
        wake = cancels.on_turn_settled(session, ws, sid, turn["key"], outcome, now)
        # The prompt of the turn on record (a settled report need not name it again).
        prompt_id = settled.prompt_id or turn["prompt_id"]
        prompts.on_turn_settled(session, ws, sid, prompt_id, outcome, turn["turn_id"])
        wake_prompts = True  # any settled turn may let the next prompt (or a run) go
    elif turn is not None and turn_epoch < known:
        wake = wake + cancels.interrupt_running_turns(
            session, report.workspace_id, report.session_id, now, before_epoch=known
        )
        wake_prompts = True
    elif turn is not None:
        cancel_id = cancels.cancel_if_fenced(
            session, report.workspace_id, report.session_id, turn["key"], now
        )
        new_cancels = [cancel_id] if cancel_id else []
    # A goal applied is a hint: the host's own state answer completes the operation
    # (docs/lifecycles.md: reconcile), asked by the restore this asks for.
    applied = _awaited_goal(session, report)
    # The host answered for the session (docs/lifecycles.md: fences, sessions): a fence not known to
    # be installed at its (host, epoch), or a clear settled locally, gets the session's restore.
    said_offline = (report.session or {}).get("live") is False
    restore = (
        not said_offline
        and (confirm or applied or doubted or epoch.goal_owed or needs_restore(session, row))
        and restores.request(row, now)
    )
    return ReportEffects(
        restore=restore,
        wake_fences=wake,
        wake_prompts=wake_prompts or epoch.newer,
        epoch=epoch,
        cancels=new_cancels + epoch.cancels,
    )


def check_signed_by(
    session: Session,
    row,
    report: Report,
    named: str | None,
    now: datetime,
    default_token: str | None,
) -> str:
    """The host the report comes from (`signed_by`, else the host it names, else the session's
    own), once its proof holds: an HMAC of its body with that host's token
    (workflows/adapters/report_auth.py), not older than MAX_SIGNED_AGE_S. A host registered
    without a token takes unsigned reports (development only: `status` says so). Anything
    else is InvalidArgument, before anything is written."""
    signer = report.signed_by or named or row.host_id
    if named is not None and named != signer:
        raise InvalidArgument(
            f"session.host_id {named!r} is not the signing host {signer!r}",
            field="session.host_id",
        )
    # A report names a host, it never supplies an address: an unregistered one is refused.
    hosts.require_host(session, signer)
    token = hosts.token_of(session, signer, default_token)
    if token is None:
        return signer
    if report.body.get("signature") is None:
        raise InvalidArgument(
            f"report is not signed: host {signer!r} has a token", field="signature"
        )
    if not report_auth.signature_ok(report.body, token):
        raise InvalidArgument(f"report signature is not host {signer!r}'s", field="signature")
    if report.occurred_at < now - timedelta(seconds=report_auth.MAX_SIGNED_AGE_S):
        raise InvalidArgument(
            f"signed report is older than {report_auth.MAX_SIGNED_AGE_S} s (a replay?)",
            field="occurred_at_ms",
        )
    return signer


def _awaited_goal(session: Session, report: Report) -> bool:
    """The report tells of a goal applied that an operation of its session awaits (named
    exactly: operation and revision)."""
    applied = report.goal_applied
    if applied is None:
        return False
    op = session.get(GoalOperation, applied["operation_id"])
    return (
        op is not None
        and (op.workspace_id, op.session_id) == (report.workspace_id, report.session_id)
        and op.goal_revision == applied["revision"]
        and op.status == OperationStatus.DISPATCHED
    )


def _epoch_would_act(session: Session, row, claimed: int) -> bool:
    """Whether a newer epoch would change anything for the session: its fences go there,
    its turns of older epochs end, its maintenance run ends (docs/lifecycles.md: sessions)."""
    older_turns = select(Turn.turn_id).where(
        Turn.workspace_id == row.workspace_id,
        Turn.session_id == row.session_id,
        Turn.phase != TurnPhase.SETTLED,
        or_(Turn.runtime_epoch.is_(None), Turn.runtime_epoch < claimed),
    )
    fences = select(GoalFence.fence_id).where(
        GoalFence.workspace_id == row.workspace_id, GoalFence.session_id == row.session_id
    )
    return bool(
        session.execute(
            select(
                or_(
                    exists(older_turns),
                    exists(fences),
                    runs.holds(row.workspace_id, row.session_id),
                )
            )
        ).scalar_one()
    )


def apply_turn(
    session: Session, row, turn: dict[str, Any], occurred_at: datetime, epoch: int, now: datetime
) -> Turn | None:
    """Record a turn report (of a turn that runs in `epoch`, if it is new; `now` is when the
    mirror first saw it). Phases only move forward and settled is final; provenance is
    written once. Returns the turn's record when this report settled it (read afresh before)."""
    key = (row.workspace_id, row.session_id, turn.get("key", turn["turn_id"]))
    current = session.get(Turn, key)
    phase = turn["phase"]
    if current is None:
        current = Turn(
            workspace_id=key[0],
            session_id=key[1],
            turn_id=key[2],
            host_id=row.host_id,
            host_turn_id=None if key[2] == turn["turn_id"] else turn["turn_id"],
            phase=phase,
            origin=turn["origin"],
            source_goal_operation_id=turn["source_goal_operation_id"],
            source_goal_revision=turn["source_goal_revision"],
            prompt_id=turn["prompt_id"],
            runtime_epoch=epoch,
            started_at=occurred_at,
            seen_at=now,
        )
        session.add(current)
    else:
        if not current.runtime_epoch and epoch:
            current.runtime_epoch = epoch  # a turn of no known epoch (a prompt's) learns it
        if TURN_PHASE_ORDER[TurnPhase(phase)] <= TURN_PHASE_ORDER[TurnPhase(current.phase)]:
            return None  # a late or repeated report: turns never move backwards
    current.phase = phase
    settled = phase == TurnPhase.SETTLED
    if settled:
        current.outcome = turn["outcome"]
        current.settled_at = occurred_at
        if row.active_turn_id == current.turn_id:
            row.active_turn_id = None
    elif phase == TurnPhase.RUNNING:
        row.active_turn_id = current.turn_id
    session.flush()
    return current if settled else None

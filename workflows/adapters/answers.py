"""An agent host's answer, untrusted (docs/protocol.md): the shapes it must have, checked before any
step reads it. One that is not a JSON object of the documented shape, or is larger than
MAX_ANSWER_BYTES, is a retryable `bad_response` fault for that one call.

The state call's answer (`parse_state`) is what an agent host says it runs for a session,
parsed into a typed value at the edge: the host's own answer, which reports can be lost,
reordered or forged around, and a mirror built from them cannot."""

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...models.enums import TurnOrigin, TurnPhase
from ..errors import InvalidArgument, RuntimeFault
from ..validation import MAX_INT, check_id, check_json_object

# docs/protocol.md: a larger answer is a bad_response.
MAX_ANSWER_BYTES = 1024 * 1024
# An error code is a short word; an error detail is kept (in last_error) only this long.
ERROR_CODE = re.compile(r"[a-z][a-z0-9_]{0,63}")
MAX_DETAIL_CHARS = 300


JSON_TYPE_NAMES = {
    type(None): "null",
    list: "array",
    str: "string",
    int: "number",
    float: "number",
    bool: "boolean",
}


def bad_response(why: str, http_status: int | None = 200) -> RuntimeFault:
    return RuntimeFault(
        f"runtime answered {http_status} bad_response: {why}",
        code="bad_response",
        retryable=True,
        http_status=http_status,
    )


def printable(text: Any) -> str:
    """Untrusted text made safe to log and store: printable, bounded."""
    return "".join(ch if ch.isprintable() else "?" for ch in str(text)[:MAX_DETAIL_CHARS])


def is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def is_epoch(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_INT


def one_of(*choices: str) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, str) and v in choices


def json_object_or_none(v: Any) -> bool:
    try:
        check_json_object("answer", v)
        return True
    except InvalidArgument:
        return False


def is_id(v: Any) -> bool:
    return v is not None and id_or_none(v)


def id_or_none(v: Any) -> bool:
    try:
        return v is None or bool(check_id("answer", v))
    except InvalidArgument:
        return False


def shaped(
    answer: dict[str, Any],
    required: dict[str, Callable[[Any], bool]],
    optional: dict[str, Callable[[Any], bool]] | None = None,
) -> dict[str, Any]:
    """The answer if its documented fields have the documented types, else bad_response.
    Unknown fields are allowed (a newer host may add some) and ignored."""
    for name, ok in required.items():
        if name not in answer or not ok(answer[name]):
            raise bad_response(f"field {name!r} is missing or ill-typed")
    for name, ok in (optional or {}).items():
        if answer.get(name) is not None and not ok(answer[name]):
            raise bad_response(f"field {name!r} is ill-typed")
    return answer


# A session holds a handful of fences and at most a few unsettled turns; a list longer than
# this is no session's state.
MAX_FENCES = 10_000
MAX_TURNS = 1_000
# The phases of a turn that has not settled, and the origins a turn can have (section 3).
UNSETTLED_PHASES = frozenset({TurnPhase.SUBMITTED.value, TurnPhase.RUNNING.value})
ORIGINS = frozenset(origin.value for origin in TurnOrigin)
GOAL_STATUSES = frozenset({"active", "paused"})


@dataclass(frozen=True)
class AppliedGoal:
    """The goal operation the host applied last: its id and revision, and the goal it left
    (objective None after a clear)."""

    operation_id: str
    revision: int
    objective: str | None
    status: str | None


@dataclass(frozen=True)
class HostTurn:
    """An unsettled turn at the host, identified by (host, runtime epoch, turn id)."""

    turn_id: str
    phase: str
    runtime_epoch: int
    origin: str
    source_goal_operation_id: str | None
    source_goal_revision: int | None
    prompt_id: str | None


@dataclass(frozen=True)
class HostState:
    live: bool
    runtime_epoch: int
    goal: AppliedGoal | None
    fences: frozenset[tuple[str, int]]
    turns: tuple[HostTurn, ...]
    maintenance_run_id: str | None

    def running_turns_of(self, operation_id: str, revision: int) -> tuple[HostTurn, ...]:
        """The unsettled turns of one exact goal generation."""
        return tuple(
            t
            for t in self.turns
            if (t.source_goal_operation_id, t.source_goal_revision) == (operation_id, revision)
        )


def _object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad_response(f"{what} is not an object")
    return value


def _field(obj: dict[str, Any], name: str, ok, what: str, *, required: bool = True) -> Any:
    value = obj.get(name)
    if value is None and not required:
        return None
    if not ok(value):
        raise bad_response(f"{what} field {name!r} is missing or ill-typed")
    return value


def _list(value: Any, what: str, limit: int) -> list:
    if not isinstance(value, list) or len(value) > limit:
        raise bad_response(f"{what} is not a list of at most {limit}")
    return value


def _goal(value: Any) -> AppliedGoal | None:
    if value is None:
        return None
    goal = _object(value, "goal")
    return AppliedGoal(
        operation_id=_field(goal, "operation_id", is_id, "goal"),
        revision=_field(goal, "revision", is_epoch, "goal"),
        objective=_field(goal, "objective", lambda v: isinstance(v, str), "goal", required=False),
        status=_field(goal, "status", lambda v: v in GOAL_STATUSES, "goal", required=False),
    )


def _fence(value: Any) -> tuple[str, int]:
    fence = _object(value, "a fence")
    return (
        _field(fence, "target_operation_id", is_id, "fence"),
        _field(fence, "target_revision", is_epoch, "fence"),
    )


def _turn(value: Any) -> HostTurn:
    turn = _object(value, "a turn")
    return HostTurn(
        turn_id=_field(turn, "turn_id", is_id, "turn"),
        phase=_field(turn, "phase", lambda v: v in UNSETTLED_PHASES, "turn"),
        runtime_epoch=_field(turn, "runtime_epoch", is_epoch, "turn"),
        origin=_field(turn, "origin", lambda v: v in ORIGINS, "turn"),
        source_goal_operation_id=_field(
            turn, "source_goal_operation_id", id_or_none, "turn", required=False
        ),
        source_goal_revision=_field(turn, "source_goal_revision", is_epoch, "turn", required=False),
        prompt_id=_field(turn, "prompt_id", id_or_none, "turn", required=False),
    )


def parse_state(answer: dict[str, Any]) -> HostState:
    """The host's answer to the session-state call as a HostState, else bad_response.
    Unknown fields are allowed (a newer host may add some) and ignored."""
    live = _field(answer, "live", is_bool, "state")
    epoch = _field(answer, "runtime_epoch", is_epoch, "state")
    maintenance = answer.get("maintenance")
    run_id = None
    if maintenance is not None:
        run = _object(maintenance, "maintenance")
        run_id = _field(run, "run_id", is_id, "maintenance")
        _field(run, "state", lambda v: v == "running", "maintenance")
    return HostState(
        live=live,
        runtime_epoch=epoch,
        goal=_goal(answer.get("goal")),
        fences=frozenset(_fence(f) for f in _list(answer.get("fences", []), "fences", MAX_FENCES)),
        turns=tuple(_turn(t) for t in _list(answer.get("turns", []), "turns", MAX_TURNS)),
        maintenance_run_id=run_id,
    )

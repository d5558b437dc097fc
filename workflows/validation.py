"""Input checks shared by the client, the CLI and the task wrappers.

Every check raises InvalidArgument before anything touches the database.
"""

from typing import Any

from models.enums import GoalAction
from workflows.errors import InvalidArgument

MAX_ID_CHARS = 255
# An objective is prompt text for the agent; 16 KiB is far above a useful goal and keeps a
# row (and every broker message that carries one) small.
MAX_OBJECTIVE_BYTES = 16 * 1024


def check_id(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(f"{name} must be a string, got {type(value).__name__}",
                              field=name)
    if not 1 <= len(value) <= MAX_ID_CHARS:
        raise InvalidArgument(f"{name} must be 1-{MAX_ID_CHARS} characters, got {len(value)}",
                              field=name)
    if not value.isprintable():
        raise InvalidArgument(f"{name} must contain printable characters only", field=name)
    return value


def check_ids(name: str, value: Any, max_items: int) -> list[str]:
    """A non-empty list of ids, each checked as by check_id."""
    if not isinstance(value, list) or not 1 <= len(value) <= max_items:
        raise InvalidArgument(f"{name} must be a list of 1-{max_items} ids", field=name)
    return [check_id(name, item) for item in value]


def check_int(name: str, value: Any, *, minimum: int = 0, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{name} must be an integer, got {type(value).__name__}",
                              field=name)
    if value < minimum:
        raise InvalidArgument(f"{name} must be >= {minimum}, got {value}", field=name)
    return value


def check_action(value: Any) -> GoalAction:
    try:
        return GoalAction(value)
    except ValueError:
        choices = ", ".join(a.value for a in GoalAction)
        raise InvalidArgument(f"unknown goal action {value!r}; expected one of {choices}",
                              field="action") from None


def check_objective(action: GoalAction, objective: Any) -> str | None:
    if action is not GoalAction.SET:
        if objective is not None:
            raise InvalidArgument(f"goal {action.value} takes no objective", field="objective")
        return None
    if not isinstance(objective, str) or not objective.strip():
        raise InvalidArgument("goal set needs a non-empty objective string", field="objective")
    size = len(objective.encode("utf-8"))
    if size > MAX_OBJECTIVE_BYTES:
        raise InvalidArgument(f"objective is {size} bytes; the limit is {MAX_OBJECTIVE_BYTES}",
                              field="objective")
    return objective

"""Callables that may turn a driver's error into one their caller understands: the client
registers one that says the database is not migrated (workflows/client/base.py). Each returns
the exception to raise instead, or None. Both ways to the database ask them: the session's
(an engine's handle_error event) and the direct path's (models/direct.py)."""

from collections.abc import Callable
from typing import Any

ERROR_HOOKS: list[Callable[[BaseException], BaseException | None]] = []


def translated(exc: BaseException) -> BaseException | None:
    for hook in ERROR_HOOKS:
        if (replacement := hook(exc)) is not None:
            return replacement
    return None


def raise_translated(context: Any) -> None:
    """SQLAlchemy's handle_error listener: raise the replacement, if a hook has one."""
    replacement = translated(context.original_exception)
    if replacement is not None:
        raise replacement

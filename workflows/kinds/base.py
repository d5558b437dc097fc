"""What a kind declares (docs/architecture.md: adding an operation kind): the catalog, the
counts, retention, the client's `wait`, the sweeper and the CLI iterate declarations instead
of naming kinds.

A kind is its table and id column, the client's record of a row, every status a record can
have and those it settles in (counted once settled, docs/operations.md: counts), which settled
rows retention may delete, and what the sweeper publishes again when a row's message was lost
or its worker died (`Republish`; a kind with a recovery of its own names none).
"""

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, and_
from sqlalchemy.orm import Session

from ..records import record_of


@dataclass(frozen=True)
class Republish:
    """The sweeper publishes `task(kwarg=id)` again for a row in `statuses` whose next attempt
    is due and that no live lease holds; with `grace_first_attempt`, a row never attempted
    only once its own publish had time to arrive."""

    statuses: tuple[str, ...]
    task: str
    kwarg: str
    grace_first_attempt: bool


@dataclass(frozen=True)
class Kind:
    name: str  # as `op list --kind` and the counts name it
    noun: str  # as a message names one ("goal operation op-1")
    table: Any
    key: Any  # the id column; the record's field of the same name
    created: Any  # when it was accepted
    error: Any  # why it failed, if it did (None: the kind keeps no error)
    record_type: type
    statuses: tuple[str, ...]  # every status its records can have
    settled: tuple[str, ...] = ()  # counted in these once settled (none: not counted)
    # Retention: its rows that are settled and older than the cutoff (None: kept forever).
    prunable: Callable[[datetime], ColumnElement[bool]] | None = None
    republish: Republish | None = None
    # A row as its record, where reading it takes more than the row (default: record_of).
    read: Callable[[Session, Any], Any] | None = None
    # Its tasks that producers publish (README.md), whose results a producer may read.
    public_tasks: tuple[str, ...] = ()

    def id_of(self, record: Any) -> str:
        return getattr(record, self.key.key)

    def record(self, session: Session, row: Any) -> Any:
        if self.read is not None:
            return self.read(session, row)
        return record_of(self.record_type, row)


def settled_before(table: Any, settled: tuple[str, ...], age: Any = None, end: Any = None):
    """Retention's rows: in a settled status, accepted (`age`, the indexed column) before the
    cutoff, and, given `end`, settled before it too."""
    age = table.created_at if age is None else age
    return lambda cutoff: and_(
        age < cutoff, table.status.in_(settled), *(() if end is None else (end < cutoff,))
    )

"""State machines as tables of allowed moves (docs/architecture.md: rules own the transitions).

A rules module declares its machine once, `Machine(table, id column, state column, allowed)`,
and makes every change of the state column through `Machine.move`: one guarded UPDATE that
takes the row only from a state allowed to move there. Steps call the rules' named moves and
never write a state column themselves (tests/rules/test_layout.py checks it).
"""

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session

from ..models.db import rowcount
from . import leases


@dataclass(frozen=True)
class Machine:
    table: Any
    key: Any  # the id column
    state: Any  # the state column
    allowed: Mapping[str, frozenset[str]]  # from -> what it may move to

    def sources(self, to: str) -> list[str]:
        """Every state allowed to move to `to`."""
        found = sorted(origin for origin, targets in self.allowed.items() if to in targets)
        if not found:
            raise ValueError(f"{self.table.__tablename__}: nothing moves to {to}")
        return found

    def move(
        self,
        session: Session,
        row_id: str,
        to: str,
        *conditions: Any,
        token: str | None = None,
        **values: Any,
    ) -> bool:
        """Move one row to `to` (with `values`), from a state allowed to move there and where
        `conditions` hold (and, given `token`, only while that lease holds it); False, with
        nothing written, otherwise."""
        if token is not None:
            conditions = (*conditions, self.table.lease_token == token)
        return self.move_all(session, to, self.key == row_id, *conditions, **values) == 1

    def move_all(self, session: Session, to: str, *conditions: Any, **values: Any) -> int:
        """`move` every row where `conditions` hold; how many moved."""
        result = session.execute(
            update(self.table)
            .where(self.state.in_(self.sources(to)), *conditions)
            .values({self.state.key: to, **values})
        )
        return rowcount(result)

    def claim(
        self,
        session: Session,
        row_id: str,
        to: str,
        owner: str,
        lease_s: float,
        now: datetime,
        *conditions: Any,
        **values: Any,
    ) -> str | None:
        """`move` a row no live lease holds, taking its lease columns for `owner`
        (leases.claim_row): the lease token, which every later write of the holder names, or
        None."""
        return leases.claim_row(
            session,
            self.table,
            self.key,
            row_id,
            owner,
            lease_s,
            now,
            self.state.in_(self.sources(to)),
            *conditions,
            **{self.state.key: to},
            **values,
        )

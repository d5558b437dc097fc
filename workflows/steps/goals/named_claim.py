"""A named message's claim as one call (PostgreSQL; docs/lifecycles.md: goals dispatch 1-4, 4.8).

The claim of a message that names its operation's session is three prebuilt statements in
order: the named lane with the session lock (NAMED_LANE_AND_LOCK), then the claim's read and
claim (LOOKUP_AND_CLAIM), then, if that took nothing, the lane let go again. Sent one by one
in a transaction, each is a round trip with the Python around it, and BEGIN and COMMIT two
more. Here they run in a PL/pgSQL function of the connection's own (`pg_temp`), made from
those very statements' compiled texts, called in autocommit: one statement, one implicit
transaction, committed (and flushed) before the call returns, as before.

The order holds as in the transaction: each statement of a VOLATILE function reads a
snapshot taken when it starts (READ COMMITTED), so the claim's read starts after the lock,
as a statement of its own would.

Making the function needs the right to create temporary objects (PostgreSQL's TEMP
privilege, granted to every role by default). Where the database's role lacks it, the call
says so (None), once logged, and every named message of that engine is then dispatched as
if nothing were named: the lanes read, then the claim in a transaction of its own.
"""

import hashlib
import logging
import re
import weakref
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import Session

from ....models.direct import bound_sql
from ... import leases
from ...goals.statements import (
    LOOKUP_AND_CLAIM,
    NAMED_LANE_AND_LOCK,
    lookup_and_claim_params,
)

log = logging.getLogger(__name__)

_PLACEHOLDER = re.compile(r"%\((\w+)\)s")


def _argument_type(value: Any) -> str:
    """A function parameter's type, by the value bound to it: the statements' texts cast
    every placeholder to its column's type (psycopg's dialect renders the casts) but the
    literal flags of the lanes' statement, which are booleans."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "bigint"
    if isinstance(value, datetime):
        return "timestamptz"
    if value is None or isinstance(value, str):
        return "text"
    raise TypeError(f"no parameter type for {type(value).__name__}")


# Made on a connection already (by function name), per psycopg connection.
_made: "weakref.WeakKeyDictionary[Any, set[str]]" = weakref.WeakKeyDictionary()


class NamedClaim:
    """The three statements as one function for one dialect, and the call of it."""

    def __init__(self, dialect: Dialect) -> None:
        self.dialect = dialect
        self._sql: tuple[str, tuple[str, Any]] | None = None
        # Set once the database refused to make the function (no TEMP privilege).
        self.refused = False

    @staticmethod
    def _parts(params: dict[str, Any]) -> list[tuple[str, Any, dict[str, Any]]]:
        """Each statement, its prefix, and its parameters."""
        lane = {
            "b_op": params["b_op"],
            "b_ws": params["b_ws"],
            "b_sid": params["b_sid"],
            "b_name": params["b_name"],
            "b_now": params["b_now"],
            "b_owner": params["b_owner"],
            "b_token": params["b_lane_token"],
            "b_expires": params["b_expires"],
        }
        claim = lookup_and_claim_params(
            [params["b_op"]],
            params["b_now"],
            params["b_owner"],
            params["b_token"],
            params["b_expires"],
        )
        release = {"b_names": [params["b_name"]], "b_token": params["b_lane_token"]}
        return [
            ("l", NAMED_LANE_AND_LOCK, lane),
            ("c", LOOKUP_AND_CLAIM, claim),
            ("r", leases.RELEASE, release),
        ]

    def _bound(self, params: dict[str, Any]) -> tuple[list[tuple[str, str]], dict[str, Any]]:
        """Each statement's prefix and text, and the values bound, each under its
        statement's prefix."""
        texts: list[tuple[str, str]] = []
        values: dict[str, Any] = {}
        for prefix, statement, own in self._parts(params):
            sql, bound = bound_sql(self.dialect, statement, own)
            texts.append((prefix, sql))
            values |= {f"{prefix}_{name}": value for name, value in bound.items()}
        return texts, values

    def _function(
        self, texts: list[tuple[str, str]], values: dict[str, Any]
    ) -> tuple[str, tuple[str, Any]]:
        """The function's definition, and its name and the statement that calls it."""
        names = sorted(values)
        position = {name: i + 1 for i, name in enumerate(names)}

        def numbered(prefix: str, sql: str) -> str:
            return _PLACEHOLDER.sub(lambda m: f"${position[f'{prefix}_{m[1]}']}", sql)

        lane, claim, release = (numbered(prefix, sql) for prefix, sql in texts)
        types = [_argument_type(values[name]) for name in names]
        columns = ", ".join(
            f'"{c.name}" {c.type.compile(dialect=self.dialect)}'
            for c in LOOKUP_AND_CLAIM.selected_columns
        )
        body = f"""
DECLARE
  r record;
  lane_taken boolean := false;
  claimed boolean := false;
BEGIN
  FOR r IN {lane} LOOP
    IF r.lease THEN lane_taken := true; END IF;
  END LOOP;
  IF NOT lane_taken THEN RETURN; END IF;
  FOR r IN {claim} LOOP
    IF r.taken THEN claimed := true; RETURN NEXT r; END IF;
  END LOOP;
  IF NOT claimed THEN {release}; END IF;
END"""
        digest = hashlib.sha256((body + ",".join(types) + columns).encode()).hexdigest()[:16]
        name = f"pg_temp.agent_radar_named_claim_{digest}"
        ddl = (
            f"CREATE OR REPLACE FUNCTION {name}({', '.join(types)}) RETURNS SETOF record "
            f"LANGUAGE plpgsql VOLATILE AS $agent_radar${body}$agent_radar$"
        )
        arguments = ", ".join(f"CAST(:{n} AS {t})" for n, t in zip(names, types, strict=True))
        return ddl, (name, text(f"SELECT * FROM {name}({arguments}) AS claimed({columns})"))

    def call(self, session: Session, params: dict[str, Any]) -> list[Any] | None:
        """Run the claim (on a connection in autocommit): the claim's row if the lane was
        taken and the operation claimed; none otherwise, with nothing left taken. None,
        with nothing done, where the database does not let its role make the function."""
        if self.refused:
            return None
        texts, values = self._bound(params)
        if self._sql is None:
            self._sql = self._function(texts, values)
        ddl, (name, call) = self._sql
        conn = session.connection()
        driver = getattr(conn, "driver", None)
        if driver is None:
            raise RuntimeError("the named claim runs on a direct PostgreSQL connection")
        made = _made.setdefault(driver, set())
        if name not in made:
            from psycopg.errors import InsufficientPrivilege

            try:
                driver.execute(ddl)  # autocommit: a refusal leaves no transaction behind
            except InsufficientPrivilege as exc:
                self.refused = True
                log.warning(
                    "named claims are off: the database role may not make the claim's "
                    "function in pg_temp (%s); named messages are dispatched as unnamed",
                    str(exc).strip(),
                )
                return None
            made.add(name)
        return list(conn.execute(call, values))


_claims: dict[Dialect, NamedClaim] = {}


def named_claim(session: Session, params: dict[str, Any]) -> list[Any] | None:
    """NamedClaim.call for the session's dialect."""
    dialect = session.connection().dialect
    claim = _claims.get(dialect)
    if claim is None:
        claim = _claims[dialect] = NamedClaim(dialect)
    return claim.call(session, params)


def claim_params(
    op: str,
    key: tuple[str, str],
    lane: str,
    owner: str,
    lease_s: float,
    now: datetime,
) -> dict[str, Any]:
    """The call's parameters: new tokens for the lane and the operation."""
    return {
        "b_op": op,
        "b_ws": key[0],
        "b_sid": key[1],
        "b_name": lane,
        "b_now": now,
        "b_owner": owner,
        "b_lane_token": leases.new_token(),
        "b_token": leases.new_token(),
        "b_expires": now + timedelta(seconds=lease_s),
    }

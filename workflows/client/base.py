"""What every part of the client shares: its settings, engine, publisher and runtime port;
the accept of a submit (commit, then publish); loading a record; waiting for one to settle."""

from dataclasses import replace
from typing import Any, Self

from ...models import error_hooks
from ...models.db import engine_for, run_transaction
from ...models.dialects import MissingDatabase
from ..adapters import logs
from ..adapters.config import Settings
from ..adapters.http_runtime import HostRouter
from ..adapters.publisher import FLUSH_TIMEOUT_S, TaskPublisher
from ..adapters.runtime import RuntimePort
from ..errors import DatabaseNotReady, NotFound
from ..kinds import KINDS
from ..operators import catalog
from ..sessions import hosts
from ..validation import check_id, check_seconds

# How often `wait` looks at the database; the database is the source of truth.
WAIT_POLL_S = 0.05
# The longest `flush` may be asked to wait.
MAX_FLUSH_S = 3600.0


def _database_not_ready(exc: BaseException) -> DatabaseNotReady | None:
    """A driver's missing table (SQLite's "no such table", PostgreSQL's undefined_table,
    42P01) or a SQLite file that is not there as DatabaseNotReady, which says what to do: a
    client on a database nobody migrated, or a URL (or a home folder) that names another."""
    if isinstance(exc, MissingDatabase):
        return DatabaseNotReady(
            f"{exc}: point AGENT_RADAR_HOME or AGENT_RADAR_DATABASE_URL at your stack's "
            "database, or run `agent-radar db upgrade` to make this one"
        )
    if "no such table" not in str(exc) and getattr(exc, "sqlstate", None) != "42P01":
        return None
    first = str(exc).strip().splitlines()[0][:200]
    return DatabaseNotReady(
        f"the database has no agent-radar tables ({first}): run `agent-radar db upgrade`"
    )


if _database_not_ready not in error_hooks.ERROR_HOOKS:
    error_hooks.ERROR_HOOKS.append(_database_not_ready)


def _label(record: Any) -> str:
    """What an operator knows a message by: workspace/session and the client submit ID."""
    return logs.label(
        {
            "workspace_id": record.workspace_id,
            "session_id": record.session_id,
            "client_submit_id": getattr(record, "client_submit_id", None),
        }
    )


class ClientBase:
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
        self.engine = engine_for(self.settings.database_url)
        self.publisher = publisher or TaskPublisher(self.settings)
        # Refused reports, for `status` (sessions/hosts.py).
        self.refusals = hosts.RefusalTally()
        self.runtime = runtime or HostRouter(
            self.settings.runtime_url,
            hosts.locator(self.engine),
            self.settings.runtime_token,
            self.settings.runtime_timeout_s,
            self.settings.host_concurrency,
        )

    @classmethod
    def from_env(cls) -> Self:
        return cls()

    def _accept(self, work, task: str, message, pack=None, divert=None) -> Any:
        """Commit an intent (`work(session) -> (record, created)`), then publish its task.
        A replay publishes nothing; a failed publish is left to the sweeper (the row is
        the outbox). With `pack`, `message(record)` is an item handed to the sender thread,
        which shares messages among the submits of this process (TaskPublisher.share): the call
        returns after the commit (`flush` waits for the message, and `close` or the end of
        the process publishes what is left)."""
        record, created = run_transaction(self.engine, work, direct=pack is not None)
        if created and pack is None:
            self.publisher.publish_after_commit(task, message(record), _label(record))
        elif created:
            self.publisher.share(task, message(record), _label(record), pack, divert)
        return record

    def _load(self, kind: str, key: str, workspace_id: str | None = None) -> Any:
        """Load a record of a kind (workflows/kinds/) by id. With `workspace_id`
        (docs/operations.md), a record of another workspace is NotFound, exactly as a missing
        one."""
        declared = KINDS[kind]
        field = declared.key.key
        check_id(field, key)
        if workspace_id is not None:
            check_id("workspace_id", workspace_id)

        def load(s):
            found = catalog.get(s, declared, key, workspace_id)
            if found is None:
                raise NotFound(f"no {declared.noun} {key}", **{field: key})
            return found

        return run_transaction(self.engine, load)

    def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
        """Wait until the messages of this process's goal submits are at the broker (a goal
        submit returns once its intent is committed); False if some still wait after
        `timeout_s`: the sweeper publishes those."""
        return self.publisher.flush(check_seconds("timeout_s", timeout_s, maximum=MAX_FLUSH_S))

    def close(self) -> None:
        self.publisher.flush()
        self.publisher.close()

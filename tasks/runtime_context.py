"""Per-process collaborators of a task: engine, runtime adapter, publisher.

Keyed by (process id, settings): a forked pool process builds its own, and a test app with
other settings never sees another's.
"""

import os
from dataclasses import dataclass
from functools import lru_cache

from sqlalchemy.engine import Engine

from ..models.db import engine_for
from ..workflows.adapters.config import Settings
from ..workflows.adapters.http_runtime import HostRouter
from ..workflows.adapters.publisher import TaskPublisher
from ..workflows.sessions.hosts import locator


@lru_cache(maxsize=16)
def _runtime(_pid: int, settings: Settings) -> HostRouter:
    return HostRouter(
        settings.runtime_url,
        locator(engine_for(settings.database_url)),
        settings.runtime_token,
        settings.runtime_timeout_s,
        settings.host_concurrency,
    )


@lru_cache(maxsize=16)
def _publisher(_pid: int, settings: Settings) -> TaskPublisher:
    return TaskPublisher(settings)


@dataclass(frozen=True)
class TaskContext:
    settings: Settings

    @property
    def engine(self) -> Engine:
        return engine_for(self.settings.database_url)

    @property
    def runtime(self) -> HostRouter:
        return _runtime(os.getpid(), self.settings)

    @property
    def publisher(self) -> TaskPublisher:
        return _publisher(os.getpid(), self.settings)

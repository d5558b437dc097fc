"""Per-process collaborators for tasks: engine, runtime adapter, publisher (after fork)."""

import os
from functools import lru_cache

from sqlalchemy.engine import Engine

from models.db import engine_for
from workflows.broker import TaskPublisher
from workflows.config import Settings
from workflows.runtime import HttpRuntime


def settings() -> Settings:
    from tasks.app import app
    return app.conf.agent_radar_settings


def engine() -> Engine:
    return engine_for(settings().database_url)


@lru_cache(maxsize=4)
def _runtime(pid: int) -> HttpRuntime:
    s = settings()
    return HttpRuntime(s.runtime_url, s.runtime_token, s.runtime_timeout_s)


@lru_cache(maxsize=4)
def _publisher(pid: int) -> TaskPublisher:
    return TaskPublisher(settings())


def runtime() -> HttpRuntime:
    return _runtime(os.getpid())


def publisher() -> TaskPublisher:
    return _publisher(os.getpid())

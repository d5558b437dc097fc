"""A worker told to stop (SIGTERM, as every rollout sends) tells its pool processes, so that
long work hands itself back instead of holding the shutdown: the main process gets Celery's
`worker_shutting_down`; its prefork children learn of it from a flag file named after the
main process, which they look at between polls (docs/lifecycles.md: maintenance, leases)."""

import os
from pathlib import Path

from celery.signals import worker_shutting_down

from ..workflows.adapters.config import Settings

_folder: Path | None = None


def flag_folder(settings: Settings) -> Path:
    return settings.home / "run" / "stopping"


def _flag(pid: int) -> Path | None:
    return None if _folder is None else _folder / str(pid)


def watch(settings: Settings) -> None:
    """Called once per worker (main process) before it forks its pool."""
    global _folder
    _folder = flag_folder(settings)
    _folder.mkdir(parents=True, exist_ok=True)
    flag = _flag(os.getpid())
    if flag is not None:
        flag.unlink(missing_ok=True)  # a pid reused from an earlier worker


def stopping() -> bool:
    """True once this worker (this process, or the pool's main process) is shutting down."""
    for pid in (os.getpid(), os.getppid()):
        flag = _flag(pid)
        if flag is not None and flag.exists():
            return True
    return False


@worker_shutting_down.connect
def _on_shutting_down(**_kwargs) -> None:
    flag = _flag(os.getpid())
    if flag is not None:
        flag.touch()

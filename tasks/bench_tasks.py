"""`agent_radar.bench.noop`: the standard Celery baseline of the benchmark (docs/benchmarks.md).

Registered only in the benchmark's own workers (tasks.app.BENCH_TASKS_ENV). The task does
nothing but count its completion at the least cost, with the time it finished (for the
round-trip latency): one RPUSH on a Redis broker — the one command a Celery user's counter
costs — and elsewhere one appended line in a file of this process. The Redis key and the
file name are built from `run_id`, so only a short hex run id is accepted: no message can
name another key or path.
"""

import os
import re
import time
from pathlib import Path

from ..workflows.adapters.config import Settings
from ..workflows.errors import InvalidArgument
from ..workflows.task_names import BASELINE_TASK
from ..workflows.validation import check_int
from .strict import NONE, strict_task

RUN_ID = re.compile(r"[0-9a-f]{1,32}")

_redis = None  # one client per pool process, made after the fork


def _redis_client(settings: Settings):
    global _redis
    if _redis is None or _redis[0] != os.getpid():
        import redis

        _redis = (os.getpid(), redis.Redis.from_url(settings.broker_url))
    return _redis[1]


def _key(settings: Settings, run_id: str) -> str:
    return f"{settings.broker_key_prefix}agent-radar:bench:{run_id}"


# The standard baseline is Celery without task events (docs/benchmarks.md: the phases).
@strict_task(BASELINE_TASK, events=NONE)
def noop(ctx, run_id: str, index: int):
    if not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id):
        raise InvalidArgument("run_id must be 1-32 lowercase hex digits", field="run_id")
    check_int("index", index)
    line = f"{index} {time.time()}"
    if ctx.settings.is_redis_broker:
        _redis_client(ctx.settings).rpush(_key(ctx.settings, run_id), line)
        return
    with open(ctx.settings.home / "bench" / f"{run_id}-{os.getpid()}.done", "a") as fh:
        fh.write(line + "\n")


class Tally:
    """What the benchmark reads of one run's no-ops: how many finished, and when each did."""

    def __init__(self, settings: Settings, run_id: str) -> None:
        self.settings = settings
        self.run_id = run_id
        self.redis = None
        if settings.is_redis_broker:
            import redis

            self.redis = redis.Redis.from_url(settings.broker_url)
        else:
            (settings.home / "bench").mkdir(parents=True, exist_ok=True)

    def _files(self) -> list[Path]:
        return list((self.settings.home / "bench").glob(f"{self.run_id}-*.done"))

    def count(self) -> int:
        if self.redis is not None:
            return int(self.redis.llen(_key(self.settings, self.run_id)))
        return sum(path.read_bytes().count(b"\n") for path in self._files())

    def times(self) -> dict[int, float]:
        """index -> when its no-op finished (wall clock)."""
        if self.redis is not None:
            raw = self.redis.lrange(_key(self.settings, self.run_id), 0, -1)
            lines = [line.decode() for line in raw]
        else:
            lines = [line for p in self._files() for line in p.read_text().splitlines() if line]
        return {int(index): float(at) for index, at in (line.split() for line in lines)}

    def close(self) -> None:
        if self.redis is not None:
            self.redis.delete(_key(self.settings, self.run_id))
            self.redis.close()

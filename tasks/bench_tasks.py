"""`agent_radar.bench.noop`: the raw-Celery baseline of the benchmark (DESIGN 8a).

Registered only in the benchmark's own workers (tasks.app.BENCH_TASKS_ENV). With no result
backend, the only trace it leaves is one appended line, so the benchmark can tell when every
no-op has run; that costs microseconds against a task round trip. The file name is built
from `run_id`, so only a short hex run id is accepted: no message can name another path.
"""

import os
import re
import time
from pathlib import Path

from tasks.strict import strict_task
from workflows.errors import InvalidArgument
from workflows.validation import check_int

RUN_ID = re.compile(r"[0-9a-f]{1,32}")


@strict_task("agent_radar.bench.noop")
def noop(ctx, run_id: str, index: int):
    if not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id):
        raise InvalidArgument("run_id must be 1-32 lowercase hex digits", field="run_id")
    check_int("index", index)
    folder = ctx.settings.home / "bench"
    with open(folder / f"{run_id}-{os.getpid()}.done", "a") as fh:
        fh.write(f"{index} {time.time()}\n")


def completions(home: Path, run_id: str) -> list[float]:
    times = []
    for path in (home / "bench").glob(f"{run_id}-*.done"):
        times += [float(line.split()[1]) for line in path.read_text().splitlines() if line]
    return times

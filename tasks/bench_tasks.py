"""`agent_radar.bench.noop`: the raw-Celery baseline of the benchmark (DESIGN 8a).

With no result backend, the only trace it leaves is one appended line, so the benchmark can
tell when every no-op has run; that costs microseconds against a task round trip.
"""

import os
import time
from pathlib import Path

from tasks.strict import strict_task


@strict_task("agent_radar.bench.noop")
def noop(ctx, run_id: str, index: int):
    folder = ctx.settings.home / "bench"
    with open(folder / f"{run_id}-{os.getpid()}.done", "a") as fh:
        fh.write(f"{index} {time.time()}\n")


def completions(home: Path, run_id: str) -> list[float]:
    times = []
    for path in (home / "bench").glob(f"{run_id}-*.done"):
        times += [float(line.split()[1]) for line in path.read_text().splitlines() if line]
    return times

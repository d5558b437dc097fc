"""The bench's CPU accounting, from /proc: the whole machine's busy time, each component's
(client, worker, simulator, database, broker), and when the worker has gone idle."""

import os
import time
from dataclasses import dataclass

# A throughput phase's CPU counts until the worker has spent none for this long (its event
# loop's own timers wake it every second or two, for a few clock ticks).
IDLE_FOR_S = 0.3
IDLE_POLL_S = 0.05


def machine_busy_s() -> float | None:
    """CPU seconds the whole machine has spent busy (every process: client, workers,
    simulator, database, broker, and whatever else runs), from /proc/stat; None elsewhere."""
    try:
        with open("/proc/stat") as fh:
            fields = [int(v) for v in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _proc_stat(pid: int | str) -> tuple[str, int, float] | None:
    """(command name, parent pid, CPU seconds so far) of a process, from /proc; None if it
    is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            raw = fh.read()
    except OSError:
        return None
    name = raw[raw.index("(") + 1 : raw.rindex(")")]
    fields = raw[raw.rindex(")") + 2 :].split()
    return name, int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _proc_stats() -> dict[int, tuple[str, int, float]]:
    """pid -> _proc_stat of every process."""
    return {
        int(entry): stat
        for entry in os.listdir("/proc")
        if entry.isdigit() and (stat := _proc_stat(entry)) is not None
    }


class Components:
    """CPU seconds per component of the run, from /proc: the benchmark's own process (the
    submitting client), the worker's main process and its pool processes, the simulator,
    the database server and the broker server (every process of theirs on this machine)."""

    SERVERS = {"database": ("postgres",), "broker": ("redis-server", "beam.smp")}

    def __init__(self, worker_pid: int | None, sim_pid: int | None) -> None:
        self.worker_pid = worker_pid
        self.sim_pid = sim_pid

    def snapshot(self) -> dict[str, float] | None:
        if not os.path.isdir("/proc"):
            return None
        stats = _proc_stats()
        totals = dict.fromkeys(
            ("client", "worker main", "worker pool", "simulator", "database", "broker"), 0.0
        )
        for pid, (name, ppid, cpu) in stats.items():
            if pid == os.getpid():
                totals["client"] += cpu
            elif pid == self.worker_pid:
                totals["worker main"] += cpu
            elif ppid == self.worker_pid and self.worker_pid is not None:
                totals["worker pool"] += cpu
            elif pid == self.sim_pid:
                totals["simulator"] += cpu
            else:
                for component, names in self.SERVERS.items():
                    if name.startswith(names):
                        totals[component] += cpu
        return totals

    def worker_cpu_s(self) -> float | None:
        """CPU seconds of the worker's main and pool processes so far (reads only theirs:
        cheap enough to poll)."""
        if self.worker_pid is None:
            return None
        try:
            with open(f"/proc/{self.worker_pid}/task/{self.worker_pid}/children") as fh:
                pids = [self.worker_pid, *(int(pid) for pid in fh.read().split())]
        except OSError:
            return None
        return sum(stat[2] for pid in pids if (stat := _proc_stat(pid)) is not None)

    def wait_until_worker_idle(self, idle_for_s: float, timeout_s: float) -> bool:
        """Wait until the worker's processes (main and pool) have spent no CPU for
        `idle_for_s`; False if they were still busy after `timeout_s` (or there is no
        /proc to tell)."""
        last = self.worker_cpu_s()
        if last is None:
            return False
        deadline = time.monotonic() + timeout_s
        quiet_since = time.monotonic()
        while time.monotonic() - quiet_since < idle_for_s:
            if time.monotonic() > deadline:
                return False
            time.sleep(IDLE_POLL_S)
            now = self.worker_cpu_s()
            if now != last:
                last, quiet_since = now, time.monotonic()
        return True

    @staticmethod
    def per_op_ms(
        before: dict[str, float] | None, after: dict[str, float] | None, ops: int
    ) -> dict[str, float] | None:
        if before is None or after is None:
            return None
        return {k: round((after[k] - before[k]) * 1000 / ops, 3) for k in before}


@dataclass
class Phase:
    """One phase's figures: its rate (0 where only its CPU was counted, a paced phase) and
    the machine's CPU per operation, whole and by component (Bench.counted)."""

    per_s: float
    cpu_ms_per_op: float | None
    components_ms_per_op: dict[str, float] | None = None


def machine_ms_per_op(before: float | None, after: float | None, ops: int) -> float | None:
    if before is None or after is None:
        return None
    return round((after - before) * 1000 / ops, 3)

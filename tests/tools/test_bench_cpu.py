"""The bench's CPU accounting: a throughput phase's CPU counts until the worker is idle."""

import subprocess
import sys
import time

import pytest

from agent_radar.workflows.tools.bench.cpu import Components

# A stand-in for a worker: a main process with one child, as a prefork worker has.
WORKER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
print(child.pid, flush=True)
time.sleep(60)
"""


@pytest.fixture
def worker_with_child(request):
    started = []

    def start(child_code: str):
        proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, child_code], stdout=subprocess.PIPE, text=True
        )
        child = int(proc.stdout.readline())
        started.append((proc, child))
        return proc.pid

    yield start
    for proc, child in started:
        subprocess.run(["kill", "-9", str(child)], check=False)
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_an_idle_worker_is_seen_idle(worker_with_child):
    components = Components(worker_with_child("import time; time.sleep(60)"), None)
    assert components.worker_cpu_s() is not None
    assert components.wait_until_worker_idle(0.3, timeout_s=20) is True


def test_a_busy_pool_process_keeps_the_phase_open(worker_with_child):
    components = Components(worker_with_child("while True: pass"), None)
    before = components.worker_cpu_s()
    started = time.monotonic()
    assert components.wait_until_worker_idle(0.3, timeout_s=1.5) is False
    assert time.monotonic() - started >= 1.5
    # The child's CPU is the worker's: it grew meanwhile.
    assert components.worker_cpu_s() > before


def test_without_a_worker_there_is_nothing_to_wait_for():
    assert Components(None, None).wait_until_worker_idle(0.3, timeout_s=5) is False


def test_the_slow_hosts_throughput_is_the_rate_while_the_fleet_is_busy():
    """100 effects a second for 10 s, then the last one 2 s later (one slow call): the
    sustained rate is 100 a second; counting the run's end would make it ~83."""
    from agent_radar.workflows.tools.bench.hosts import _sustained_rate

    times = [i / 100 for i in range(1000)] + [12.0]
    assert round(_sustained_rate(times)) == 100
    assert round(len(times) / (times[-1] - times[0])) == 83

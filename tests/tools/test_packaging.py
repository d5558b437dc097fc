"""Packaging as users install it: the built wheel in a fresh virtual environment, without the
test extras and without this checkout on the path, running `db upgrade`, a worker on Redis
and PostgreSQL, and one goal operation to applied at the simulator."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import eventually

ROOT = Path(__file__).resolve().parents[2]
INSTALL_TIMEOUT_S = 900


def _run(args, **kwargs):
    proc = subprocess.run(args, capture_output=True, text=True, **kwargs)
    assert proc.returncode == 0, f"{args}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A fresh venv holding only the wheel and its declared dependencies (exact versions
    from constraints.txt, as the Dockerfile installs them)."""
    work = tmp_path_factory.mktemp("wheel")
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--quiet",
            "-w",
            str(work / "dist"),
            str(ROOT),
        ],
        timeout=INSTALL_TIMEOUT_S,
    )
    wheel = next((work / "dist").glob("agent_radar-*.whl"))
    venv = work / "venv"
    base_python = getattr(sys, "_base_executable", sys.executable)
    _run([base_python, "-m", "venv", str(venv)], timeout=120)
    _run(
        [
            str(venv / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "--quiet",
            "-c",
            str(ROOT / "constraints.txt"),
            str(wheel),
        ],
        timeout=INSTALL_TIMEOUT_S,
        cwd=work,
    )
    return venv


@pytest.mark.timeout(INSTALL_TIMEOUT_S + 300)
@pytest.mark.parametrize("backend", ["production"])
def test_the_wheel_runs_a_worker_on_redis_and_applies_a_goal(
    backend, installed, settings, sim, sim_control, tmp_path
):
    python = installed / "bin" / "python"
    # Nothing of the test extras, and nothing of this checkout, is importable there.
    probe = _run(
        [
            str(python),
            "-c",
            textwrap.dedent("""
        import importlib.util, workflows
        print(workflows.__file__)
        print(importlib.util.find_spec("pytest") is None, importlib.util.find_spec("yaml") is None)
    """),
        ],
        cwd=tmp_path,
        env={"PATH": os.environ["PATH"]},
    ).stdout.split()
    assert str(installed) in probe[0] and probe[1:] == ["True", "True"]

    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), **settings.to_env()}
    _run(
        [str(installed / "bin" / "agent-radar"), "db", "upgrade"],
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    ready = tmp_path / "worker.ready"
    log = open(tmp_path / "worker.log", "wb")
    worker = subprocess.Popen(
        [str(installed / "bin" / "agent-radar"), "worker", "-c", "1"],
        cwd=tmp_path,
        env={**env, "AGENT_RADAR_READY_FILE": str(ready)},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the installed worker did not start"
            time.sleep(0.1)
        submit = _run(
            [
                str(python),
                "-c",
                textwrap.dedent("""
            from workflows.client import AgentRadar
            radar = AgentRadar.from_env()
            op = radar.set_goal("ws-wheel", "s1", "installed from the wheel",
                                client_submit_id="w-1")
            print(radar.wait(op, timeout=60).status, op.operation_id)
        """),
            ],
            cwd=tmp_path,
            env=env,
            timeout=120,
        ).stdout.split()
        assert submit[0] == "completed"
        eventually(
            lambda: [e for e in sim_control.effects() if e["operation_id"] == submit[1]],
            timeout_s=30,
        )
        assert len([e for e in sim_control.effects() if e["operation_id"] == submit[1]]) == 1
    finally:
        worker.terminate()
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, 9)
            worker.wait(10)
        log.close()

"""Packaging as users install it (docs/packaging.md): the built wheel holds one top-level
package, `agent_radar`; installed plainly in a fresh virtual environment, without the test
extras and without this checkout on the path, it is a client that works inside a service
with its own `models.py` and `tasks.py`; with the `server` extra the same environment runs
`db upgrade` and a worker on Redis and PostgreSQL, which applies the goal the client
submitted."""

import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from tests.helpers import eventually

ROOT = Path(__file__).resolve().parents[2]
INSTALL_TIMEOUT_S = 900


def _run(args, **kwargs):
    proc = subprocess.run(args, capture_output=True, text=True, **kwargs)
    assert proc.returncode == 0, f"{args}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


SERVICE_MODELS = """
class Invoice:  # the service's own model, nothing of ours
    pass
"""
SERVICE_TASKS = """
def send_invoice():  # the service's own tasks module
    return "sent"
"""
CLIENT_ONLY = ("celery", "alembic", "flower", "tornado", "prometheus_client", "pytest", "yaml")
# Run inside the service's folder, so its own models.py and tasks.py come first on the path.
SUBMIT = """
import importlib.util, sys
import models, tasks
from agent_radar import AgentRadar, NotFound
assert models.Invoice and tasks.send_invoice() == "sent"
missing = [m for m in sys.argv[1].split(",") if importlib.util.find_spec(m) is None]
radar = AgentRadar.from_env()
try:
    radar.get_goal_operation("no-such-operation")
except NotFound:
    pass
op = radar.set_goal("ws-wheel", "s1", "installed from the wheel", client_submit_id="w-1")
radar.close()
print(op.operation_id, ",".join(missing), models.__file__)
"""
WAIT = """
import sys
from agent_radar import AgentRadar
radar = AgentRadar.from_env()
print(radar.wait(radar.get_goal_operation(sys.argv[1]), timeout=60).status)
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(work), str(ROOT)],
        timeout=INSTALL_TIMEOUT_S,
    )
    return next(work.glob("agent_radar-*.whl"))


def test_the_wheel_holds_one_top_level_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"agent_radar"}
    for part in (
        "agent_radar/__init__.py",
        "agent_radar/workflows/client/__init__.py",
        "agent_radar/tasks/app.py",
        "agent_radar/beat/sweeper.py",
        "agent_radar/models/migrations/env.py",
        "agent_radar/models/migrations/versions/0001_goal_control.py",
    ):
        assert part in names


def _pip_install(venv: Path, requirement: str, cwd: Path) -> None:
    _run(
        [
            str(venv / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "--quiet",
            "-c",
            str(ROOT / "constraints.txt"),
            requirement,
        ],
        timeout=INSTALL_TIMEOUT_S,
        cwd=cwd,
    )


@pytest.mark.timeout(2 * INSTALL_TIMEOUT_S + 300)
@pytest.mark.parametrize("backend", ["production"])
def test_a_plain_install_is_a_client_and_the_server_extra_runs_its_worker(
    backend, wheel, settings, sim, sim_control, tmp_path
):
    venv = tmp_path / "venv"
    base_python = getattr(sys, "_base_executable", sys.executable)
    _run([base_python, "-m", "venv", str(venv)], timeout=120)
    _pip_install(venv, str(wheel), tmp_path)
    python, radar_cli = venv / "bin" / "python", venv / "bin" / "agent-radar"
    service = tmp_path / "service"
    service.mkdir()
    (service / "models.py").write_text(SERVICE_MODELS)
    (service / "tasks.py").write_text(SERVICE_TASKS)
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), **settings.to_env()}

    # The plain install: a client beside the service's own modules, with none of the server's.
    op_id, missing, models_file = _run(
        [str(python), "-c", SUBMIT, ",".join(CLIENT_ONLY)], cwd=service, env=env, timeout=120
    ).stdout.split()
    assert missing.split(",") == list(CLIENT_ONLY)
    assert models_file == str(service / "models.py")
    shown = _run([str(radar_cli), "op", "show", op_id, "--json"], cwd=service, env=env)
    assert '"status": "prepared"' in shown.stdout or '"status": "dispatched"' in shown.stdout
    refused = subprocess.run(
        [str(radar_cli), "worker", "--json"], cwd=service, env=env, capture_output=True, text=True
    )
    assert refused.returncode == 1 and "agent-radar[server]" in refused.stderr, refused.stderr

    # The server extra in the same environment: its worker applies what the client submitted.
    _pip_install(venv, f"{wheel}[server]", tmp_path)
    _run([str(radar_cli), "db", "upgrade"], cwd=tmp_path, env=env, timeout=120)
    ready = tmp_path / "worker.ready"
    log = open(tmp_path / "worker.log", "wb")
    worker = subprocess.Popen(
        [str(radar_cli), "worker", "-c", "1"],
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
        waited = _run([str(python), "-c", WAIT, op_id], cwd=service, env=env, timeout=120)
        assert waited.stdout.split() == ["completed"]
        eventually(
            lambda: [e for e in sim_control.effects() if e["operation_id"] == op_id],
            timeout_s=30,
        )
        assert len([e for e in sim_control.effects() if e["operation_id"] == op_id]) == 1
    finally:
        worker.terminate()
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, 9)
            worker.wait(10)
        log.close()


def test_pyproject_lists_every_package_folder():
    """The wheel maps the repository's folders under `agent_radar` by an explicit list: a
    folder left off it would be missing from every install."""
    import tomllib

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    folders = {"agent_radar"} | {
        "agent_radar." + ".".join(init.parent.relative_to(ROOT).parts)
        for top in ("models", "workflows", "tasks", "beat")
        for init in (ROOT / top).rglob("__init__.py")
    }
    assert listed == folders


IMPORT_BOTH = """
import agent_radar.models.tables, agent_radar.workflows.client, agent_radar.tasks, agent_radar.beat
print(agent_radar.models.tables.__file__)
try:
    import models.tables
except ImportError as refused:
    print(refused)
"""


def test_a_checkout_without_links_imports_the_one_name_and_refuses_the_second(tmp_path):
    """As git checks out on Windows by default: each link is a small file holding its target.
    `agent_radar.<folder>` still imports from the repository's top; a bare `models` (one
    editor auto-import away) is refused before a table is defined twice."""
    for top in ("models", "workflows", "tasks", "beat"):
        shutil.copytree(ROOT / top, tmp_path / top, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "agent_radar").mkdir()
    shutil.copy(ROOT / "agent_radar" / "__init__.py", tmp_path / "agent_radar")
    for top in ("models", "workflows", "tasks", "beat"):
        (tmp_path / "agent_radar" / top).write_text(f"../{top}")
    shown = _run(
        [sys.executable, "-c", IMPORT_BOTH], cwd=tmp_path, env={**os.environ, "PYTHONPATH": ""}
    ).stdout.splitlines()
    assert shown == [
        str(tmp_path / "models" / "tables.py"),
        "import agent_radar.models, not models (docs/packaging.md)",
    ]

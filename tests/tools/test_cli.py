"""`agent-radar` as a user runs it: its entry point (in a process of its own where the command
serves or runs Celery), --json output, one-line errors."""

import contextlib
import io
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
from dataclasses import replace

import pytest

from agent_radar.models.migrate import head_revision
from tests.conftest import free_port
from tests.helpers import row_counts

# Commands that serve, run Celery or build its app from the environment at import: each
# runs in a process of its own, as a user runs it. The rest run in this process through the
# same entry point (`main`: its parsing, errors and exit codes), which spares each one an
# interpreter's start (about 1 s); the front-door tests run the installed command itself.
OWN_PROCESS = frozenset({"flower", "health", "metrics", "worker", "beat", "up", "stack"})


def run_cli(settings, *args, check=True):
    if args and args[0] in OWN_PROCESS:
        proc = subprocess.run(
            [sys.executable, "-m", "agent_radar.workflows.tools.cli", *args],
            env={**os.environ, **settings.to_env()},
            capture_output=True,
            text=True,
            timeout=120,
        )
    else:
        proc = _in_this_process(settings.to_env(), list(args))
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def _in_this_process(env: dict[str, str], args: list[str]) -> subprocess.CompletedProcess:
    """`agent-radar ARGS` through its entry point here, with `env` over this environment:
    its exit code, stdout and stderr as a finished process's."""
    from agent_radar.workflows.tools.cli import main

    out, err, code = io.StringIO(), io.StringIO(), 0
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main(args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def run_status(env: dict[str, str]) -> subprocess.CompletedProcess:
    """`agent-radar status` in a process of its own, with exactly this environment."""
    return subprocess.run(
        [sys.executable, "-m", "agent_radar.workflows.tools.cli", "status"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_goal_set_show_and_status_as_json(settings, client, stack):
    stack.start_worker()
    out = run_cli(
        settings,
        "goal",
        "set",
        "ws",
        "s1",
        "ship the release",
        "--submit-id",
        "a",
        "--wait",
        "--json",
    )
    op = json.loads(out.stdout)
    assert (op["status"], op["provider_phase"], op["goal_revision"]) == ("completed", "applied", 1)
    again = json.loads(
        run_cli(
            settings, "goal", "set", "ws", "s1", "ship the release", "--submit-id", "a", "--json"
        ).stdout
    )
    assert again["operation_id"] == op["operation_id"]
    state = json.loads(run_cli(settings, "goal", "show", "ws", "s1", "--json").stdout)
    assert state["sync_status"] == "synced" and state["revision"] == 1
    status = json.loads(run_cli(settings, "status", "--json").stdout)
    assert status["goal_operations"] == {"completed": 1} and status["due"] == 0
    # No AGENT_RADAR_RUNTIME_TOKEN here: `default`'s reports are taken unsigned, and said so.
    assert status["unsigned_report_hosts"] == ["default"]
    assert "unsigned reports taken from" in run_cli(settings, "status").stdout
    session = json.loads(run_cli(settings, "session", "show", "ws", "s1", "--json").stdout)
    assert session["session_id"] == "s1"
    human = run_cli(settings, "goal", "show", "ws", "s1").stdout
    assert "revision 1 synced" in human


def test_a_goal_that_settles_failed_exits_one_after_wait(settings, client, stack, sim_control):
    """`--wait` until it settles: a goal the host refuses for good ends `failed`, its row is
    printed and the command exits 1 (without --wait it was accepted: 0)."""
    stack.start_worker()
    sim_control.fault("goal", status=422, error="rejected", count=1, session_id="s1")
    proc = run_cli(
        settings,
        "goal",
        "set",
        "ws",
        "s1",
        "x",
        "--submit-id",
        "a",
        "--wait",
        "--json",
        check=False,
    )
    assert proc.returncode == 1, proc.stderr
    assert json.loads(proc.stdout)["status"] == "failed"
    accepted = run_cli(settings, "goal", "set", "ws", "s2", "y", "--submit-id", "b", "--json")
    assert json.loads(accepted.stdout)["status"] in ("prepared", "dispatched", "completed")
    # A wait that runs out says so: nothing failed, the operation goes on (exit 1 all the same).
    sim_control.fault("goal", status=503, error="busy", count=3, session_id="s3")
    args = ("goal", "set", "ws", "s3", "z", "--submit-id", "c", "--wait", "0.5")
    proc = run_cli(settings, *args, check=False)
    assert proc.returncode == 1 and proc.stderr.startswith("error: timeout: "), proc.stderr
    assert "failed" not in proc.stderr


def test_session_ensure_resumes_an_offline_session(settings, client, sim_control):
    sim_control.session("ws", "off", live=False)
    info = json.loads(run_cli(settings, "session", "ensure", "ws", "off", "--json").stdout)
    assert info["live"] is True and info["runtime_epoch"] == 2
    assert [e["kind"] for e in sim_control.effects(kind=None)] == ["resume"]


@pytest.mark.parametrize(
    "args,needle",
    [
        (["goal", "set", "", "s1", "x", "--submit-id", "a"], "workspace_id must be 1-255"),
        (["goal", "set", "ws", "s" * 256, "x", "--submit-id", "a"], "session_id must be 1-255"),
        (["goal", "pause", "ws", "s1", "--submit-id", "a"], "goal_state_absent"),
        (["goal", "show", "ws", "nobody"], "not_found"),
    ],
)
def test_bad_input_is_one_line_nonzero_and_writes_nothing(settings, client, args, needle):
    _one_line_nonzero_and_nothing_written(settings, client, args, needle)


@pytest.mark.parametrize("backend", ["production"])  # refused before a command runs
@pytest.mark.parametrize(
    "args,needle",
    [
        (["goal", "set", "ws", "s1", "x"], "Missing option '--submit-id'"),
        (
            ["goal", "clear", "ws", "s1", "--submit-id", "a", "--expected-revision", "x"],
            "is not a valid integer",
        ),
        (["goal", "launch", "ws", "s1"], "No such command 'launch'"),
        (["bench", "--nodes", "0"], "not in the range"),
        (["bench", "--hosts", "9"], "not in the range"),
        (["bench", "--nodes", "two"], "is not a valid integer"),
        (["bench", "--settled", "-1"], "not in the range"),
        (["bench", "--settled", "1000000001"], "not in the range"),
        # a wait that would never end (or never begin) is refused before the submit
        (["goal", "set", "ws", "s1", "x", "--submit-id", "a", "--wait", "nan"], "--wait must be"),
        (["goal", "clear", "ws", "s1", "--submit-id", "a", "--wait", "86401"], "--wait must be"),
        (["fence", "ws", "s1", "op", "--submit-id", "f", "--wait", "inf"], "--wait must be"),
        (
            ["maintenance", "start", "ws", "s1", "--submit-id", "m", "--wait", "nan"],
            "--wait must be",
        ),
        (["session", "stop", "ws", "s1", "--submit-id", "s", "--wait", "1e9"], "--wait must be"),
        # errors name the option typed, not a parameter of the client's (a new user's trial)
        (["op", "list", "--since", "99999999d"], "--since '99999999d'"),
        (["prune", "--batch", "0"], "--batch"),
    ],
)
def test_a_usage_error_is_one_line_nonzero_and_writes_nothing(settings, client, args, needle):
    """Options and arguments Click refuses while it parses the command line: the command
    never runs, so no backend is involved and one is enough."""
    _one_line_nonzero_and_nothing_written(settings, client, args, needle)


def _one_line_nonzero_and_nothing_written(settings, client, args, needle):
    before = row_counts(client.engine)
    proc = run_cli(settings, *args, "--json", check=False)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    error = json.loads(lines[0])  # under --json, the error is JSON too
    assert error["error"] and needle in lines[0]
    text = run_cli(settings, *args, check=False).stderr.strip().splitlines()
    assert len(text) == 1 and text[0].startswith("error: ") and needle in text[0]
    assert row_counts(client.engine) == before


def test_conflicting_replay_is_reported(settings, client):
    run_cli(settings, "goal", "set", "ws", "s1", "one", "--submit-id", "a")
    proc = run_cli(settings, "goal", "set", "ws", "s1", "two", "--submit-id", "a", check=False)
    assert proc.returncode == 2 and "goal_operation_conflict" in proc.stderr


def test_db_upgrade(settings):
    out = json.loads(run_cli(settings, "db", "upgrade", "--json").stdout)
    assert out == {"revision": head_revision()}


def test_a_host_that_cannot_be_reached_is_a_failure_not_bad_input(settings, client):
    """The agent host is away: the command failed (exit 1) and says why in one line; the
    input was good (found by a new user's trial: it exited 2, "bad input")."""
    client.add_host("dead", f"http://127.0.0.1:{free_port()}")
    proc = run_cli(settings, "session", "ensure", "ws", "s1", "--host", "dead", check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: unreachable: "), lines


def test_flower_refuses_a_public_address_without_auth(settings):
    proc = run_cli(settings, "flower", "--address", "0.0.0.0", check=False)
    assert proc.returncode == 1 and "FLOWER_BASIC_AUTH" in proc.stderr  # a setting


@pytest.mark.parametrize("auth", ["admin:change-me", "admin:", "admin"])
def test_flower_refuses_an_empty_or_example_password(settings, auth, monkeypatch):
    monkeypatch.setenv("FLOWER_BASIC_AUTH", auth)
    proc = run_cli(settings, "flower", check=False)
    assert proc.returncode == 1 and "FLOWER_BASIC_AUTH" in proc.stderr


def _refused_at_start(proc, started, what, timeout_s=60):
    """Wait (polling) until `proc` exits or `started()` holds; it must have exited non-zero
    without starting, with one line on stderr, which is returned."""
    import time

    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None:
            assert not started(), f"{what} started"
            assert time.monotonic() < deadline, f"{what} neither started nor exited"
            time.sleep(0.1)
        stderr = proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        proc.stderr.close()
    assert proc.returncode != 0 and not started(), f"{what} started"
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def _start_cli(env, *args):
    return subprocess.Popen(
        [sys.executable, "-m", "agent_radar.workflows.tools.cli", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )


@pytest.mark.parametrize("backend", ["embedded"])  # refused before any backend is reached
def test_flower_refuses_the_loopback_without_auth(settings, backend, monkeypatch):
    from agent_radar.workflows.tools.stack import listening
    from tests.conftest import free_port

    monkeypatch.delenv("FLOWER_BASIC_AUTH", raising=False)
    port = free_port()
    env = {**os.environ, **settings.to_env()}
    proc = _start_cli(env, "flower", "--address", "127.0.0.1", "--port", str(port))
    line = _refused_at_start(proc, lambda: listening(port), "Flower")
    assert "FLOWER_BASIC_AUTH is not set" in line


def test_up_runs_flower_behind_a_password_of_its_own_or_the_one_set(monkeypatch):
    from agent_radar.workflows.tools.cli.services import _stack_flower_auth, flower_auth_problem

    monkeypatch.delenv("FLOWER_BASIC_AUTH", raising=False)
    (first, printed), (second, _) = _stack_flower_auth(), _stack_flower_auth()
    assert flower_auth_problem(first) is None and first != second
    assert first.endswith(f":{printed}")
    monkeypatch.setenv("FLOWER_BASIC_AUTH", "ops:chosen-by-the-operator")
    assert _stack_flower_auth() == ("ops:chosen-by-the-operator", None)
    monkeypatch.setenv("FLOWER_BASIC_AUTH", "admin:change-me")
    with pytest.raises(ValueError, match="FLOWER_BASIC_AUTH"):
        _stack_flower_auth()


BAD_LEASES = ["nan", "1\nerror: forged"]


@pytest.mark.parametrize("backend", ["embedded"])
@pytest.mark.parametrize("lease", BAD_LEASES)
def test_a_bad_setting_stops_a_command_with_one_line(settings, backend, lease):
    env = {**os.environ, **settings.to_env(), "AGENT_RADAR_LEASE_S": lease}
    proc = run_status(env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and proc.stdout == ""
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "AGENT_RADAR_LEASE_S" in lines[0] and repr(lease) in lines[0]


@pytest.mark.parametrize("backend", ["embedded"])
@pytest.mark.parametrize(
    "name, url, needle",
    [
        ("AGENT_RADAR_BROKER_URL", "redsi://127.0.0.1:6379/0", "got redsi://"),
        ("AGENT_RADAR_DATABASE_URL", "mysql://radar:secret@db/radar", "got mysql://"),
        ("AGENT_RADAR_DATABASE_URL", "/var/lib/radar.db", "got no scheme"),
    ],
)
def test_a_url_of_something_it_does_not_run_on_is_a_setting_error(
    settings, backend, name, url, needle
):
    """A typo in the broker's scheme, or another database: one line at start, exit 1, the
    URL's password not printed; not an outage retried for ever, not a traceback."""
    env = {**os.environ, **settings.to_env(), name: url}
    proc = run_status(env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and proc.stdout == ""
    assert len(lines) == 1 and name in lines[0] and needle in lines[0], proc.stderr
    assert "secret" not in proc.stderr


@pytest.mark.parametrize("backend", ["embedded"])
@pytest.mark.parametrize("command", [["runtime-sim", "--host", "127.0.0.1"], ["metrics"]])
def test_a_port_in_use_is_one_line(settings, backend, command):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = str(taken.getsockname()[1])
        proc = run_cli(settings, *command, "--port", port, check=False)
    finally:
        taken.close()
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert "in use" in lines[0], proc.stderr


@pytest.mark.parametrize("backend", ["embedded"])
def test_a_worker_refuses_to_start_on_a_bad_setting(settings, backend):
    ready = settings.home / "run" / "worker.ready"
    env = {
        **os.environ,
        **settings.to_env(),
        "AGENT_RADAR_LEASE_S": "nan",
        "AGENT_RADAR_READY_FILE": str(ready),
    }
    proc = _start_cli(env, "worker", "-c", "1")
    line = _refused_at_start(proc, ready.exists, "the worker")
    assert "AGENT_RADAR_LEASE_S" in line and "'nan'" in line


def _wait_line(proc, needle, timeout_s=60):
    import select
    import time

    deadline = time.monotonic() + timeout_s
    seen = ""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            seen += line
            if needle in line:
                return seen
    raise AssertionError(f"{needle!r} not printed within {timeout_s} s: {seen!r}")


@pytest.mark.parametrize("backend", ["embedded"])  # `up` is the embedded stack
@contextlib.contextmanager
def _up(settings):
    """`agent-radar up --json` in a process group of its own, its simulator on a free port:
    its environment and process, killed (with its group) if it still runs at the end."""
    import signal

    env = {
        **os.environ,
        **settings.to_env(),
        "AGENT_RADAR_RUNTIME_URL": f"http://127.0.0.1:{free_port()}",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent_radar.workflows.tools.cli", "up", "--json"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        yield env, proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        proc.stdout.close()
        proc.stderr.close()


def _all_gone(pids: dict[str, int]) -> None:
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)


def test_up_runs_the_stack_until_interrupted_or_terminated(settings, tmp_path, backend):
    import signal

    with _up(settings) as (env, proc):
        up = json.loads(_wait_line(proc, '"pids"').strip().splitlines()[-1])
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "agent_radar.workflows.tools.cli",
                "goal",
                "set",
                "ws",
                "up",
                "via up",
                "--submit-id",
                "1",
                "--wait",
                "--json",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert json.loads(out.stdout)["status"] == "completed", out.stderr
        # Ctrl-C, or SIGTERM as a service manager sends it: either stops everything.
        proc.send_signal(signal.SIGTERM if backend == "embedded" else signal.SIGINT)
        assert proc.wait(60) == 0
        _all_gone(up["pids"])


@pytest.mark.parametrize("backend", ["embedded"])
def test_up_stops_when_a_process_of_the_stack_dies_and_names_it(settings, backend):
    """A process of the stack exits (here the simulator, killed): `up` stops the rest and
    fails (exit 1) naming it and its log, not "bad input" with "see the logs"."""
    import signal

    with _up(settings) as (_env, proc):
        up = json.loads(_wait_line(proc, '"pids"').strip().splitlines()[-1])
        os.kill(up["pids"]["runtime-sim"], signal.SIGKILL)
        assert proc.wait(60) == 1
        error = json.loads(proc.stderr.read().strip().splitlines()[-1])
        assert error["error"] == "failed", error
        log = settings.home / "logs" / "runtime-sim.log"
        assert error["message"] == f"the stack's runtime-sim exited: see {log}", error
        _all_gone(up["pids"])


@pytest.mark.parametrize("backend", ["embedded"])  # one backend shows Flower's wiring
def test_flower_serves_with_basic_auth(settings, backend):
    import base64
    import signal
    import time

    import urllib3

    from tests.conftest import free_port

    port = free_port()
    env = {**os.environ, **settings.to_env(), "FLOWER_BASIC_AUTH": "ops:pw-for-this-test"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent_radar.workflows.tools.cli", "flower", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    http = urllib3.PoolManager(retries=False)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                anonymous = http.request("GET", url, timeout=2)
                break
            except urllib3.exceptions.HTTPError:
                assert time.monotonic() < deadline, "Flower did not start"
                time.sleep(0.2)
        assert anonymous.status == 401
        auth = base64.b64encode(b"ops:pw-for-this-test").decode()
        ok = http.request("GET", url, headers={"Authorization": f"Basic {auth}"}, timeout=5)
        assert ok.status == 200
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def test_fence_command(settings, client):
    op = json.loads(
        run_cli(settings, "goal", "set", "ws", "s1", "shared", "--submit-id", "a", "--json").stdout
    )
    fence = json.loads(
        run_cli(
            settings,
            "fence",
            "ws",
            "s1",
            op["operation_id"],
            "--submit-id",
            "f",
            "--reason",
            "revoked",
            "--json",
        ).stdout
    )
    assert fence["intent_accepted"] is True and fence["target_revision"] == 1
    assert fence["clear_operation_id"]
    proc = run_cli(
        settings, "fence", "ws", "s1", op["operation_id"], "--submit-id", "g", check=False
    )
    assert proc.returncode == 2 and "fence_conflict" in proc.stderr


def test_maintenance_prompt_drain_and_history_commands(settings, client, stack):
    stack.start_worker()
    run = json.loads(
        run_cli(
            settings,
            "maintenance",
            "start",
            "ws",
            "m",
            "--submit-id",
            "r1",
            "--wait",
            "60",
            "--json",
        ).stdout
    )
    assert (run["status"], run["revision"]) == ("completed", 3)
    shown = json.loads(run_cli(settings, "maintenance", "show", run["run_id"], "--json").stdout)
    assert shown["status"] == "completed"
    again = json.loads(run_cli(settings, "maintenance", "cancel", run["run_id"], "--json").stdout)
    assert again["revision"] == 3  # terminal: a cancel changes nothing
    queued = json.loads(
        run_cli(settings, "prompt", "ws", "m", "hello", "--submit-id", "p1", "--json").stdout
    )
    assert queued["position"] == 1
    waited = json.loads(
        run_cli(
            settings, "prompt", "ws", "p", "hi", "--submit-id", "p2", "--wait", "60", "--json"
        ).stdout
    )
    assert waited["status"] == "completed" and waited["turn_id"]  # its turn has ended
    rows = json.loads(run_cli(settings, "history", "ws", "m", "--json").stdout)
    assert [r["record_id"] for r in rows] == [
        f"maintenance:{run['run_id']}",
        f"prompt:{queued['prompt_id']}",
    ]
    assert rows[0]["revision"] == 3 and rows[0]["pending"] is False
    # The prompt's row, with its status now (looked up by its id).
    assert rows[1]["kind"] == "prompt"
    assert rows[1]["outcome"]["status"] in ("queued", "dispatched", "completed")
    drained = json.loads(
        run_cli(settings, "session", "drain", "ws", "m", "--reason", "rollout", "--json").stdout
    )
    assert drained["admission"] == "draining"
    proc = run_cli(settings, "maintenance", "start", "ws", "m", "--submit-id", "r2", check=False)
    assert proc.returncode == 2 and "runtime_draining" in proc.stderr
    proc = run_cli(
        settings,
        "maintenance",
        "start",
        "ws",
        "m",
        "--kind",
        "defrag",
        "--submit-id",
        "r3",
        check=False,
    )
    assert proc.returncode == 2 and proc.stderr.startswith("error: ")


def test_a_command_where_no_stack_is_names_where_it_looked_and_makes_nothing(tmp_path):
    """Run outside its stack's folder, the CLI's default home (./.agent-radar) holds no
    database: each command says where it looked and what to do, in one line, and leaves the
    folder as it found it (no empty home, no empty database file). `health db` says why."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_RADAR_")}
    looked = tmp_path / ".agent-radar" / "agent-radar.db"
    for args in (["status"], ["op", "list"], ["goal", "set", "ws", "s1", "x", "--submit-id", "a"]):
        proc = subprocess.run(
            [sys.executable, "-m", "agent_radar.workflows.tools.cli", *args],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1, (args, proc.stderr)
        assert f"database_not_ready: no database at {looked}" in lines[0], lines
        assert "AGENT_RADAR_HOME" in lines[0] and "agent-radar db upgrade" in lines[0]
    probe = subprocess.run(
        [sys.executable, "-m", "agent_radar.workflows.tools.cli", "health", "db", "--json"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.returncode == 1
    assert json.loads(probe.stdout)["detail"] == f"unreachable: no database at {looked}"
    assert list(tmp_path.iterdir()) == []


def test_an_unmigrated_database_is_a_one_line_error(tmp_path):
    (tmp_path / "fresh").mkdir()
    sqlite3.connect(tmp_path / "fresh" / "agent-radar.db").close()  # a file, no tables
    env = {**os.environ, "AGENT_RADAR_HOME": str(tmp_path / "fresh")}
    env.pop("AGENT_RADAR_DATABASE_URL", None)
    proc = run_status(env)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no agent-radar tables" in lines[0], lines
    assert "agent-radar db upgrade" in lines[0]


def test_maintenance_start_refuses_an_older_expected_epoch(settings, client, sim_control):
    sim_control.session("ws", "s9", restart=True)
    assert client.ensure_session("ws", "s9").runtime_epoch == 2  # learnt from the host
    proc = run_cli(
        settings,
        "maintenance",
        "start",
        "ws",
        "s9",
        "--submit-id",
        "m",
        "--expected-epoch",
        "1",
        check=False,
    )
    assert proc.returncode == 2 and "runtime_draining" in proc.stderr
    out = json.loads(
        run_cli(
            settings,
            "maintenance",
            "start",
            "ws",
            "s9",
            "--submit-id",
            "m",
            "--expected-epoch",
            "2",
            "--json",
        ).stdout
    )
    assert out["status"] == "running" and out["runtime_epoch"] == 2


def test_session_stop_command(settings, client):
    out = json.loads(
        run_cli(
            settings,
            "session",
            "stop",
            "ws",
            "idle",
            "--submit-id",
            "stop-1",
            "--reason",
            "maintenance window",
            "--wait",
            "--json",
        ).stdout
    )
    assert (out["status"], out["settled"], out["reason"]) == (
        "completed",
        True,
        "maintenance window",
    )
    proc = run_cli(settings, "session", "stop", "ws", "idle", "--submit-id", "stop-1", check=False)
    assert proc.returncode == 2 and "conflict" in proc.stderr


@pytest.mark.parametrize("backend", ["embedded"])  # CLI wiring; the rules run on both
def test_host_commands(settings, client, sim_b):
    def hosts():
        return json.loads(run_cli(settings, "host", "list", "--json").stdout)

    assert [(h["host_id"], h["url"]) for h in hosts()] == [("default", settings.runtime_url)]
    added = json.loads(run_cli(settings, "host", "add", "host-b", sim_b.url, "--json").stdout)
    assert (added["host_id"], added["url"], added["sessions"]) == ("host-b", sim_b.url, 0)
    for args, code, needle in [
        (("host", "add", "host-b", "http://127.0.0.1:1"), 2, "conflict"),
        (("host", "add", "host-c", "ftp://example"), 2, "invalid_argument"),
        (("host", "add", "default", sim_b.url), 2, "invalid_argument"),
        (("host", "add", "gpu 2", sim_b.url), 2, "host_id must be 1-64 letters"),
        (("host", "add", "gpu/2", sim_b.url), 2, "host_id must be"),
        (("host", "remove", "nowhere"), 3, "not_found"),
    ]:
        proc = run_cli(settings, *args, check=False)
        assert proc.returncode == code and needle in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1

    info = json.loads(
        run_cli(settings, "session", "ensure", "ws", "s1", "--host", "host-b", "--json").stdout
    )
    assert (info["host_id"], info["live"]) == ("host-b", True)
    assert [(h["host_id"], h["sessions"]) for h in hosts()] == [("default", 0), ("host-b", 1)]
    proc = run_cli(settings, "host", "remove", "host-b", check=False)
    assert proc.returncode == 2 and "1 session" in proc.stderr
    run_cli(settings, "session", "ensure", "ws", "s1", "--host", "default")
    assert "removed host-b" in run_cli(settings, "host", "remove", "host-b").stdout
    assert [h["host_id"] for h in hosts()] == ["default"]


@pytest.mark.parametrize("backend", ["production"])  # CLI wiring; the rules run on both
def test_op_commands_find_and_list_every_kind(settings, client):
    goal = client.set_goal("ws", "s1", "shared", client_submit_id="req-1")
    fence = client.fence_goal_generation("ws", "s1", goal.operation_id, client_submit_id="f-1")
    client.submit_prompt("ws", "s1", "hello", client_submit_id="req-1")
    run = client.start_maintenance("ws", "s1", "compact", client_submit_id="req-1")

    shown = json.loads(run_cli(settings, "op", "show", fence.fence_id, "--json").stdout)
    assert (shown["kind"], shown["fence_id"], shown["status"]) == (
        "fence",
        fence.fence_id,
        "pending",
    )
    proc = run_cli(settings, "op", "show", fence.fence_id, "--workspace", "other", check=False)
    assert proc.returncode == 3 and "not_found" in proc.stderr

    found = json.loads(run_cli(settings, "op", "find", "ws", "s1", "req-1", "--json").stdout)
    assert sorted(f["kind"] for f in found) == ["goal", "maintenance", "prompt"]
    # A run's own kind (what it does) is beside its operation kind, not in its place.
    (found_run,) = [f for f in found if f["kind"] == "maintenance"]
    assert (found_run["run_id"], found_run["maintenance_kind"]) == (run.run_id, "compact")
    text = run_cli(settings, "op", "find", "ws", "s1", "req-1").stdout
    assert all(k in text for k in ("goal", "prompt", "maintenance", "submit=req-1"))
    shown = json.loads(run_cli(settings, "op", "show", run.run_id, "--json").stdout)
    assert (shown["kind"], shown["maintenance_kind"]) == ("maintenance", "compact")
    proc = run_cli(settings, "op", "find", "ws", "s1", "nothing", check=False)
    assert proc.returncode == 3 and "not_found: nothing was submitted" in proc.stderr

    listed = json.loads(
        run_cli(settings, "op", "list", "--kind", "goal", "--workspace", "ws", "--json").stdout
    )
    assert {o["id"] for o in listed} == {goal.operation_id, fence.clear_operation_id}
    assert run_cli(settings, "op", "list", "--older-than", "1d").stdout.strip() == ("no operations")
    # Newest first unless asked otherwise; --since keeps the recent ones.
    newest = json.loads(run_cli(settings, "op", "list", "--since", "1h", "--json").stdout)
    created = [o["created_at"] for o in newest]
    assert len(newest) == 5 and created == sorted(created, reverse=True)
    oldest = json.loads(run_cli(settings, "op", "list", "--oldest-first", "--json").stdout)
    assert [o["id"] for o in oldest] == [o["id"] for o in reversed(newest)]
    pending = json.loads(run_cli(settings, "op", "list", "--status", "pending", "--json").stdout)
    assert [o["id"] for o in pending] == [fence.fence_id]
    for bad in (
        ["--older-than", "soon"],
        ["--since", "lately"],
        ["--session", "s1"],
        ["--kind", "turn"],
        ["--status", "faild"],
    ):
        proc = run_cli(settings, "op", "list", *bad, check=False)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("backend", ["embedded"])  # CLI wiring; the rules run on both
def test_operator_actions_from_the_cli(settings, client):
    from sqlalchemy import update

    from agent_radar.models.base import utcnow
    from agent_radar.models.db import run_transaction
    from agent_radar.models.operations import GoalOperation
    from agent_radar.workflows.goals.operations import fail_operation

    op = client.set_goal("ws", "s1", "ship it", client_submit_id="g1")
    run_transaction(
        client.engine,
        lambda s: fail_operation(s, s.get(GoalOperation, op.operation_id), "rejected", utcnow()),
    )
    proc = run_cli(settings, "op", "retry", op.operation_id, check=False)
    assert proc.returncode == 2 and "--reason" in proc.stderr  # the reason is required
    out = json.loads(
        run_cli(settings, "op", "retry", op.operation_id, "--reason", "fixed", "--json").stdout
    )
    assert (out["kind"], out["status"], out["attempt"]) == ("goal", "prepared", 0)
    proc = run_cli(settings, "op", "retry", op.operation_id, "--reason", "again", check=False)
    assert proc.returncode == 2 and "conflict" in proc.stderr

    run = client.start_maintenance("ws", "s2", client_submit_id="m1")
    proc = run_cli(
        settings,
        "maintenance",
        "resolve",
        run.run_id,
        "--to",
        "failed",
        "--reason",
        "x",
        check=False,
    )
    assert proc.returncode == 2 and "only a run in recovery" in proc.stderr
    run_transaction(
        client.engine,
        lambda s: s.execute(
            update(GoalOperation).values(last_error=None)  # untouched by the refusal above
        ),
    )
    # A session nobody has used is not made by a drain: not found, exit 3.
    proc = run_cli(settings, "session", "drain", "ws", "s3", "--reason", "r1", check=False)
    assert proc.returncode == 3 and "not_found: unknown session ws/s3" in proc.stderr
    client.set_goal("ws", "s3", "known now", client_submit_id="g3")
    drained = json.loads(
        run_cli(settings, "session", "drain", "ws", "s3", "--reason", "r1", "--json").stdout
    )
    assert drained["admission"] == "draining"
    opened = json.loads(
        run_cli(settings, "session", "undrain", "ws", "s3", "--reason", "r2", "--json").stdout
    )
    assert opened["admission"] == "open"
    history = run_cli(settings, "history", "ws", "s3").stdout
    assert "operator-action" in history and "r1" in history and "r2" in history


@pytest.mark.parametrize("backend", ["production"])  # CLI wiring; the rules run on both
def test_status_names_the_worst_and_check_fails_for_alerting(settings, client):
    from datetime import timedelta

    from sqlalchemy import update

    from agent_radar.beat.sweeper import sweep_once
    from agent_radar.models.base import utcnow
    from agent_radar.models.db import run_transaction
    from agent_radar.models.operations import GoalOperation, MaintenanceRun

    def status(*extra):
        return run_cli(settings, "status", *extra, check=False)

    # Nothing due, but no sweep ever finished: a dead (or missing) beat fails the check.
    never = status("--check", "--json")
    assert never.returncode == 1
    assert json.loads(never.stdout)["sweeper_heartbeat_age_s"] is None
    sweep_once(client.engine, lambda *a: True, utcnow(), owner="beat-1")
    healthy = status("--check")
    assert healthy.returncode == 0, healthy.stdout
    assert "last sweep: " in healthy.stdout and "worst:" not in healthy.stdout

    # An overdue goal operation and a run needing recovery: named, and the check fails.
    op = client.set_goal("ws", "s1", "ship it", client_submit_id="g1")
    run_transaction(
        client.engine,
        lambda s: s.execute(
            update(GoalOperation).values(
                next_attempt_at=utcnow() - timedelta(minutes=5), last_error="runtime 503"
            )
        ),
    )
    run = client.start_maintenance("ws", "s2", client_submit_id="m1")
    run_transaction(
        client.engine,
        lambda s: s.execute(
            update(MaintenanceRun).values(status="recovery_required", error_code="worker_lost")
        ),
    )
    failing = status("--check")
    assert failing.returncode == 1
    assert f"goal operation {op.operation_id} (ws/s1" in failing.stdout
    assert f"in recovery: run {run.run_id} (ws/s2, worker_lost)" in failing.stdout
    assert "problem: 1 goal operation(s) overdue" in failing.stdout
    assert status().returncode == 0  # without --check, status only reports

    # A goal operation that failed: the check fails for an hour, then it is history.
    run_transaction(
        client.engine, lambda s: s.execute(update(MaintenanceRun).values(status="failed"))
    )
    run_transaction(
        client.engine,
        lambda s: s.execute(
            update(GoalOperation).values(
                status="failed", completed_at=utcnow(), next_attempt_at=None
            )
        ),
    )
    sweep_once(client.engine, lambda *a: True, utcnow(), owner="beat-1")
    failed = status("--check")
    assert failed.returncode == 1
    assert "problem: 1 goal operations failed in the last hour" in failed.stdout
    # ... and it is named, with its error, as the fence's would be.
    assert f"  failed: goal operation {op.operation_id} (ws/s1, runtime 503)" in failed.stdout
    run_transaction(
        client.engine,
        lambda s: s.execute(
            update(GoalOperation).values(completed_at=utcnow() - timedelta(hours=2))
        ),
    )
    # A fresh sweep: the two commands above may outlast the five sweep intervals (0.5 s
    # here) after which a missing sweep is a problem of its own.
    sweep_once(client.engine, lambda *a: True, utcnow(), owner="beat-1")
    assert status("--check").returncode == 0


@pytest.mark.parametrize("backend", ["embedded"])  # CLI wiring; the rules run on both
def test_version_and_errors_as_json(settings):
    version = run_cli(settings, "--version")
    assert version.stdout.startswith("agent-radar, version ")
    for args, code, exit_code in [
        (["op", "show", "", "--json"], "invalid_argument", 2),
        (["op", "list", "--kind", "nope", "--json"], "usage", 2),
        (["goal", "show", "ws", "nobody", "--json"], "not_found", 3),
    ]:
        proc = run_cli(settings, *args, check=False)
        assert proc.returncode == exit_code and proc.stdout == ""
        error = json.loads(proc.stderr)
        assert error["error"] == code and error["message"], proc.stderr


@pytest.mark.parametrize("backend", ["production"])  # CLI wiring; the rules run on both
def test_metrics_exporter_serves_the_fleet_from_the_database(settings, client):
    import time
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    from sqlalchemy import update

    from agent_radar.beat.sweeper import sweep_once
    from agent_radar.models.base import utcnow
    from agent_radar.models.db import run_transaction
    from agent_radar.models.operations import MaintenanceRun
    from agent_radar.workflows.tools.metrics import METRICS
    from tests.conftest import free_port

    def samples(text):
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    before = samples(run_cli(settings, "metrics", "--once").stdout)
    assert before[("agent_radar_sweeper_heartbeat_age_seconds", ())] == float("inf")
    client.set_goal("ws-a", "s1", "ship it", client_submit_id="g1")
    client.set_goal("ws-b", "s1", "ship it", client_submit_id="g1")
    client.start_maintenance("ws-a", "s2", client_submit_id="m1")
    run_transaction(
        client.engine,
        lambda s: s.execute(update(MaintenanceRun).values(status="recovery_required")),
    )
    sweep_once(client.engine, lambda *a: True, utcnow(), owner="beat")

    port = free_port()
    env = {**os.environ, **settings.to_env()}
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent_radar.workflows.tools.cli", "metrics", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        text = None
        for _ in range(100):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    text = r.read().decode()
                break
            except OSError:
                time.sleep(0.1)
        assert text is not None, "the exporter did not answer"
    finally:
        proc.terminate()
        proc.wait(10)
    got = samples(text)
    assert {name for name, _ in got} == set(METRICS)
    for workspace in ("ws-a", "ws-b"):
        key = (("kind", "goal"), ("status", "prepared"), ("workspace", workspace))
        assert got[("agent_radar_operations", key)] == 1
    assert got[("agent_radar_runs_in_recovery", ())] == 1
    assert got[("agent_radar_held_sessions", ())] == 1
    assert got[("agent_radar_up", ())] == 1
    assert 0 <= got[("agent_radar_sweeper_heartbeat_age_seconds", ())] < 60
    # No label names a session: one dashboard serves any number of them.
    assert all("session" not in dict(labels) for _, labels in got)
    # Past the workspaces with the most operations, the rest are summed as "other": ws-a
    # (a goal and a run) keeps its series, ws-b's goal joins "other".
    top = samples(run_cli(settings, "metrics", "--once", "--top-workspaces", "1").stdout)
    workspaces = {
        dict(labels)["workspace"] for name, labels in top if name == "agent_radar_operations"
    }
    assert workspaces == {"ws-a", "other"}
    other = (("kind", "goal"), ("status", "prepared"), ("workspace", "other"))
    assert top[("agent_radar_operations", other)] == 1
    # Out of range: a usage error, nothing served.
    for bad in ("-1", "1001", "many"):
        refused = run_cli(settings, "metrics", "--once", "--top-workspaces", bad, check=False)
        assert refused.returncode == 2 and "--top-workspaces" in refused.stderr, refused.stderr


def test_the_exporter_folds_workspaces_past_the_top_into_other():
    from agent_radar.workflows.tools.metrics import fold_workspaces

    counts = {("goal", "completed", f"ws-{i:04d}"): i for i in range(5000)}
    counts[("fence", "failed", "ws-0001")] = 7
    folded = fold_workspaces(counts, 20)
    # 5,000 workspaces make 20 series of their own and "other" (and ws-0001's fence, in it)
    assert {w for _k, _s, w in folded} == {f"ws-{i:04d}" for i in range(4980, 5000)} | {"other"}
    assert sum(folded.values()) == sum(counts.values())
    assert folded[("fence", "failed", "other")] == 7
    assert fold_workspaces(counts, 0) == {
        ("goal", "completed", "other"): sum(range(5000)),
        ("fence", "failed", "other"): 7,
    }


# Every broker: the broker probe connects, and the worker probe pings over its control queues.
@pytest.mark.parametrize("backend", ["embedded", "production", "rabbitmq"])
def test_health_probes(settings, client, stack):
    def probe(*what, env=None):
        return run_cli(settings, "health", *what, "--json", check=False)

    assert probe("db").returncode == 0
    assert probe("broker").returncode == 0
    assert probe("beat").returncode == 1  # no sweep has finished yet
    assert probe("worker", "--timeout", "1").returncode == 1
    stack.start_worker()
    stack.start_beat()
    # A ping collects answers for its whole timeout (5 s by default); one worker answers
    # within milliseconds of it.
    worker = probe("worker", "--timeout", "2")
    assert worker.returncode == 0 and json.loads(worker.stdout)["ok"], worker.stdout
    assert probe("worker", "--host", "no-such-host", "--timeout", "1").returncode == 1
    from tests.helpers import eventually

    eventually(lambda: probe("beat").returncode == 0, what="a sweep to finish")


@pytest.mark.parametrize("backend", ["production"])
def test_the_broker_probe_tries_every_node_of_a_cluster(settings):
    """A `;`-separated broker URL (docs/broker-cluster.md): the probe passes while any node
    answers, the last listed too, and fails when none does."""
    dead = [f"redis://:pw-never-shown@127.0.0.1:{free_port()}/0" for _ in range(2)]
    for nodes, ok in ((dead + [settings.broker_url], True), (dead, False)):
        listed = replace(settings, broker_url=";".join(nodes))
        proc = run_cli(listed, "health", "broker", "--json", check=False)
        assert (proc.returncode, json.loads(proc.stdout)["ok"]) == (0 if ok else 1, ok), proc
    # Why, in the client library's words (it said only the error's class), and no password.
    detail = json.loads(proc.stdout)["detail"]
    assert detail.startswith("unreachable: ") and "refused" in detail, detail
    assert "pw-never-shown" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("backend", ["production"])  # Celery's own options, one broker
def test_worker_passes_celerys_options_through(settings, stack):
    from agent_radar.tasks.app import create_app
    from tests.helpers import eventually

    name = "passthrough"
    stack.start_worker(
        concurrency=1,
        name=name,
        extra_args=[
            "--autoscale",
            "3,1",
            "--max-tasks-per-child",
            "7",
            "--prefetch-multiplier",  # not an option of ours: passed to Celery as it is
            "1",
        ],
    )
    app = create_app(settings)
    stats = eventually(  # the one worker's answer is all there is to wait for (limit=1)
        lambda: app.control.inspect(timeout=2, limit=1).stats(), timeout_s=30, what="worker stats"
    )
    (node,) = [n for n in stats if n.startswith(f"{name}-")]
    assert stats[node]["pool"]["max-tasks-per-child"] == 7
    autoscaler = stats[node]["autoscaler"]
    assert (autoscaler["max"], autoscaler["min"]) == (3, 1)


@pytest.mark.parametrize("backend", ["production"])  # CLI wiring; the rules run on both
def test_prune_command(settings, client):
    client.set_goal("ws", "s1", "first", client_submit_id="g1")
    client.set_goal("ws", "s1", "second", client_submit_id="g2")
    dry = json.loads(run_cli(settings, "prune", "--dry-run", "--json").stdout)
    assert dry["dry_run"] and set(dry["rows"]) >= {"goal_operations", "session_events"}
    assert sum(dry["rows"].values()) == 0  # nothing is 30 days old
    assert "would delete" in run_cli(settings, "prune", "--dry-run").stdout
    proc = run_cli(settings, "prune", "--retention-days", "0.2", check=False)
    assert proc.returncode == 2 and "invalid_argument" in proc.stderr


# A reason that would print a forged history row after a newline, then hide what follows.
FORGED_REASON = "ok\n2026-12-01 operator-action approved by security team\x1b[8m"
SHOWN_REASON = "ok\\n2026-12-01 operator-action approved by security team\\x1b[8m"


@pytest.mark.parametrize("backend", ["embedded"])  # CLI wiring; the rules run on both
def test_untrusted_text_is_printed_escaped_and_json_stays_exact(settings, client):
    """Nothing a reason, an objective or an error says can forge a row or reach the terminal
    as a control sequence; --json still parses to the exact values."""
    goal = client.set_goal("ws", "s1", "ship it", client_submit_id="g1")
    fence = ["fence", "ws", "s1", goal.operation_id, "--submit-id", "f"]
    run_cli(settings, *fence, "--reason", FORGED_REASON)
    client.set_goal("ws", "s2", "ship\u2028it\u202e\x1b[2J", client_submit_id="g2")
    out = run_cli(settings, "history", "ws", "s1").stdout
    (row,) = [x for x in out.splitlines() if "reason:" in x]
    assert row.endswith(f"reason: {SHOWN_REASON}"), out
    assert not [x for x in out.splitlines() if x.startswith("2026-12-01")], out
    rows = json.loads(run_cli(settings, "history", "ws", "s1", "--json").stdout)
    assert [r["payload"]["reason"] for r in rows if (r["payload"] or {}).get("reason")] == [
        FORGED_REASON
    ]
    shown = run_cli(settings, "goal", "show", "ws", "s2").stdout
    assert "ship\\u2028it\\u202e\\x1b[2J" in shown and len(shown.splitlines()) == 1, shown
    for args in (
        ["history", "ws", "s1"],
        ["history", "ws", "s1", "--json"],
        ["goal", "show", "ws", "s2"],
        ["goal", "show", "ws", "s2", "--json"],
        ["op", "list"],
        ["op", "show", goal.operation_id],
        ["op", "find", "ws", "s1", "f"],
    ):
        text = run_cli(settings, *args).stdout
        assert text.isascii() and "\x1b" not in text and "\u2028" not in text, (args, text)
        assert not [x for x in text.splitlines() if x.startswith("2026-12-01")], (args, text)


@pytest.mark.parametrize("backend", ["embedded"])  # CLI wiring; the rules run on both
def test_history_shows_a_failed_attempt_of_an_operation_that_went_through(
    settings, client, stack, sim_control
):
    stack.start_worker()
    stack.start_beat()  # the sweeper re-publishes the retry when it is due
    sim_control.fault("goal", status=503, count=1)
    op = client.wait(client.set_goal("ws", "h1", "twice", client_submit_id="g1"), 60)
    assert (op.status, op.attempt) == ("completed", 2)
    # The error of the failed attempt stays on the completed record.
    assert "503" in op.last_error
    history = run_cli(settings, "history", "ws", "h1").stdout
    line = next(x for x in history.splitlines() if op.operation_id in x)
    assert " completed " in line and "attempts: 2" in line
    assert "last error: after a failed attempt:" in line and "503" in line
    rows = json.loads(run_cli(settings, "history", "ws", "h1", "--json").stdout)
    outcome = next(r["outcome"] for r in rows if op.operation_id in r["record_id"])
    assert (outcome["status"], outcome["attempt"]) == ("completed", 2) and "503" in outcome[
        "last_error"
    ]
    shown = run_cli(settings, "op", "list", "--workspace", "ws").stdout
    assert "after a failed attempt:" in shown

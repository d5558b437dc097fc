"""`agent-radar` as a user runs it: real subprocesses, --json output, one-line errors."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import row_counts


def run_cli(settings, *args, check=True):
    env = {**os.environ, **settings.to_env()}
    proc = subprocess.run([sys.executable, "-m", "workflows.cli", *args], env=env,
                          capture_output=True, text=True, timeout=120)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_goal_set_show_and_status_as_json(settings, client, stack):
    stack.start_worker()
    out = run_cli(settings, "goal", "set", "ws", "s1", "ship the release", "--submit-id", "a",
                  "--wait", "--json")
    op = json.loads(out.stdout)
    assert (op["status"], op["provider_phase"], op["goal_revision"]) == ("completed", "applied", 1)
    again = json.loads(run_cli(settings, "goal", "set", "ws", "s1", "ship the release",
                               "--submit-id", "a", "--json").stdout)
    assert again["operation_id"] == op["operation_id"]
    state = json.loads(run_cli(settings, "goal", "show", "ws", "s1", "--json").stdout)
    assert state["sync_status"] == "synced" and state["revision"] == 1
    status = json.loads(run_cli(settings, "status", "--json").stdout)
    assert status["goal_operations"] == {"completed": 1} and status["due"] == 0
    session = json.loads(run_cli(settings, "session", "show", "ws", "s1", "--json").stdout)
    assert session["session_id"] == "s1"
    human = run_cli(settings, "goal", "show", "ws", "s1").stdout
    assert "revision 1 synced" in human


def test_session_ensure_resumes_an_offline_session(settings, client, sim_control):
    sim_control.session("ws", "off", live=False)
    info = json.loads(run_cli(settings, "session", "ensure", "ws", "off", "--json").stdout)
    assert info["live"] is True and info["runtime_epoch"] == 2
    assert [e["kind"] for e in sim_control.effects(kind=None)] == ["resume"]


@pytest.mark.parametrize("args,needle", [
    (["goal", "set", "ws", "s1", "x"], "Missing option '--submit-id'"),
    (["goal", "set", "", "s1", "x", "--submit-id", "a"], "workspace_id must be 1-255"),
    (["goal", "set", "ws", "s" * 256, "x", "--submit-id", "a"], "session_id must be 1-255"),
    (["goal", "clear", "ws", "s1", "--submit-id", "a", "--expected-revision", "x"],
     "is not a valid integer"),
    (["goal", "pause", "ws", "s1", "--submit-id", "a"], "goal_state_absent"),
    (["goal", "launch", "ws", "s1"], "No such command 'launch'"),
    (["goal", "show", "ws", "nobody"], "not_found"),
])
def test_bad_input_is_one_line_nonzero_and_writes_nothing(settings, client, args, needle):
    before = row_counts(client.engine)
    proc = run_cli(settings, *args, "--json", check=False)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert needle in lines[0]
    assert row_counts(client.engine) == before


def test_conflicting_replay_is_reported(settings, client):
    run_cli(settings, "goal", "set", "ws", "s1", "one", "--submit-id", "a")
    proc = run_cli(settings, "goal", "set", "ws", "s1", "two", "--submit-id", "a", check=False)
    assert proc.returncode == 2 and "goal_operation_conflict" in proc.stderr


def test_db_upgrade(settings):
    out = json.loads(run_cli(settings, "db", "upgrade", "--json").stdout)
    assert out == {"revision": "0001"}


def test_flower_refuses_a_public_address_without_auth(settings):
    proc = run_cli(settings, "flower", "--address", "0.0.0.0", check=False)
    assert proc.returncode == 2 and "FLOWER_BASIC_AUTH" in proc.stderr

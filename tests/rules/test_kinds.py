"""Each operation kind's declaration (workflows/kinds/, docs/architecture.md: adding an
operation kind) agrees with its table, the worker's tasks and the SQL the indexes state: what
the catalog, the counts, retention, `wait` and the sweeper iterate is what the rest holds."""

import dataclasses
import importlib

import pytest
from sqlalchemy import inspect as sql_inspect

from agent_radar.models.operations import OPEN_OPERATION_SQL
from agent_radar.tasks.app import TASK_MODULES
from agent_radar.tasks.strict import TASK_NAMES
from agent_radar.workflows.kinds import KINDS, RESULT_TASKS, kind_of_record
from agent_radar.workflows.kinds.goal import OPEN_OPERATION_STATUSES

KIND_LIST = list(KINDS.values())


@pytest.mark.parametrize("kind", KIND_LIST, ids=[k.name for k in KIND_LIST])
def test_a_kinds_record_holds_its_tables_columns(kind):
    columns = {c.key for c in sql_inspect(kind.table).columns}
    fields = {f.name for f in dataclasses.fields(kind.record_type)}
    derived = {"settled", "intent_accepted"} | ({"status"} if "status" not in columns else set())
    assert fields - derived <= columns
    assert kind.key.key in fields and kind.key.key in columns
    assert kind_of_record(kind.record_type.__new__(kind.record_type)) is kind


@pytest.mark.parametrize("kind", KIND_LIST, ids=[k.name for k in KIND_LIST])
def test_a_kind_settles_and_is_republished_in_statuses_it_has(kind):
    assert set(kind.settled) <= set(kind.statuses)
    if kind.republish is not None:
        assert set(kind.republish.statuses) <= set(kind.statuses)
        assert not set(kind.republish.statuses) & set(kind.settled)
        assert kind.republish.kwarg == kind.key.key


@pytest.mark.parametrize("kind", KIND_LIST, ids=[k.name for k in KIND_LIST])
def test_a_kinds_tasks_are_the_workers_and_their_results_readable(kind):
    for module in TASK_MODULES:  # what a worker registers
        importlib.import_module(module)
    named = {*kind.public_tasks, *([kind.republish.task] if kind.republish else [])}
    assert named <= TASK_NAMES
    assert set(kind.public_tasks) <= set(RESULT_TASKS)


def test_the_open_operations_index_states_the_open_statuses():
    stated = ", ".join(f"'{status.value}'" for status in OPEN_OPERATION_STATUSES)
    assert OPEN_OPERATION_SQL == f"status IN ({stated})"


def test_the_cli_prints_a_kind_it_names_nowhere_by_its_declaration(monkeypatch):
    from types import SimpleNamespace

    from agent_radar.workflows.tools.cli import operators as op_cli

    column = lambda key: SimpleNamespace(key=key)  # noqa: E731
    note = SimpleNamespace(key=column("note_id"), created=column("noted_at"))
    monkeypatch.setitem(KINDS, "note", note)
    item = {"kind": "note", "note_id": "note-7", "noted_at": "2026-12-07T00:00:00"}
    item |= {"status": "queued", "workspace_id": "ws", "session_id": "s1"}
    assert "2026-12-07T00:00:00  note" in op_cli._line(item)
    assert "note-7  ws/s1  submit=-" in op_cli._line(item)


def test_the_host_kit_and_the_publisher_load_no_kind_and_no_sqlalchemy():
    """The kinds hold their tables: what a host in Python imports (the kit, its reports'
    publisher, the settings) stays below them."""
    import subprocess
    import sys

    code = (
        "import sys, agent_radar.host, agent_radar.workflows.adapters.publisher, "
        "agent_radar.workflows.adapters.config; "
        "print(sorted(m for m in ('sqlalchemy', 'agent_radar.workflows.kinds') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stderr

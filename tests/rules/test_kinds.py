"""Each operation kind's declaration (workflows/kinds/, docs/architecture.md: adding an
operation kind) agrees with its table, the worker's tasks and the SQL the indexes state: what
the catalog, the counts, retention, `wait` and the sweeper iterate is what the rest holds."""

import dataclasses
import importlib

import pytest
from sqlalchemy import inspect as sql_inspect

from agent_radar.models.tables import OPEN_OPERATION_SQL
from agent_radar.tasks.app import TASK_MODULES
from agent_radar.tasks.strict import TASK_NAMES
from agent_radar.workflows.kinds import KINDS, kind_of_record
from agent_radar.workflows.kinds.goal import OPEN_OPERATION_STATUSES
from agent_radar.workflows.task_names import RESULT_TASKS

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

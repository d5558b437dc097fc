"""The layering of docs/architecture.md, checked from the code's own imports (function-level
ones too): tools -> client -> steps -> rules -> adapters/models; the rules' concept folders
import only downward; `workflows/` never imports Celery; `tasks/` and `beat/` point at
`workflows/`, `tasks/` at `beat/`, never the reverse; and no module is over 400 lines."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The rules' concept folders, lowest first: each may import those before it, never after.
CONCEPTS = (
    "agent_radar.workflows.sessions",
    "agent_radar.workflows.maintenance",
    "agent_radar.workflows.prompts",
    "agent_radar.workflows.goals",
    "agent_radar.workflows.fences",
    "agent_radar.workflows.activity",
    "agent_radar.workflows.operators",
)
KERNEL = (
    "agent_radar.workflows.ids",
    "agent_radar.workflows.validation",
    "agent_radar.workflows.leases",
    "agent_radar.workflows.errors",
    "agent_radar.workflows.records",
    "agent_radar.workflows.budgets",
    "agent_radar.workflows.task_names",
    "agent_radar.workflows.kinds",
    "agent_radar.workflows.escape",
    "agent_radar.workflows.accept",
)
STEPS = ("agent_radar.workflows.steps",)
TOOLS = ("agent_radar.workflows.tools", "click")
CLIENT = ("agent_radar.workflows.client",)
MAX_MODULE_LINES = 400

# (modules it applies to, imports they must not make, why)
RULES = [
    (("agent_radar.workflows",), ("celery",), "the domain never imports Celery"),
    (
        (*CONCEPTS, *KERNEL),
        (*TOOLS, *CLIENT, *STEPS),
        "rules never import a tool, the client or a step",
    ),
    (KERNEL, CONCEPTS, "the kernel sits below the concepts"),
    (
        ("agent_radar.workflows.adapters",),
        (*CONCEPTS, *STEPS, *TOOLS, *CLIENT),
        "adapters sit below the rules",
    ),
    (STEPS, (*TOOLS, *CLIENT), "steps sit below the client"),
    (CLIENT, TOOLS, "the client sits below the tools"),
    (
        ("agent_radar.models",),
        ("agent_radar.workflows", "agent_radar.tasks", "agent_radar.beat", "celery"),
        "models are the bottom floor",
    ),
    (("agent_radar.beat",), ("agent_radar.tasks",), "tasks/ imports beat/, not the reverse"),
    # The distribution's one import name (docs/packaging.md): a service beside it has its
    # own `models` and `tasks`.
    (
        ("agent_radar", "tests"),
        ("models", "workflows", "tasks", "beat"),
        "everything is imported as agent_radar.…",
    ),
] + [
    ((concept,), CONCEPTS[i + 1 :], "concept folders import only downward")
    for i, concept in enumerate(CONCEPTS)
    if CONCEPTS[i + 1 :]
]


def module_name(path: Path) -> str:
    """The module's import name: the product's folders are `agent_radar.<folder>`. A package
    keeps its `.__init__`, so a relative import resolves the same way in every file."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[0] not in ("tests", "agent_radar"):
        parts = ("agent_radar", *parts)
    return ".".join(parts)


def imports_of(source: str, module: str) -> set[str]:
    """Every module a source imports, at any depth of the code."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the module's package
                base = module.split(".")[: -node.level]  # a package is `<name>.__init__`
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            found.add(name)
            found.update(f"{name}.{alias.name}" for alias in node.names)
    return found


def within(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def violations(modules: dict[str, str]) -> list[str]:
    found = []
    for module, source in sorted(modules.items()):
        imported = imports_of(source, module)
        for scope, forbidden, why in RULES:
            if not within(module, scope):
                continue
            for name in sorted(imported):
                if within(name, forbidden):
                    found.append(f"{module} imports {name}: {why}")
    return found


def project_modules() -> dict[str, str]:
    modules = {}
    for top in ("workflows", "models", "tasks", "beat"):
        for path in (ROOT / top).rglob("*.py"):
            if "migrations" not in path.parts:
                modules[module_name(path)] = path.read_text()
    return modules


def test_modules_and_tests_import_the_product_by_its_one_name():
    """Migrations and tests too: a bare `models` or `tasks` would be a service's own."""
    paths = [ROOT / "agent_radar" / "__init__.py"] + [
        path
        for top in ("workflows", "models", "tasks", "beat", "tests")
        for path in (ROOT / top).rglob("*.py")
    ]
    sources = {module_name(path): path.read_text() for path in paths}
    assert len(sources) > 100
    bare = ("models", "workflows", "tasks", "beat")
    assert [
        f"{module} imports {name}"
        for module, source in sorted(sources.items())
        for name in sorted(imports_of(source, module))
        if within(name, bare)
    ] == []


def test_the_product_imports_itself_relatively():
    """One way to import each module, and one a tool that follows imports through the files
    can see: inside the product's folders, `from ..models import tables`, never
    `agent_radar.models.tables`, which resolves only through the links (docs/packaging.md).
    Migrations are the exception: Alembic loads them by path, not as package modules."""
    absolute = []
    for name, source in project_modules().items():
        for node in ast.walk(ast.parse(source)):
            spelled = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                spelled = [node.module or ""]
            absolute += [f"{name}: {s}" for s in spelled if within(s, ("agent_radar",))]
    assert absolute == []


def test_the_layers_point_one_way():
    modules = project_modules()
    assert len(modules) > 40
    assert violations(modules) == []


@pytest.mark.parametrize(
    "module, source",
    [
        ("agent_radar.workflows.steps.goals.dispatch", "from celery import shared_task"),
        ("agent_radar.workflows.steps.fence_apply", "def f():\n    import click\n"),
        ("agent_radar.workflows.prompts.queue", "from agent_radar.workflows.tools.cli import cli"),
        ("agent_radar.workflows.maintenance.runs", "from ..tools import demo"),
        (
            "agent_radar.workflows.adapters.runtime",
            "from agent_radar.workflows.steps import goal_dispatch",
        ),
        ("agent_radar.workflows.validation", "from agent_radar.workflows.sessions import rows"),
        ("agent_radar.models.tables", "import agent_radar.workflows.errors"),
        ("agent_radar.beat.sweeper", "from agent_radar.tasks.strict import strict_task"),
        ("agent_radar.workflows.client.base", "from models.tables import GoalOperation"),
    ],
)
def test_the_check_catches_a_wrong_import(module, source):
    assert violations({module: source}), f"{source!r} in {module} passed"


# What a state machine's rows hold (workflows/transitions.py): only rules write them.
STATE_COLUMNS = {"status", "phase", "provider_phase", "sync_status"}
SQL_WRITES = {"update", "insert", "delete"}


def role_violations(name: str, source: str) -> list[str]:
    """A step (or the sweeper) that writes by itself: an UPDATE, INSERT or DELETE of its own,
    or a state column set on a row. Rules own every write and every transition; steps act."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sqlalchemy"):
            found += [f"{name} imports {a.name}" for a in node.names if a.name in SQL_WRITES]
        targets = node.targets if isinstance(node, ast.Assign) else []
        for target in targets:
            for one in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(one, ast.Attribute) and one.attr in STATE_COLUMNS:
                    found.append(f"{name} sets .{one.attr}")
    return found


def test_steps_and_the_sweeper_leave_writes_to_the_rules():
    acting = ("agent_radar.workflows.steps", "agent_radar.beat")
    found = [
        violation
        for name, source in project_modules().items()
        if within(name, acting)
        for violation in role_violations(name, source)
    ]
    assert found == []


@pytest.mark.parametrize(
    "source",
    [
        "from sqlalchemy import update",
        "def f(row):\n    row.status = 'completed'",
        "def f(state):\n    state.observed, state.sync_status = 1, 2",
    ],
)
def test_the_role_check_catches_a_step_that_writes(source):
    assert role_violations("agent_radar.workflows.steps.x", source)


# A measurement's before and after, or a rate: what docs/benchmarks.md holds, not a comment.
MEASURED = re.compile(r"\d ?(→|->) ?\d|\d+ ?(ops|operations|tasks|no-ops)/s")


def test_comments_hold_no_measurements():
    """Figures go stale where nobody measures them again: a comment or docstring cites
    docs/benchmarks.md (its section of figures the code rests on) instead. The bench, which
    prints what it measures, is the exception."""
    found = [
        f"{name}:{number}: {line.strip()}"
        for name, source in project_modules().items()
        if not within(name, ("agent_radar.workflows.tools.bench",))
        for number, line in enumerate(source.splitlines(), 1)
        if MEASURED.search(line)
    ]
    assert found == []


def test_no_module_is_over_400_lines():
    """A module a reader can hold in their head; past that, it is two concepts."""
    long = {
        name: lines
        for name, source in project_modules().items()
        if (lines := len(source.splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}


def test_concept_folders_stay_small():
    """A reader should find each concept's room without scrolling (issue: rooms by concept)."""
    for folder in [
        p for p in (ROOT / "workflows").rglob("*") if p.is_dir() and p.name != "__pycache__"
    ] + [ROOT / "workflows"]:
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        assert len(modules) <= 12, f"{folder.relative_to(ROOT)} has {len(modules)} modules"

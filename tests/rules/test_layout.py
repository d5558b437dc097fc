"""The layering of docs/architecture.md, checked from the code's own imports (function-level
ones too): tools -> client -> steps -> rules -> adapters/models; the rules' concept folders
import only downward; `workflows/` never imports Celery; `tasks/` and `beat/` point at
`workflows/`, `tasks/` at `beat/`, never the reverse; and no module is over 400 lines."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The rules' concept folders, lowest first: each may import those before it, never after.
CONCEPTS = (
    "workflows.sessions",
    "workflows.maintenance",
    "workflows.prompts",
    "workflows.fences",
    "workflows.goals",
    "workflows.activity",
    "workflows.operators",
)
KERNEL = (
    "workflows.ids",
    "workflows.validation",
    "workflows.leases",
    "workflows.errors",
    "workflows.records",
    "workflows.budgets",
    "workflows.task_names",
    "workflows.escape",
    "workflows.accept",
)
STEPS = ("workflows.steps",)
TOOLS = ("workflows.tools", "click")
CLIENT = ("workflows.client",)
MAX_MODULE_LINES = 400

# (modules it applies to, imports they must not make, why)
RULES = [
    (("workflows",), ("celery",), "the domain never imports Celery"),
    (
        (*CONCEPTS, *KERNEL),
        (*TOOLS, *CLIENT, *STEPS),
        "rules never import a tool, the client or a step",
    ),
    (KERNEL, CONCEPTS, "the kernel sits below the concepts"),
    (
        ("workflows.adapters",),
        (*CONCEPTS, *STEPS, *TOOLS, *CLIENT),
        "adapters sit below the rules",
    ),
    (STEPS, (*TOOLS, *CLIENT), "steps sit below the client"),
    (CLIENT, TOOLS, "the client sits below the tools"),
    (("models",), ("workflows", "tasks", "beat", "celery"), "models are the bottom floor"),
    (("beat",), ("tasks",), "tasks/ imports beat/, not the reverse"),
] + [
    ((concept,), CONCEPTS[i + 1 :], "concept folders import only downward")
    for i, concept in enumerate(CONCEPTS)
    if CONCEPTS[i + 1 :]
]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, module: str) -> set[str]:
    """Every module a source imports, at any depth of the code."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the module's package
                base = module.split(".")[: -node.level]
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


def test_the_layers_point_one_way():
    modules = project_modules()
    assert len(modules) > 40
    assert violations(modules) == []


@pytest.mark.parametrize(
    "module, source",
    [
        ("workflows.steps.goals.dispatch", "from celery import shared_task"),
        ("workflows.steps.fence_apply", "def f():\n    import click\n"),
        ("workflows.prompts.queue", "from workflows.tools.cli import cli"),
        ("workflows.maintenance.runs", "from ..tools import demo"),
        ("workflows.adapters.runtime", "from workflows.steps import goal_dispatch"),
        ("workflows.validation", "from workflows.sessions import rows"),
        ("models.tables", "import workflows.errors"),
        ("beat.sweeper", "from tasks.strict import strict_task"),
    ],
)
def test_the_check_catches_a_wrong_import(module, source):
    assert violations({module: source}), f"{source!r} in {module} passed"


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

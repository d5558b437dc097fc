"""The docs stay true where a test can tell: every `agent-radar …` command they name exists
with the options they give it, every client call docs/client.md shows exists with the
keywords it gives it (and every call is there), every file they link to exists, no code cites
a design document the repository does not ship, and the README stays a guide (≤ 300 lines)."""

import re
import subprocess
from pathlib import Path

import click

from agent_radar.workflows.tools.cli import cli

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "deploy" / "README.md"] + sorted(
    (ROOT / "docs").glob("*.md")
)
COMMAND = re.compile(r"`agent-radar ([^`]*)`")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _alternatives(word: str) -> list[str]:
    """`show|find|list` names three commands; `failed|completed` three values."""
    return word.split("|")


def _check(words: list[str]) -> list[str]:
    """What is wrong with `agent-radar WORDS` (placeholders and values are not checked)."""
    command: click.Command = cli
    words = list(words)
    while isinstance(command, click.Group) and words and not words[0].startswith("-"):
        names = _alternatives(words.pop(0))
        subs = [command.get_command(click.Context(command), n) for n in names]
        if None in subs:
            return [f"{names} is not a command of {command.name}"]
        for sub in subs[1:]:
            if isinstance(sub, click.Group):
                return [f"{names}: only the last word may be alternatives"]
        command = subs[0]
        if len(subs) > 1:  # alternatives are leaves: their options are not checked
            return []
    options = {o for p in command.params for o in getattr(p, "opts", [])}
    return [
        f"{command.name} has no option {w.split('=')[0]}"
        for w in words
        if w.startswith("-") and w.split("=")[0] not in options
    ]


def test_every_command_the_docs_name_exists_with_its_options():
    named = {
        (doc.relative_to(ROOT).as_posix(), m.group(1))
        for doc in DOCS
        for m in COMMAND.finditer(doc.read_text())
    }
    assert len(named) > 20
    wrong = {(doc, line): _check(line.split()) for doc, line in named}
    assert {k: v for k, v in wrong.items() if v} == {}


# A client call as docs/client.md shows it: `name(` then its arguments up to the closing paren.
CALL = re.compile(r"`([a-z_]+)\(([^`]*)\)`")


def _call_problems(name: str, shown: str) -> list[str]:
    """What is wrong with `name(shown)` as a call of AgentRadar: no such method, or a keyword
    argument it does not take."""
    import inspect

    from agent_radar import AgentRadar

    method = getattr(AgentRadar, name, None)
    if method is None or name.startswith("_"):
        return [f"AgentRadar has no {name}"]
    takes = set(inspect.signature(method).parameters)
    return [
        f"{name} takes no {word}" for word in re.findall(r"([a-z_]+)=", shown) if word not in takes
    ]


def test_every_client_call_docs_client_md_shows_exists_and_every_one_is_there():
    text = (ROOT / "docs" / "client.md").read_text()
    shown = [(m.group(1), m.group(2)) for m in CALL.finditer(text)]
    assert len(shown) > 20
    wrong = {name: _call_problems(name, args) for name, args in shown}
    assert {k: v for k, v in wrong.items() if v} == {}
    from agent_radar import AgentRadar

    public = {
        n for n in dir(AgentRadar) if not n.startswith("_") and callable(getattr(AgentRadar, n))
    }
    named = set(re.findall(r"`([a-z_]+)[(`]", text)) | {n for n, _ in shown}
    assert (
        public - named - {"receive_report", "goal_control", "from_env", "list_goal_operations"}
        == set()
    )
    assert _call_problems("wait", "record, deadline=3") == ["wait takes no deadline"]


def test_the_check_catches_a_command_that_is_not_there():
    assert _check(["op", "launch"])
    assert _check(["op", "list", "--colour", "red"])
    assert _check(["goal", "set|frobnicate"])
    assert _check(["op", "list", "--since", "1h"]) == []


def test_every_file_the_docs_link_exists():
    missing = [
        f"{doc.relative_to(ROOT)} -> {target}"
        for doc in DOCS
        for target in LINK.findall(doc.read_text())
        if "://" not in target and not (doc.parent / target).exists()
    ]
    assert missing == []


def test_no_code_cites_a_design_document_the_repository_does_not_ship():
    files = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    citing = [
        f
        for f in files
        if re.search(r"\bDESIGN\b|\.\./shared|DESIGN\.md", (ROOT / f).read_text())
        and f != "tests/tools/test_docs.py"
    ]
    assert citing == []
    docs = [d.relative_to(ROOT).as_posix() for d in DOCS if "DESIGN" in d.read_text()]
    assert docs == []


def test_the_readme_is_a_guide():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def test_the_node_signing_snippet_of_the_protocol_signs_as_the_control_plane_checks():
    """docs/protocol.md's Node code, run as a Node host would run it: its signature of the
    test vector and of a report with non-ASCII text is the one the control plane computes."""
    import json
    import shutil

    from agent_radar.workflows.adapters import report_auth
    from tests.conftest import skip_or_fail

    node = shutil.which("node")
    if node is None:
        skip_or_fail("node is not installed")
    text = (ROOT / "docs" / "protocol.md").read_text()
    snippet = re.search(r"In Node:\n\n```js\n(.*?)```", text, re.S).group(1)
    reports = [
        {
            "workspace_id": "acme",
            "session_id": "s1",
            "occurred_at_ms": 1764770000000,
            "turn": {"turn_id": "t-17", "phase": "running", "origin": "user_prompt"},
            "session": {"live": True},
        },
        {
            "workspace_id": "wß",
            "session_id": "s\u202e\U0001f600",
            "occurred_at_ms": 1,
            "goal_applied": {
                "operation_id": "o",
                "revision": 2,
                "goal": {"objective": 'naïve\n"x"\t\x01', "status": None, "b": [1, {}]},
            },
        },
    ]
    program = snippet + (
        "const reports = JSON.parse(process.argv[1]);\n"
        "console.log(JSON.stringify(reports.map((r) => sign(r, 'gpu-2', 'gpu-2-secret'))));\n"
    )
    out = subprocess.run(
        [node, "-e", program, json.dumps(reports)], capture_output=True, text=True, check=True
    ).stdout
    signed = json.loads(out)
    for report, by_node in zip(reports, signed, strict=True):
        assert by_node == report_auth.sign(report, "gpu-2", "gpu-2-secret")
    assert signed[0]["signature"] == (
        "0116a232a4b40d36109b21593792a8ee1b96a9761c535a580c66c5d52e603626"
    )

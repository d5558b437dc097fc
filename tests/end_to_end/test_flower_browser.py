"""Flower in a real browser (docs/operations.md: Flower): `agent-radar flower`'s task list, as
headless Chromium renders it, names the workspace, session and client submit ID of each row
and what came of it (a dispatched prompt, a refused fence, a rejected report), and the
housekeeping that did nothing — reports that only say a session is busy or idle, prompt
dispatches that find nothing queued — adds no row: a screenshot of the list before a burst of
it is the same, pixel for pixel, as one after it; one real operation more changes it."""

import base64
import json
import os
import shutil
import subprocess
import time
import urllib.request
import zlib
from pathlib import Path

import pytest

from agent_radar.workflows.adapters.publisher import TaskPublisher
from agent_radar.workflows.kinds.fence import FENCE_TASK
from agent_radar.workflows.kinds.goal import DISPATCH_TASK
from agent_radar.workflows.task_names import PROMPT_TASK, REPORT_ACTIVITY_TASK
from agent_radar.workflows.tools.stack import free_port
from tests.conftest import skip_or_fail
from tests.helpers import eventually

WS = "ws-shot"
AUTH = ("radar", "Flower-test-9f3k2")
HOUSEKEEPING = 12


@pytest.fixture
def backend():
    return "production"


def _chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    skip_or_fail("no chromium on PATH (Debian: apt-get install chromium)")
    raise AssertionError("unreachable")


class Flower:
    def __init__(self, stack) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = stack.spawn(
            "flower",
            ["flower", "--port", str(self.port)],
            extra_env={"FLOWER_BASIC_AUTH": ":".join(AUTH)},
        )

    def api(self, path: str):
        request = urllib.request.Request(self.base + path)
        token = base64.b64encode(":".join(AUTH).encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
        with urllib.request.urlopen(request, timeout=10) as answer:
            return json.load(answer)

    def tasks(self) -> list[dict]:
        return list(self.api("/api/tasks").values())

    def sees_a_worker(self) -> bool:
        try:
            return bool(self.api("/api/workers?refresh=1"))
        except OSError:
            return False

    def totals(self) -> dict[str, int]:
        """How many messages of each task the workers ran, events or none (Celery's stats)."""
        totals: dict[str, int] = {}
        for worker in self.api("/api/workers?refresh=1").values():
            for name, count in worker.get("stats", {}).get("total", {}).items():
                totals[name] = totals.get(name, 0) + count
        return totals

    def processed(self, task_name: str) -> int:
        return self.totals().get(task_name, 0)


class Browser:
    def __init__(self, tmp: Path, url: str) -> None:
        self.binary = _chromium()
        self.tmp = tmp
        # Chromium takes the credentials of the address for the page and its requests.
        self.url = url.replace("http://", f"http://{AUTH[0]}:{AUTH[1]}@") + "/tasks"

    def _run(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                self.binary,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                "--window-size=1920,1080",
                f"--user-data-dir={self.tmp / 'profile'}",
                # time for the page's own request for the task list
                "--virtual-time-budget=5000",
                *args,
                self.url,
            ],
            capture_output=True,
            timeout=120,
            check=True,
        )

    def dom(self) -> str:
        dom = self._run("--dump-dom").stdout.decode()
        (self.tmp / "dom.html").write_text(dom)
        return dom

    def screenshot(self, name: str) -> Path:
        path = self.tmp / name
        self._run(f"--screenshot={path}")
        assert path.stat().st_size > 0
        return path


# The task list's part of the page (the search box down), in pixels from the top: above it,
# the filter buttons' transitions may be caught at different frames.
TABLE_TOP_PX = 220


def pixels(png: Path) -> bytes:
    """The task list's rows of pixels in a screenshot (PNG data inflated, filter bytes kept)."""
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{png} is not a PNG"
    at, width, height, depth, idat = 8, 0, 0, 0, b""
    while at < len(data):
        length = int.from_bytes(data[at : at + 4], "big")
        kind, body = data[at + 4 : at + 8], data[at + 8 : at + 8 + length]
        if kind == b"IHDR":
            width, height = int.from_bytes(body[:4], "big"), int.from_bytes(body[4:8], "big")
            depth = {2: 3, 6: 4}[body[9]]  # RGB or RGBA, 8 bits a channel
        elif kind == b"IDAT":
            idat += body
        at += 12 + length
    raw = zlib.decompress(idat)
    stride = width * depth + 1
    assert len(raw) == stride * height, "a PNG this test does not read"
    return raw[TABLE_TOP_PX * stride :]


def _quiet(flower: Flower) -> bool:
    """No message run for a while (Celery's per-task counts stand still)."""
    first = flower.totals()
    time.sleep(1.5)
    return flower.totals() == first


def rows(dom: str, task_name: str) -> int:
    return dom.count(f">{task_name}</a>")


def test_flower_task_list_in_a_browser(settings, client, stack, tmp_path):
    flower = Flower(stack)
    # Each goal by its dispatch message (a worker that pulls sends none: docs/dispatch.md).
    stack.start_worker(concurrency=1, extra_env={"AGENT_RADAR_PULL": "false"})
    eventually(flower.sees_a_worker, 60, what="Flower to see the worker")
    publisher = TaskPublisher(settings)
    try:
        op = client.set_goal(WS, "s1", "watched", client_submit_id="req-shot-1")
        assert client.wait(op, timeout=60).status == "completed"
        prompt = client.submit_prompt(WS, "s1", "hello", client_submit_id="p-shot-1")
        eventually(
            lambda: client.get_prompt(prompt.prompt_id).status == "completed", 60, what="prompt"
        )
        # A producer's fence naming no generation of the session: refused, FAILURE.
        publisher.publish(
            FENCE_TASK,
            {
                "workspace_id": WS,
                "session_id": "s1",
                "target_operation_id": "no-such-operation",
                "client_submit_id": "f-shot-bad",
            },
        )
        # A report an agent host got wrong: rejected, and shown as a failure.
        publisher.publish(REPORT_ACTIVITY_TASK, {"report": {"workspace_id": WS}})

        wanted = {
            (DISPATCH_TASK, "SUCCESS"),
            (PROMPT_TASK, "SUCCESS"),
            (FENCE_TASK, "FAILURE"),
            (REPORT_ACTIVITY_TASK, "FAILURE"),
        }

        def missing() -> set:
            return wanted - {(t["name"], t["state"]) for t in flower.tasks()}

        try:
            eventually(lambda: not missing(), 60, what="the rows in Flower")
        except AssertionError:
            raise AssertionError(f"rows Flower never showed: {missing()}") from None
        # Every report the simulator sent (each turn's start and end, two turns) has run,
        # and the worker has gone quiet.
        eventually(lambda: flower.processed(REPORT_ACTIVITY_TASK) >= 5, 60, what="the reports")
        eventually(lambda: _quiet(flower), 60, what="the worker to go quiet")

        browser = Browser(tmp_path, flower.base)
        dom = browser.dom()
        # Each row names what it is about, and what came of it.
        assert f"[{WS}/s1 submit=req-shot-1]" in dom and "{'in_flight': [" in dom
        # The prompt went out in whichever dispatch found the session idle first: the
        # client's (labelled with the submit ID) or the one the end of the goal's turn woke.
        assert f"[{WS}/s1" in dom and "'dispatched'" in dom
        # A producer's message is labelled as the product's own are.
        assert f"[{WS}/s1 submit=f-shot-bad] {{'workspace_id'" in dom and "FAILURE" in dom
        assert "OperationRefused('not_found', 'no goal operation no-such-operation" in dom
        assert "Rejected('occurred_at_ms must be an integer" in dom
        # Only the rejected report has a row; the simulator's own (busy, idle) have none,
        # nor have the prompt dispatches that found nothing to send.
        assert rows(dom, REPORT_ACTIVITY_TASK) == 1
        assert rows(dom, PROMPT_TASK) == 1
        before = browser.screenshot("before.png")

        ran = flower.processed(PROMPT_TASK), flower.processed(REPORT_ACTIVITY_TASK)
        for _ in range(HOUSEKEEPING):
            publisher.publish(PROMPT_TASK, {"workspace_id": WS, "session_id": "s1"})
            publisher.publish(
                REPORT_ACTIVITY_TASK,
                {
                    "report": {
                        "workspace_id": WS,
                        "session_id": "s1",
                        "occurred_at_ms": int(time.time() * 1000),
                    }
                },
            )
        eventually(
            lambda: (
                (flower.processed(PROMPT_TASK), flower.processed(REPORT_ACTIVITY_TASK))
                >= (ran[0] + HOUSEKEEPING, ran[1] + HOUSEKEEPING)
            ),
            60,
            what="the housekeeping run",
        )
        after = browser.screenshot("after.png")
        assert pixels(after) == pixels(before), "housekeeping changed Flower's task list"

        # The comparison sees a change: one more operation is a new row.
        op2 = client.set_goal(WS, "s2", "seen", client_submit_id="req-shot-2")
        assert client.wait(op2, timeout=60).status == "completed"
        eventually(
            lambda: any("req-shot-2" in (t.get("kwargs") or "") for t in flower.tasks()),
            60,
            what="the second goal's row",
        )
        assert pixels(browser.screenshot("changed.png")) != pixels(before)
        assert "[ws-shot/s2 submit=req-shot-2]" in browser.dom()
        if os.environ.get("AGENT_RADAR_KEEP_SCREENSHOTS"):
            shutil.copy(before, os.environ["AGENT_RADAR_KEEP_SCREENSHOTS"])
    finally:
        publisher.close()

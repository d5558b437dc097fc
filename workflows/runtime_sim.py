"""`agent-radar runtime-sim`: an agent host speaking the runtime protocol (DESIGN 6).

It keeps sessions in memory, dedupes goal calls by operation id, rejects stale revisions,
records every effect it applied (`GET /sim/effects`) and every call it received
(`GET /sim/calls`), and reports through `agent_radar.report_activity`. Control endpoints
under `/sim/` take sessions offline or online, inject failures and latency, and switch a
session to acknowledging goals (`accepted`) and applying them later.
"""

import json
import logging
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote

log = logging.getLogger(__name__)

SESSION_PATH = re.compile(r"^/v1/workspaces/([^/]+)/sessions/([^/]+)/(liveness|resume|goal)$")
Reporter = Callable[[dict[str, Any]], Any]


class SimError(Exception):
    def __init__(self, status: int, code: str, **extra: Any) -> None:
        super().__init__(code)
        self.status, self.code, self.extra = status, code, extra


@dataclass
class SimSession:
    live: bool = True
    epoch: int = 1
    missing: bool = False
    goal: dict | None = None
    applied_revision: int = 0
    goal_mode: str = "applied"  # or "accepted": acknowledge now, apply after apply_delay_ms
    apply_delay_ms: int = 100
    fences: set = field(default_factory=set)


@dataclass
class Fault:
    call: str  # liveness, resume, goal or * for any
    status: int
    code: str
    remaining: int
    workspace_id: str | None = None
    session_id: str | None = None


class Simulator:
    def __init__(self, reporter: Reporter | None = None) -> None:
        self.lock = threading.RLock()
        self.reporter = reporter
        self.reset()

    def reset(self) -> None:
        with self.lock:
            self.sessions: dict[tuple[str, str], SimSession] = {}
            self.answers: dict[str, dict] = {}
            self.effects: list[dict] = []
            self.calls: list[dict] = []
            self.faults: list[Fault] = []
            self.latency_ms: dict[str, int] = {}

    def session(self, ws: str, sid: str) -> SimSession:
        return self.sessions.setdefault((ws, sid), SimSession())

    # -- protocol --------------------------------------------------------------------------
    def handle(self, call: str, ws: str, sid: str, body: dict) -> dict:
        with self.lock:
            self.calls.append({"call": call, "workspace_id": ws, "session_id": sid,
                               "operation_id": body.get("operation_id"), "at": time.time()})
            self._inject_fault(call, ws, sid)
            delay_ms = self.latency_ms.get(call, 0)
        if delay_ms:
            time.sleep(delay_ms / 1000)
        with self.lock:
            sess = self.session(ws, sid)
            if sess.missing:
                raise SimError(404, "session_not_found")
            if call == "liveness":
                return {"live": sess.live, "runtime_epoch": sess.epoch}
            if call == "resume":
                return self._resume(ws, sid, sess, body)
            return self._goal(ws, sid, sess, body)

    def _inject_fault(self, call: str, ws: str, sid: str) -> None:
        for fault in self.faults:
            if fault.remaining > 0 and fault.call in (call, "*") and (
                    fault.workspace_id in (None, ws)) and fault.session_id in (None, sid):
                fault.remaining -= 1
                raise SimError(fault.status, fault.code)

    def _resume(self, ws: str, sid: str, sess: SimSession, body: dict) -> dict:
        fences = body.get("fences") or []
        if not sess.live:
            sess.live = True
            sess.epoch += 1
            self.effects.append({"kind": "resume", "workspace_id": ws, "session_id": sid,
                                 "fences": fences, "runtime_epoch": sess.epoch})
        sess.fences |= {(f["target_operation_id"], f["target_revision"]) for f in fences}
        return {"live": True, "runtime_epoch": sess.epoch}

    def _goal(self, ws: str, sid: str, sess: SimSession, body: dict) -> dict:
        op_id, revision = body["operation_id"], int(body["revision"])
        if not sess.live:
            raise SimError(409, "disconnected")
        if op_id in self.answers:
            return self.answers[op_id]  # a retry: same answer, no second effect
        if (op_id, revision) in sess.fences:
            raise SimError(422, "rejected", detail="fenced generation")
        if revision <= sess.applied_revision:
            raise SimError(409, "stale_revision", current_revision=sess.applied_revision)
        if sess.goal_mode == "accepted":
            answer = {"phase": "accepted", "goal": None, "evidence": {"acknowledged": True}}
            self.answers[op_id] = answer
            timer = threading.Timer(sess.apply_delay_ms / 1000, self._apply_later,
                                    args=(ws, sid, body))
            timer.daemon = True
            timer.start()
            return answer
        goal = self._apply(ws, sid, sess, body)
        answer = {"phase": "applied", "goal": goal, "evidence": {"applied_revision": revision}}
        self.answers[op_id] = answer
        return answer

    def _apply(self, ws: str, sid: str, sess: SimSession, body: dict) -> dict | None:
        action, revision = body["action"], int(body["revision"])
        if action == "set":
            sess.goal = {"objective": body["objective"], "status": "active"}
        elif action == "clear":
            sess.goal = None
        elif sess.goal is not None:
            sess.goal = {**sess.goal, "status": "paused" if action == "pause" else "active"}
        sess.applied_revision = revision
        self.effects.append({"kind": "goal", "workspace_id": ws, "session_id": sid,
                             "operation_id": body["operation_id"], "action": action,
                             "revision": revision, "objective": body.get("objective"),
                             "at": time.time()})
        return sess.goal

    def _apply_later(self, ws: str, sid: str, body: dict) -> None:
        with self.lock:
            sess = self.session(ws, sid)
            if int(body["revision"]) <= sess.applied_revision:
                return  # a newer revision got there first; this one is stale now
            goal = self._apply(ws, sid, sess, body)
        self.report({"workspace_id": ws, "session_id": sid,
                     "occurred_at_ms": int(time.time() * 1000),
                     "goal_applied": {"operation_id": body["operation_id"],
                                      "revision": int(body["revision"]), "goal": goal}})

    def report(self, report: dict) -> None:
        if self.reporter is None:
            return
        try:
            self.reporter(report)
        except Exception:  # noqa: BLE001 - an agent host keeps running if reporting fails
            log.exception("runtime-sim: report failed")

    # -- control ---------------------------------------------------------------------------
    def control(self, path: str, body: dict) -> dict:
        with self.lock:
            if path == "/sim/reset":
                self.reset()
                return {}
            match = re.match(r"^/sim/sessions/([^/]+)/([^/]+)$", path)
            if match:
                sess = self.session(unquote(match[1]), unquote(match[2]))
                for key in ("live", "missing", "goal_mode", "apply_delay_ms"):
                    if key in body:
                        setattr(sess, key, body[key])
                return {"live": sess.live, "runtime_epoch": sess.epoch,
                        "goal": sess.goal, "applied_revision": sess.applied_revision}
            if path == "/sim/faults":
                self.faults.append(Fault(call=body.get("call", "*"),
                                         status=int(body.get("status", 503)),
                                         code=body.get("error", "server_error"),
                                         remaining=int(body.get("count", 1)),
                                         workspace_id=body.get("workspace_id"),
                                         session_id=body.get("session_id")))
                return {}
            if path == "/sim/latency":
                self.latency_ms[body["call"]] = int(body["ms"])
                return {}
        raise SimError(404, "not_found")

    def snapshot(self, path: str) -> dict:
        with self.lock:
            if path == "/sim/effects":
                return {"effects": list(self.effects)}
            if path == "/sim/calls":
                return {"calls": list(self.calls)}
            if path == "/sim/health":
                return {"ok": True}
        raise SimError(404, "not_found")


def make_handler(sim: Simulator, token: str | None):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self):
            super().setup()
            # Headers and body go out as separate writes; without TCP_NODELAY the second
            # waits for the peer's delayed ACK (~40 ms per call).
            self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def log_message(self, fmt, *args):  # quiet: the demo prints its own timeline
            log.debug("runtime-sim: " + fmt, *args)

        def _send(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> dict:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            return json.loads(raw) if raw else {}

        def _dispatch(self, method: str) -> None:
            try:
                body = self._body() if method == "POST" else {}
                path = self.path.split("?", 1)[0]
                if path.startswith("/sim/"):
                    result = sim.snapshot(path) if method == "GET" else sim.control(path, body)
                    return self._send(200, result)
                if token and self.headers.get("Authorization") != f"Bearer {token}":
                    return self._send(401, {"error": "unauthorized"})
                match = SESSION_PATH.match(path)
                expected = "GET" if match and match[3] == "liveness" else "POST"
                if not match or method != expected:
                    return self._send(404, {"error": "not_found"})
                self._send(200, sim.handle(match[3], unquote(match[1]), unquote(match[2]), body))
            except SimError as exc:
                self._send(exc.status, {"error": exc.code, **exc.extra})
            except (ValueError, KeyError, TypeError) as exc:
                self._send(422, {"error": "rejected", "detail": f"bad request: {exc}"})

        def do_GET(self):
            self._dispatch("GET")

        def do_POST(self):
            self._dispatch("POST")
    return Handler


class SimServer:
    """The simulator on a real socket, in a background thread (or in the foreground)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 8765, token: str | None = None,
                 reporter: Reporter | None = None) -> None:
        self.sim = Simulator(reporter)
        self.httpd = ThreadingHTTPServer((host, port), make_handler(self.sim, token))
        self.httpd.daemon_threads = True
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "SimServer":
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True,
                                       name="runtime-sim")
        self.thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class SimControl:
    """Client of the simulator's `/sim/` endpoints, for the demo, the tests and the bench."""

    def __init__(self, url: str) -> None:
        from workflows.runtime import HttpRuntime
        self.http = HttpRuntime(url, timeout_s=10.0)

    def session(self, ws: str, sid: str, **settings: Any) -> dict:
        from urllib.parse import quote
        path = f"/sim/sessions/{quote(ws, safe='')}/{quote(sid, safe='')}"
        return self.http.request("POST", path, settings)

    def fault(self, call: str = "*", *, status: int = 503, error: str = "server_error",
              count: int = 1, workspace_id: str | None = None, session_id: str | None = None):
        return self.http.request("POST", "/sim/faults", {
            "call": call, "status": status, "error": error, "count": count,
            "workspace_id": workspace_id, "session_id": session_id})

    def latency(self, call: str, ms: int) -> dict:
        return self.http.request("POST", "/sim/latency", {"call": call, "ms": ms})

    def effects(self, kind: str | None = "goal") -> list[dict]:
        effects = self.http.request("GET", "/sim/effects")["effects"]
        return [e for e in effects if kind is None or e["kind"] == kind]

    def calls(self, call: str | None = None) -> list[dict]:
        calls = self.http.request("GET", "/sim/calls")["calls"]
        return [c for c in calls if call is None or c["call"] == call]

    def reset(self) -> None:
        self.http.request("POST", "/sim/reset", {})

    def healthy(self) -> bool:
        try:
            return bool(self.http.request("GET", "/sim/health").get("ok"))
        except Exception:  # noqa: BLE001 - not up yet
            return False

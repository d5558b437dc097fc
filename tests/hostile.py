"""Hostile peers for the tests: an agent host on a real socket that answers each session as
told, a raw socket that answers each request as scripted (or never), and raw broker messages
published the way any producer (or attacker) with broker access could. Shared by the rules,
end-to-end and campaign tests."""

import json
import re
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote

from agent_radar.workflows.adapters.broker import broker_connection, queue_named
from tests.helpers import STOP_POLL_S

SESSION = re.compile(r"^/v1/workspaces/([^/]+)/sessions/([^/]+)/(.+)$")

# A state answer (docs/protocol.md: session state): live at epoch 1, running nothing.
IDLE_STATE = b'{"live": true, "runtime_epoch": 1, "goal": null, "fences": [], "turns": []}'


class HostileHost:
    """An agent host on a real socket that answers each session as told: `answers[sid]` is
    (status, raw body bytes) or a callable of the request body returning that."""

    def __init__(self) -> None:
        self.answers: dict[str, object] = {}
        # (session id, Authorization header or None) of every call, in order.
        self.seen: list[tuple[str, str | None]] = []
        host = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # Headers and body go out as separate writes; without TCP_NODELAY the body waits
            # for the caller's delayed ACK (~40 ms a call). The simulator's handler sets it too.
            disable_nagle_algorithm = True

            def log_message(self, *_args):
                pass

            def _answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}") if length else {}
                match = SESSION.match(self.path)
                sid, call = unquote(match[2]), match[3]
                host.seen.append((sid, self.headers.get("Authorization")))
                answer = host.answers.get((sid, call)) or host.answers.get(sid)
                status, raw = answer(body) if callable(answer) else answer
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            do_GET = do_POST = _answer

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, args=(STOP_POLL_S,), daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


CLOSE = "close"
HANG = "hang"


class ScriptedHost:
    """A host on a real socket: each request on each connection is answered by
    `script(connection_number, request_number)`, which returns the bytes to send (with
    `CLOSE` after them: then close the connection; None: send nothing and close it; HANG:
    send nothing and keep it open). `accepted` is released for each connection taken."""

    def __init__(self, script) -> None:
        self.script = script
        self.connections = 0
        self.requests = 0
        self.paths: list[str] = []
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._open: list[socket.socket] = []
        self.accepted = threading.Semaphore(0)
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._sock.getsockname()[1]}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.connections += 1
            self._open.append(conn)
            self.accepted.release()
            threading.Thread(target=self._serve, args=(conn, self.connections), daemon=True).start()

    def _serve(self, conn: socket.socket, number: int) -> None:
        reader = conn.makefile("rb")
        try:
            for request_number in range(1, 1000):
                length = 0
                if not (line := reader.readline()):
                    return
                self.paths.append(line.split()[1].decode())
                while (line := reader.readline()) not in (b"\r\n", b""):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                if not line:
                    return
                reader.read(length)
                self.requests += 1
                out = self.script(number, request_number)
                if out == HANG:
                    time.sleep(30)
                    return
                if out is None:
                    return
                if isinstance(out, tuple):
                    conn.sendall(out[0])
                    return
                conn.sendall(out)
        except OSError:
            return
        finally:
            reader.close()
            conn.close()

    def close(self) -> None:
        self._sock.close()
        for conn in self._open:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()


def applied(body):
    goal = {"objective": body["objective"], "status": "active"}
    return 200, json.dumps({"phase": "applied", "goal": goal, "evidence": {"ok": 1}}).encode()


def raw_publish(
    settings,
    body,
    *,
    headers=None,
    content_type="application/json",
    content_encoding="utf-8",
    queue: str = "default",
) -> None:
    """Publish `body` as it is: bytes go out untouched, anything else as JSON."""
    target = queue_named(settings, queue)
    if not isinstance(body, bytes):
        body = json.dumps(body).encode()
    with broker_connection(settings) as conn:
        conn.Producer().publish(
            body,
            exchange=target.exchange,
            routing_key=target.routing_key,
            content_type=content_type,
            content_encoding=content_encoding,
            headers=headers if headers is not None else {},
            declare=[target],
        )


def raw_broadcast(app, body, **publish) -> None:
    """Publish `body` to the workers' mailbox (remote control's fanout exchange) as any
    broker client can, with kombu's `publish` options as given (headers, content type…)."""
    with app.connection_for_write() as conn:
        exchange = app.control.mailbox(conn).exchange
        conn.Producer().publish(
            body, exchange=exchange, routing_key="", declare=[exchange], **publish
        )


def task_headers(task: str = "agent_radar.goal_control", **override) -> dict:
    task_id = str(uuid.uuid4())
    headers = {
        "lang": "py",
        "task": task,
        "id": task_id,
        "root_id": task_id,
        "parent_id": None,
        "group": None,
        "retries": 0,
        "eta": None,
        "expires": None,
        "timelimit": [None, None],
        "argsrepr": "",
        "kwargsrepr": "",
    }
    headers.update(override)
    return headers

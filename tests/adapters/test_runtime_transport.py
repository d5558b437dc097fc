"""The HTTP adapter's connections to an agent host, against a raw socket that misbehaves on
purpose: keep-alive connections are reused, one the host closed while idle is replaced
without a fault, and every broken, slow or oversized answer is a retryable fault of that one
call whose connection is never used again."""

import socket
import threading
import time

import pytest

from agent_radar.workflows.adapters.answers import MAX_ANSWER_BYTES
from agent_radar.workflows.adapters.http_runtime import HttpRuntime
from agent_radar.workflows.errors import InvalidArgument, RuntimeFault
from agent_radar.workflows.tools.simulator.server import STOP_POLL_S
from tests.hostile import CLOSE, HANG, ScriptedHost

APPLIED = b'{"phase": "applied", "goal": {"objective": "o"}, "evidence": {}}'


def answer(body: bytes = APPLIED, status: str = "200 OK", close: bool = False) -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(body)}\r\n" + ("Connection: close\r\n" if close else "")
    return head.encode() + b"\r\n" + body


@pytest.fixture
def scripted():
    hosts: list[ScriptedHost] = []

    def make(script) -> ScriptedHost:
        hosts.append(ScriptedHost(script))
        return hosts[-1]

    yield make
    for host in hosts:
        host.close()


def goal(runtime: HttpRuntime) -> dict:
    return runtime.apply_goal(
        "ws",
        "s1",
        operation_id="op-1",
        action="set",
        objective="o",
        revision=1,
        client_submit_id="1",
        require_live=True,
    )


def test_calls_share_one_keep_alive_connection(scripted):
    host = scripted(lambda conn, req: answer())
    runtime = HttpRuntime(host.url, timeout_s=5.0)
    for _ in range(5):
        assert goal(runtime)["phase"] == "applied"
    assert (host.connections, host.requests) == (1, 5)


def test_a_connection_the_host_closed_while_idle_is_replaced_without_a_fault(scripted):
    # The host keeps no connection after its answer, without saying so (no Connection:
    # close): the adapter finds it closed before its next call and opens another.
    host = scripted(lambda conn, req: (answer(), CLOSE))
    runtime = HttpRuntime(host.url, timeout_s=5.0)
    for _ in range(3):
        assert goal(runtime)["phase"] == "applied"
        time.sleep(0.05)  # the host's close reaches this side
    assert (host.connections, host.requests) == (3, 3)


def test_connection_close_is_honoured(scripted):
    host = scripted(lambda conn, req: answer(close=True))
    runtime = HttpRuntime(host.url, timeout_s=5.0)
    for _ in range(3):
        assert goal(runtime)["phase"] == "applied"
    assert host.connections == 3


@pytest.mark.parametrize("version", ["HTTP/1.1", "HTTP/1.0"])
def test_an_answer_that_closes_its_connection_is_read_whole(version):
    """An answer that ends its connection (`Connection: close`, or HTTP/1.0 with no length:
    the body ends when the host closes) whose body comes after its headers, in a write of
    its own, is read whole: http.client closes the connection right after the headers."""
    head = f"{version} 200 OK\r\nContent-Type: application/json\r\n" + (
        f"Content-Length: {len(APPLIED)}\r\nConnection: close\r\n\r\n"
        if version == "HTTP/1.1"
        else "\r\n"
    )

    def serve(conn: socket.socket) -> None:
        request = conn.makefile("rb")
        length = 0
        while (line := request.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        request.read(length)
        conn.sendall(head.encode())
        time.sleep(0.2)
        conn.sendall(APPLIED)
        request.close()
        conn.close()

    server = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=lambda: serve(server.accept()[0]), daemon=True).start()
    runtime = HttpRuntime(f"http://127.0.0.1:{server.getsockname()[1]}", timeout_s=5.0)
    assert goal(runtime)["phase"] == "applied"
    server.close()


def test_a_chunked_answer_is_read_whole_and_its_connection_kept(scripted):
    body = APPLIED
    chunked = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n%s\r\n" % (10, body[:10])
        + b"%x\r\n%s\r\n" % (len(body) - 10, body[10:])
        + b"0\r\n\r\n"
    )
    host = scripted(lambda conn, req: chunked)
    runtime = HttpRuntime(host.url, timeout_s=5.0)
    assert goal(runtime)["goal"] == {"objective": "o"}
    assert goal(runtime)["phase"] == "applied"
    assert host.connections == 1


BROKEN = {
    "closed without an answer": (None, "unreachable"),
    "not HTTP": (b"SSH-2.0-OpenSSH_9.0\r\n\r\n", "unreachable"),
    "bad chunk size": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
        "unreachable",
    ),
    "cut short": ((answer()[:-10], CLOSE), "unreachable"),
    "header line too long": (
        b"HTTP/1.1 200 OK\r\nX-Pad: " + b"x" * 70_000 + b"\r\n\r\n{}",
        "unreachable",
    ),
    "over the size limit": (answer(b'{"pad": "' + b"x" * MAX_ANSWER_BYTES + b'"}'), "bad_response"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_answer_faults_that_call_and_its_connection_is_not_reused(scripted, case):
    broken, code = BROKEN[case]
    # The first connection's first answer is broken; every later call gets a good answer,
    # on a connection of its own.
    host = scripted(lambda conn, req: broken if conn == 1 and req == 1 else answer())
    runtime = HttpRuntime(host.url, timeout_s=2.0)
    with pytest.raises(RuntimeFault) as raised:
        goal(runtime)
    assert raised.value.code == code and raised.value.retryable
    assert raised.value.http_status in (None, 200)
    assert str(raised.value).isprintable()
    assert goal(runtime)["phase"] == "applied"
    assert host.connections == 2


def test_a_host_that_never_answers_is_a_timeout(scripted):
    host = scripted(lambda conn, req: HANG if conn == 1 else answer())
    runtime = HttpRuntime(host.url, timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(RuntimeFault) as raised:
        goal(runtime)
    assert raised.value.code == "timeout" and raised.value.retryable
    assert 0.4 < time.monotonic() - started < 5
    assert goal(runtime)["phase"] == "applied"


def test_a_host_that_trickles_its_answer_is_cut_at_the_calls_deadline():
    """The timeout bounds the whole call, not each read: a host that sends a byte every
    0.2 s (its answer would take ~30 s) is cut at the deadline, and the next call goes on."""
    sent = []

    def trickle(conn: socket.socket) -> None:
        conn.recv(65536)
        try:
            for byte in answer():
                conn.sendall(bytes([byte]))
                sent.append(byte)
                time.sleep(0.2)
        except OSError:
            pass
        finally:
            conn.close()

    server = socket.create_server(("127.0.0.1", 0))
    threading.Thread(
        target=lambda: [trickle(server.accept()[0]) for _ in range(1)], daemon=True
    ).start()
    runtime = HttpRuntime(f"http://127.0.0.1:{server.getsockname()[1]}", timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(RuntimeFault) as raised:
        goal(runtime)
    assert raised.value.code == "timeout" and raised.value.retryable
    assert time.monotonic() - started < 10 and 0 < len(sent) < len(answer()) // 2
    server.close()


def test_a_host_that_is_gone_is_unreachable():
    with socket.create_server(("127.0.0.1", 0)) as sock:
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(RuntimeFault) as raised:
        goal(HttpRuntime(url, timeout_s=1.0))
    assert raised.value.code == "unreachable" and raised.value.retryable


def test_a_base_path_prefixes_every_call(scripted):
    host = scripted(lambda conn, req: answer())
    goal(HttpRuntime(host.url + "/agents/", timeout_s=5.0))
    assert host.paths == ["/agents/v1/workspaces/ws/sessions/s1/goal"]


@pytest.fixture
def tls_host(tmp_path):
    """A TLS agent host with a certificate of its own for 127.0.0.1, and a verify path that
    trusts it (as an operator's CA bundle would)."""
    import json
    import shutil
    import ssl
    import subprocess
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
        + ["-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1"]
        + ["-addext", "subjectAltName=IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_args):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps({"phase": "applied", "goal": {"objective": "o"}}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, args=(STOP_POLL_S,), daemon=True).start()
    yield f"https://127.0.0.1:{server.server_address[1]}", cert
    server.shutdown()
    server.server_close()


def test_https_verifies_the_host_and_keeps_its_connection(tls_host, monkeypatch):
    url, cert = tls_host
    # Not trusted: the call is a retryable fault that says why.
    with pytest.raises(RuntimeFault) as raised:
        goal(HttpRuntime(url, timeout_s=5.0))
    assert raised.value.code == "unreachable" and "CERTIFICATE_VERIFY_FAILED" in str(raised.value)
    # Trusted: calls go through, on one kept connection.
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    runtime = HttpRuntime(url, timeout_s=5.0)
    for _ in range(3):
        assert goal(runtime)["phase"] == "applied"
    assert len(runtime.http._idle) == 1


@pytest.mark.parametrize(
    "url",
    ["ftp://127.0.0.1:21", "http://", "http://127.0.0.1:99999", "http://u:p@127.0.0.1", "x"],
)
def test_an_adapter_takes_only_a_host_url_that_registration_would(url):
    # The check of `agent-radar host add` (validation.check_url), before any connection.
    with pytest.raises(InvalidArgument) as raised:
        HttpRuntime(url)
    assert raised.value.field == "url"

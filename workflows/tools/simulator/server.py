"""The simulator on a real socket: the runtime protocol, served by the host kit's server
(host/server.py), and the `/sim/` control endpoints, both behind the bearer token
(docs/protocol.md)."""

import time
from urllib.parse import parse_qs

from ...host.server import STOP_POLL_S, HostServer, bearer_matches
from .state import Reporter, Simulator

__all__ = ["STOP_POLL_S", "SimServer", "bearer_matches", "sim_calls"]


def sim_calls(sim: Simulator):
    """The simulator's calls for the host kit's server (host/server.py): its protocol
    `handle`, its `/sim/` control endpoints beside them, and its trickle fault on the
    protocol's answers."""

    def handle(call: str, ws: str, sid: str, body: dict) -> dict:
        return sim.handle(call, ws, sid, body)  # looked up per call: tests wrap it

    def control(method: str, path: str, query: str, body: dict) -> tuple[int, dict]:
        if not path.startswith("/sim/"):
            return 404, {"error": "not_found"}
        if method == "GET":
            params = parse_qs(query)
            since = params.get("since", ["0"])[0]
            wait_s = params.get("wait_s", ["0"])[0]
            return 200, sim.snapshot(path, int(since), float(wait_s))
        return 200, sim.control(path, body)

    def trickle(handler, status: int, data: bytes) -> bool:
        trickle_ms = sim.faults.trickle_ms
        if not trickle_ms:
            return False
        # A host that trickles: the whole answer, one byte every trickle_ms.
        head = (
            f"HTTP/1.1 {status} {handler.responses.get(status, ('',))[0]}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        ).encode()
        try:
            for i in range(len(head + data)):
                handler.wfile.write((head + data)[i : i + 1])
                handler.wfile.flush()
                time.sleep(trickle_ms / 1000)
        except OSError:  # the caller gave up
            handler.close_connection = True
        return True

    return handle, control, trickle


class SimServer(HostServer):
    """The simulator on a real socket, in a background thread (or in the foreground)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 8765,
        token: str | None = None,
        reporter: Reporter | None = None,
        host_id: str = "default",
    ) -> None:
        self.sim = Simulator(reporter, host_id, token)
        handle, control, trickle = sim_calls(self.sim)
        super().__init__(handle, host, port, token, extra=control, send_answer=trickle)

    def start(self, name: str = "runtime-sim") -> "SimServer":
        super().start(name)
        return self

    def stop(self) -> None:
        """Stop serving and reporting (after this the reporter may be closed)."""
        super().stop()
        self.sim.close()

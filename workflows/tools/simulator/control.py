"""Client of the simulator's `/sim/` endpoints, for the demo, the tests and the bench."""

from typing import Any


class SimControl:
    """Client of the simulator's `/sim/` endpoints, for the demo, the tests and the bench."""

    def __init__(self, url: str, token: str | None = None) -> None:
        from ...adapters.http_runtime import HttpRuntime

        self.http = HttpRuntime(url, token, timeout_s=10.0)

    def session(self, ws: str, sid: str, **settings: Any) -> dict:
        from urllib.parse import quote

        path = f"/sim/sessions/{quote(ws, safe='')}/{quote(sid, safe='')}"
        return self.http.request("POST", path, settings)

    def fault(
        self,
        call: str = "*",
        *,
        status: int = 503,
        error: str = "server_error",
        count: int = 1,
        workspace_id: str | None = None,
        session_id: str | None = None,
    ):
        return self.http.request(
            "POST",
            "/sim/faults",
            {
                "call": call,
                "status": status,
                "error": error,
                "count": count,
                "workspace_id": workspace_id,
                "session_id": session_id,
            },
        )

    def clear_faults(self) -> None:
        """Every fault set with `fault` stops failing calls, whatever its count left."""
        self.http.request("POST", "/sim/faults/clear", {})

    def defaults(self, **settings: Any) -> dict:
        """Settings for sessions the simulator has not seen yet."""
        return self.http.request("POST", "/sim/defaults", settings)

    def latency(
        self, call: str, ms: int, p99_ms: int | None = None, per_session: bool = False
    ) -> dict:
        """Every `call` (a protocol call's name) answers after `ms`; given `p99_ms`, after a
        time drawn per call with that median and 99th percentile (with `per_session`, drawn
        from the session id: the same for it every time)."""
        body = {"call": call, "ms": ms, "p99_ms": p99_ms, "per_session": per_session}
        return self.http.request("POST", "/sim/latency", body)

    def hold(self, call: str = "*", hold: bool = True) -> int:
        """Hold every `call` (`*`: all) until let go (`hold=False`): a host that hangs. How
        many calls it holds now."""
        return self.http.request("POST", "/sim/hold", {"call": call, "hold": hold})["holding"]

    def holding(self) -> int:
        """How many calls are held now."""
        return self.http.request("GET", "/sim/calls")["holding"]

    def trickle(self, ms: int) -> dict:
        """Write every answer one byte every `ms` (0: at once): a host that trickles."""
        return self.http.request("POST", "/sim/trickle", {"ms": ms})

    def effects(self, kind: str | None = "goal", since: int = 0, wait_s: float = 0.0) -> list[dict]:
        """The effects applied so far (after the first `since` of them, of every kind); with
        `wait_s`, the simulator first waits up to that long for one more."""
        query = f"since={since}" + (f"&wait_s={wait_s}" if wait_s else "")
        answer = self.http.request("GET", f"/sim/effects?{query}")
        effects = answer["effects"]
        while since + len(effects) < answer["total"]:  # the rest, a page at a time
            answer = self.http.request("GET", f"/sim/effects?since={since + len(effects)}")
            if not answer["effects"]:
                break
            effects += answer["effects"]
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

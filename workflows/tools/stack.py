"""Process management for the embedded stack: runtime-sim, workers and beat as real
subprocesses of this product's own CLI. Used by `up`, `demo`, `bench` and the tests."""

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from ...models.migrate import upgrade
from ..adapters.broker import clean_embedded_broker
from ..adapters.config import Settings
from .simulator import SimControl

STOP_GRACE_S = 10.0


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    """Whether something accepts TCP connections on this loopback port."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(poll_s)


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path
    ready_file: Path | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def children(self) -> list[int]:
        """Pids of this process's direct children (a prefork worker's pool processes)."""
        try:
            out = subprocess.run(
                ["pgrep", "-P", str(self.pid)], capture_output=True, text=True, check=False
            ).stdout
        except FileNotFoundError:
            return []
        return [int(p) for p in out.split()]

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)  # the group we created with start_new_session
        except ProcessLookupError:
            pass

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        if not self.alive():
            return
        # SIGTERM to the main process only: a Celery worker then finishes (warm shutdown)
        # and stops its own pool; signalling the group would kill the pool mid-task.
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.signal_group(signal.SIGKILL)
            self.popen.wait(5)
        self.signal_group(signal.SIGKILL)  # pool children that outlived their parent

    def kill(self) -> None:
        self.signal_group(signal.SIGKILL)
        self.popen.wait(5)


@dataclass
class Stack:
    settings: Settings
    procs: list[Proc] = field(default_factory=list)

    @property
    def log_dir(self) -> Path:
        path = self.settings.home / "logs"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def env(self) -> dict[str, str]:
        env = {**os.environ, **self.settings.to_env()}
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def spawn(
        self,
        name: str,
        args: list[str],
        ready_file: Path | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> Proc:
        log_path = self.log_dir / f"{name}.log"
        env = {**self.env(), **(extra_env or {})}
        if ready_file is not None:
            env["AGENT_RADAR_READY_FILE"] = str(ready_file)
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(
                [sys.executable, "-m", "agent_radar.workflows.tools.cli", *args],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        proc = Proc(name, popen, log_path, ready_file)
        self.procs.append(proc)
        return proc

    def prepare(self) -> None:
        self.settings.home.mkdir(parents=True, exist_ok=True)
        upgrade(self.settings.database_url)
        clean_embedded_broker(self.settings)

    def start_sim(self, host_id: str = "default", url: str | None = None) -> Proc:
        """A runtime simulator process: the host `default` at AGENT_RADAR_RUNTIME_URL, or
        another agent host (docs/lifecycles.md: sessions) at `url`, whose reports name it."""
        url = url or self.settings.runtime_url
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        name = "runtime-sim" if host_id == "default" else f"runtime-sim-{host_id}"
        # Another host takes the stack's token too (its bearer, and its reports' key): the
        # caller registers it with that token.
        token = self.settings.runtime_token
        extra = {"AGENT_RADAR_HOST_TOKEN": token} if token and host_id != "default" else None
        proc = self.spawn(
            name, ["runtime-sim", "--port", str(port), "--host-id", host_id], extra_env=extra
        )
        control = SimControl(url, self.settings.runtime_token)
        # Its port first: asked before it listens, the control's calls would count as a host
        # failing (its circuit opens, says so, and holds the start up for seconds).
        wait_for(
            lambda: listening(port) and control.healthy() or not proc.alive() and _dead(proc),
            30,
            "the runtime simulator",
        )
        return proc

    def start_worker(
        self,
        concurrency: int = 2,
        queues: str | None = None,
        name: str | None = None,
        extra_env: dict[str, str] | None = None,
        extra_args: list[str] | None = None,
    ) -> Proc:
        name = name or f"worker-{uuid.uuid4().hex[:6]}"
        ready = self.settings.home / "run" / f"{name}.ready"
        ready.parent.mkdir(parents=True, exist_ok=True)
        ready.unlink(missing_ok=True)
        args = ["worker", "-c", str(concurrency), "--name", name]
        if queues:
            args += ["-Q", queues]
        proc = self.spawn(name, args + list(extra_args or []), ready, extra_env)
        wait_for(lambda: ready.exists() or not proc.alive() and _dead(proc), 60, f"worker {name}")
        return proc

    def start_beat(self, name: str = "beat") -> Proc:
        return self.spawn(
            name, ["beat", "--schedule-file", str(self.settings.home / "run" / f"{name}-schedule")]
        )

    def stop(self) -> None:
        # Ask every process first, then wait: shutdowns overlap instead of adding up.
        for proc in self.procs:
            if proc.alive():
                proc.popen.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            proc.stop()
        self.procs.clear()

    def kill(self) -> None:
        """SIGKILL every process group: for throwaway stacks (the tests' teardown),
        where a warm shutdown would only cost time — a prefork pool process alone takes
        2–3 s to exit (billiard sleeps a second on the way out)."""
        for proc in self.procs:
            proc.kill()
        self.procs.clear()


def _dead(proc: Proc) -> bool:
    raise RuntimeError(
        f"{proc.name} exited with {proc.popen.returncode}; "
        f"see {proc.log_path}:\n{proc.log_path.read_text()[-2000:]}"
    )

"""A PostgreSQL primary and its streaming replica, started (and ended) by a test only: two
clusters of their own made with initdb and pg_basebackup, on ports of their own, run as the
`postgres` user. The shared server is never touched.

Each server is a `postgres` process of the test's own in a process group of its own: killing
the group is the node lost at once (no chance to flush or say goodbye; its backends, each in
a session of its own, exit as they see it gone), and the test ends only the pids it started."""

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from agent_radar.workflows.tools.stack import free_port

USER = "postgres"
DATABASE = "agent_radar"
# Debian's layout: /usr/lib/postgresql/<major>/bin. The newest one installed is used.
BIN_GLOB = "/usr/lib/postgresql/*/bin"
# A server answers within seconds; initdb and a base backup of a new cluster take about one.
START_TIMEOUT_S = 60.0


def pg_bin() -> Path | None:
    """The folder of the newest PostgreSQL server binaries installed, if any."""
    found = sorted(Path("/").glob(BIN_GLOB.lstrip("/")), key=lambda p: int(p.parent.name))
    found = [p for p in found if (p / "initdb").exists() and (p / "pg_basebackup").exists()]
    return found[-1] if found else None


def missing_prerequisite() -> str | None:
    """Why a primary and replica cannot be started here, or None."""
    if pg_bin() is None:
        return "the PostgreSQL server binaries (initdb, pg_basebackup) are not installed"
    try:
        pwd.getpwnam(USER)
    except KeyError:
        return f"there is no {USER} user to run PostgreSQL as"
    if os.geteuid() != 0:
        return f"starting PostgreSQL clusters as the {USER} user needs root"
    return None


@dataclass
class Node:
    """One server: its data folder, port, process and log."""

    name: str
    folder: Path
    port: int
    proc: subprocess.Popen | None = None
    # Its children the test paused (SIGSTOP), each the leader of a process group of its own.
    held: list[int] = field(default_factory=list)

    @property
    def data(self) -> Path:
        return self.folder / self.name

    @property
    def log_path(self) -> Path:
        return self.folder / f"{self.name}.log"

    def conninfo(self, dbname: str = DATABASE) -> str:
        return f"host=127.0.0.1 port={self.port} user={USER} dbname={dbname} connect_timeout=2"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL to the whole server (its process group): a crash of the node."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for pid in (self.proc.pid, *self.held):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.held.clear()
        self.proc.wait(15)


class PgPair:
    """A primary and a streaming replica of it, synchronous or not."""

    def __init__(self, synchronous: bool) -> None:
        self.synchronous = synchronous
        self.bin = pg_bin()
        assert self.bin is not None, missing_prerequisite()
        # Not under pytest's tmp_path: the postgres user cannot enter root's 0700 folders.
        self.folder = Path(tempfile.mkdtemp(prefix="radar-pg-failover-"))
        self.folder.chmod(0o755)
        account = pwd.getpwnam(USER)
        self.uid, self.gid = account.pw_uid, account.pw_gid
        os.chown(self.folder, self.uid, self.gid)
        self.primary = Node("primary", self.folder, free_port())
        self.replica = Node("replica", self.folder, free_port())

    @property
    def url(self) -> str:
        """libpq's multi-host form (docs/database-failover.md): whichever node accepts
        writes, the primary now or the replica once promoted."""
        hosts = "&".join(f"host=127.0.0.1:{n.port}" for n in (self.primary, self.replica))
        return f"postgresql+psycopg://{USER}@/{DATABASE}?{hosts}&target_session_attrs=read-write"

    def _run(self, *args: str, timeout_s: float = START_TIMEOUT_S) -> str:
        done = subprocess.run(
            [str(self.bin / args[0]), *args[1:]],
            user=self.uid,
            group=self.gid,
            cwd=self.folder,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C"},
        )
        assert done.returncode == 0, f"{' '.join(args)}: {done.stdout}{done.stderr}"
        return done.stdout

    def _serve(self, node: Node) -> None:
        with open(node.log_path, "ab") as log:
            node.proc = subprocess.Popen(
                [str(self.bin / "postgres"), "-D", str(node.data)],
                user=self.uid,
                group=self.gid,
                cwd=self.folder,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C"},
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert node.alive(), node.log_path.read_text()[-3000:]
            try:
                psycopg.connect(node.conninfo("postgres")).close()
                return
            except psycopg.OperationalError:
                assert time.monotonic() < deadline, f"{node.name} did not answer"
                time.sleep(0.05)

    def start(self) -> None:
        """initdb the primary, start it, make the database, take a base backup for the
        replica and start that streaming; with `synchronous`, make every commit wait for
        the replica from then on."""
        primary, replica = self.primary, self.replica
        # UTF8: on SQL_ASCII (the C locale's default) psycopg hands back text as bytes.
        self._run(
            "initdb", "-D", str(primary.data), "-U", USER, "--auth=trust", "--no-sync",
            "-E", "UTF8", "--locale=C",
        )  # fmt: skip
        with open(primary.data / "postgresql.conf", "a") as conf:
            conf.write(
                f"port = {primary.port}\n"
                "listen_addresses = '127.0.0.1'\n"
                f"unix_socket_directories = '{self.folder}'\n"
                "wal_level = replica\n"
                "max_wal_senders = 4\n"
                "hot_standby = on\n"
                "max_connections = 200\n"
                "shared_buffers = 32MB\n"
                # A process crash, not a power cut: what a server wrote survives in the
                # operating system's cache, so its flushes to disk only cost time here.
                "fsync = off\n"
                "full_page_writes = off\n"
            )
        self._serve(primary)
        with psycopg.connect(primary.conninfo("postgres"), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {DATABASE}")
        self._run(
            "pg_basebackup",
            "-h", "127.0.0.1",
            "-p", str(primary.port),
            "-U", USER,
            "-D", str(replica.data),
            "-X", "stream",
            "-R",  # standby.signal and primary_conninfo: it streams from the primary
            "-c", "fast",
            "--no-sync",
        )  # fmt: skip
        with open(replica.data / "postgresql.auto.conf", "a") as conf:
            conf.write(f"port = {replica.port}\n")
        self._serve(replica)
        with psycopg.connect(primary.conninfo(), autocommit=True) as conn:
            if self.synchronous:
                # On the primary only, after the copy: the replica, once promoted, has no
                # standby of its own, and would make every commit wait for one.
                conn.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
                conn.execute("ALTER SYSTEM SET synchronous_commit = 'on'")
                conn.execute("SELECT pg_reload_conf()")
            want = "sync" if self.synchronous else "async"
            deadline = time.monotonic() + START_TIMEOUT_S
            while (
                conn.execute(
                    "SELECT count(*) FROM pg_stat_replication"
                    " WHERE state = 'streaming' AND sync_state = %s",
                    (want,),
                ).fetchone()[0]
                != 1
            ):
                assert time.monotonic() < deadline, f"the replica is not streaming ({want})"
                time.sleep(0.05)

    def hold_replication(self) -> None:
        """Pause the primary's WAL sender (SIGSTOP), as a network fault or a busy standby
        would hold replication back: an asynchronous primary goes on committing what the
        replica will never receive, a synchronous one makes every commit wait. (Pausing
        the replica's receiver instead would not do: what the sender had written waits in
        the loopback's socket buffers, and arrives.)"""
        with psycopg.connect(self.primary.conninfo(), autocommit=True) as conn:
            row = conn.execute("SELECT pid FROM pg_stat_replication").fetchone()
        assert row is not None, "the primary has no WAL sender"
        os.kill(row[0], signal.SIGSTOP)
        # PostgreSQL's children each lead a session of their own, so killing the primary's
        # group misses them; a running one exits once it sees the postmaster gone, a paused
        # one never would: it is killed with the primary.
        self.primary.held.append(row[0])

    def promote(self) -> None:
        """What an operator (or Patroni) does once the primary is lost."""
        self._run("pg_ctl", "promote", "-w", "-D", str(self.replica.data))

    def remove(self) -> None:
        for node in (self.primary, self.replica):
            node.kill()
        shutil.rmtree(self.folder, ignore_errors=True)

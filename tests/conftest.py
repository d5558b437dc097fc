"""Test fixtures: real databases, real brokers, real HTTP, real worker processes.

Every scenario runs on both backends: `embedded` (SQLite + the filesystem transport) and
`production` (PostgreSQL + Redis). The tests that matter most for a broker (end to end,
redelivery, restart) also run on `rabbitmq` (PostgreSQL + RabbitMQ, quorum queues), by
overriding the `backend` fixture. Where a server is unreachable those cases skip with the
reason — except under CI=true, where that is a failure.

What each fixture starts (all torn down after the test):
- `pg_database` (session): one throwaway PostgreSQL database, migrated to head.
- `backend`: the parameter, `embedded` or `production`.
- `settings`: a home folder, the backend's database (a copy of a SQLite file migrated once
  per session, or the PostgreSQL database emptied) and broker (a folder, Redis under a key
  prefix of its own, or a RabbitMQ virtual host of its own), a free port.
- `sim`: the runtime simulator as a real HTTP server in this process, reporting through the
  real broker; `sim_control` is its `/sim/` client. `sim_b`: a second host, `host-b`.
- `client`: the Python client against that backend and simulator (no worker).
- `stack`: real `agent-radar worker` / `beat` subprocesses, started by the test as it needs.
- `host`: an agent host that misbehaves as the test tells it (tests/hostile.py).

Tests mirror the code: `rules/` (the domain, against a real database), `adapters/` (runtime,
broker, migrations), `tools/` (CLI, demo, deploy files, packaging), `end_to_end/` (real
workers), `faults/` (restarts, outages, the hostile-input campaign). The servers the tests
use, and the variables that point them elsewhere, are in docs/testing.md.
"""

import os
import shutil
import socket
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from agent_radar.models.base import Base
from agent_radar.models.db import dispose_engine, engine_for, forget_engines
from agent_radar.models.migrate import upgrade
from agent_radar.workflows.adapters.config import Settings
from agent_radar.workflows.adapters.publisher import TaskPublisher
from agent_radar.workflows.client import AgentRadar
from agent_radar.workflows.tools.simulator import SimControl

# Tests import free_port from here.
from agent_radar.workflows.tools.stack import Stack, free_port  # noqa: F401
from tests.helpers import QuickStopSimServer

# Worker tests run real `agent-radar worker` subprocesses (the `stack` fixture), not Celery's
# in-process test worker, so Celery's pytest plugin is not loaded (docs/testing.md).

PG_ADMIN_URL = os.environ.get(
    "AGENT_RADAR_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
REDIS_URL = os.environ.get("AGENT_RADAR_TEST_REDIS", "redis://127.0.0.1:6379/11")
# The shared RabbitMQ; each test gets a virtual host of its own on it (rabbitmqctl).
RABBITMQ_URL = os.environ.get("AGENT_RADAR_TEST_RABBITMQ", "amqp://guest:guest@127.0.0.1:5672")
IN_CI = os.environ.get("CI", "").lower() == "true"


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def skip_or_fail(message: str) -> None:
    """A test cannot run here: skip it with the reason, or fail under CI=true."""
    if IN_CI:
        pytest.fail(message + " (CI=true: tests must not skip)")
    pytest.skip(message)


def _require(name: str, host: str, port: int) -> None:
    if not _reachable(host, port):
        skip_or_fail(f"{name} is not reachable at {host}:{port}")


@contextmanager
def throwaway_pg_database(prefix: str) -> Iterator[str]:
    """A PostgreSQL database of its own (its URL), migrated to head, dropped afterwards."""
    _require("PostgreSQL", "127.0.0.1", 5432)
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    try:
        upgrade(url)
        yield url
    finally:
        forget_engines()
        engine_for(url).dispose()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(scope="session")
def pg_database():
    """A throwaway PostgreSQL database for this test session, migrated to head."""
    with throwaway_pg_database("agent_radar_test") as url:
        yield url


def rabbitmqctl(*args: str, node: str | None = None) -> str:
    """Run rabbitmqctl (as root it reaches the local nodes); its output, or fail loudly."""
    command = ["rabbitmqctl", *(["-n", node] if node else []), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{' '.join(command)}: {done.stdout}{done.stderr}"
    return done.stdout


@pytest.fixture
def rabbitmq_vhost():
    """A virtual host of this test's own on the shared RabbitMQ, deleted afterwards with
    everything in it: no purging, no interference with other runs."""
    _require("RabbitMQ", "127.0.0.1", 5672)
    if shutil.which("rabbitmqctl") is None:
        skip_or_fail("rabbitmqctl is not installed")
    vhost = f"radar-test-{uuid.uuid4().hex[:12]}"
    rabbitmqctl("add_vhost", vhost)
    rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
    yield vhost
    rabbitmqctl("delete_vhost", vhost)


def _empty_pg(pg_url: str) -> None:
    """Every table emptied. As TRUNCATE does, it first waits for any transaction still at
    work on a table (the exclusive locks); it then deletes the few rows a test leaves, which
    costs a millisecond where TRUNCATE's new files for every table and index cost ~50 ms."""
    tables = Base.metadata.sorted_tables
    with engine_for(pg_url).begin() as conn:
        names = ", ".join(t.name for t in tables)
        conn.execute(text(f"LOCK TABLE {names} IN ACCESS EXCLUSIVE MODE"))
        for table in reversed(tables):  # the referencing tables first
            conn.execute(table.delete())


@pytest.fixture(scope="session")
def migrated_sqlite(tmp_path_factory) -> Path:
    """One SQLite database migrated to head; each embedded test starts from a copy of it
    (a migration per test cost more than many tests do)."""
    path = tmp_path_factory.mktemp("migrated") / "agent-radar.db"
    url = f"sqlite:///{path}"
    upgrade(url)
    # Closing its last connection checkpoints the write-ahead log into the file.
    dispose_engine(url)
    assert not Path(f"{path}-wal").exists(), "the migrated database is not all in its file"
    return path


@pytest.fixture(params=["embedded", "production"])
def backend(request) -> str:
    """Which backend this test runs on (every scenario runs on both)."""
    return request.param


@pytest.fixture
def settings(backend, tmp_path, request):
    """Settings for one test: its own home, database state, broker and simulator port."""
    home = tmp_path / "home"
    home.mkdir()
    base = Settings(
        home=home,
        database_url=f"sqlite:///{home / 'agent-radar.db'}",
        broker_url="filesystem://",
        runtime_url=f"http://127.0.0.1:{free_port()}",
        sweep_interval_s=0.5,
        lease_s=3.0,
        runtime_timeout_s=2.0,
        maintenance_cancel_grace_s=1.0,
    )
    if backend == "production":
        pg_url = request.getfixturevalue("pg_database")
        _require("Redis", "127.0.0.1", 6379)
        # Every test gets its own key prefix: no flushing, and no interference with any
        # other run that shares this Redis.
        base = replace(
            base,
            database_url=pg_url,
            broker_url=REDIS_URL,
            broker_key_prefix=f"radar-test-{uuid.uuid4().hex[:12]}:",
        )
        _empty_pg(pg_url)
    elif backend == "rabbitmq":
        pg_url = request.getfixturevalue("pg_database")
        vhost = request.getfixturevalue("rabbitmq_vhost")
        base = replace(base, database_url=pg_url, broker_url=f"{RABBITMQ_URL}/{vhost}")
        _empty_pg(pg_url)
    else:
        shutil.copyfile(request.getfixturevalue("migrated_sqlite"), home / "agent-radar.db")
    yield base
    if backend == "embedded":
        # This test's own database: its engine (pooled connections, each holding the
        # database's files open) goes with it, or a whole run gathers open files.
        dispose_engine(base.database_url)
    if base.broker_key_prefix:
        import redis

        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(match=f"{base.broker_key_prefix}*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()


@pytest.fixture
def sim(settings):
    """The runtime simulator as a real HTTP server, reporting through the real broker."""
    publisher = TaskPublisher(settings)
    port = int(settings.runtime_url.rsplit(":", 1)[1])
    server = QuickStopSimServer(
        "127.0.0.1",
        port,
        reporter=lambda report: publisher.publish(
            "agent_radar.report_activity", {"report": report}
        ),
    ).start()
    yield server
    server.stop()
    publisher.close()


@pytest.fixture
def sim_b(settings):
    """A second agent host, `host-b` (docs/lifecycles.md: sessions): another simulator on its own
    port, reporting through the real broker and naming itself in every report. Registering it is the
    test's business (`client.add_host("host-b", sim_b.url)`)."""
    publisher = TaskPublisher(settings)
    server = QuickStopSimServer(
        "127.0.0.1",
        free_port(),
        reporter=lambda report: publisher.publish(
            "agent_radar.report_activity", {"report": report}
        ),
        host_id="host-b",
    ).start()
    yield server
    server.stop()
    publisher.close()


@pytest.fixture
def sim_control(sim) -> SimControl:
    """The simulator's control endpoints: take sessions offline, inject faults, list effects."""
    return SimControl(sim.url)


@pytest.fixture
def client(settings, sim) -> AgentRadar:
    """The Python client on this test's backend, calling the simulator; no worker runs."""
    c = AgentRadar(settings=settings)
    yield c
    c.close()


@pytest.fixture
def stack(settings, sim):
    """Real `agent-radar worker` / `beat` subprocesses against this test's backend (the
    simulator runs in the test process, so tests can look inside it)."""
    s = Stack(settings)
    s.prepare()
    yield s
    # The test is over and its database and broker are thrown away: no warm shutdown to
    # wait for (tests of a graceful stop stop their processes themselves).
    s.kill()


@pytest.fixture
def host():
    """An agent host that misbehaves as each test tells it (tests/hostile.py), on a real
    socket; no simulator, no worker."""
    from tests.hostile import HostileHost

    h = HostileHost()
    yield h
    h.close()

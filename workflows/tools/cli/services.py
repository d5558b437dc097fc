"""Processes: worker, beat, Flower, the runtime simulator, migrations, the embedded
stack, the demo and the benchmark. Commands that run Celery import `tasks` lazily."""

import os
import secrets
import sys
import time
from pathlib import Path

import click

from ...adapters.broker import WORKER_QUEUES
from ...adapters.config import Settings
from .common import (
    EXIT_FAILED,
    _emit,
    _prepare_home,
    cli,
    json_option,
)


@cli.command(context_settings={"ignore_unknown_options": True})
@click.option("-c", "--concurrency", type=click.IntRange(1, 64), default=2, show_default=True)
@click.option("-Q", "--queues", default=WORKER_QUEUES, show_default=True)
@click.option("--name", default=None, help="Node name prefix (unique per host).")
@click.option("--loglevel", default="INFO", show_default=True)
@click.option("--autoscale", default=None, help="MAX,MIN pool processes (Celery's --autoscale).")
@click.option("--max-tasks-per-child", type=click.IntRange(1), default=None)
@click.option("--max-memory-per-child", type=click.IntRange(1), default=None, help="KiB.")
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve this worker's metrics (runtime call latency and errors, batch sizes) here.",
)
@click.option("--metrics-address", default="0.0.0.0", show_default=True)
@click.argument("celery_args", nargs=-1, type=click.UNPROCESSED)
@json_option
def worker(
    concurrency: int,
    queues: str,
    name: str | None,
    loglevel: str,
    autoscale: str | None,
    max_tasks_per_child: int | None,
    max_memory_per_child: int | None,
    metrics_port: int | None,
    metrics_address: str,
    celery_args: tuple[str, ...],
    as_json: bool,
):
    """Run a Celery worker (applies pending migrations first). Options this command does
    not know are passed to `celery worker` as they are."""
    from ....models.migrate import upgrade

    settings = Settings.from_env()
    _prepare_home(settings)
    upgrade(settings.database_url)
    if metrics_port is not None:
        _serve_worker_metrics(settings, metrics_address, metrics_port)
    from ....tasks.app import app

    node = f"{name or 'radar'}-{os.getpid()}@%h"
    # No mingle or gossip: nothing here uses revokes or worker-to-worker state (the database
    # coordinates), mingle costs a second at every start, and gossip fails to restart after
    # a broker reconnect. Events (-E) still feed Flower.
    app.worker_main(
        [
            *_quiet_banner(),
            "worker",
            "-c",
            str(concurrency),
            "-Q",
            queues,
            "-n",
            node,
            "--loglevel",
            loglevel,
            "-E",
            "--without-mingle",
            "--without-gossip",
            *([f"--autoscale={autoscale}"] if autoscale else []),
            *([f"--max-tasks-per-child={max_tasks_per_child}"] if max_tasks_per_child else []),
            *([f"--max-memory-per-child={max_memory_per_child}"] if max_memory_per_child else []),
            *celery_args,
        ]
    )


def _quiet_banner() -> list[str]:
    """Celery's start banner is printed, not logged: with JSON logs it is left out, and
    Python's warnings are logged too, so every line of a worker's or beat's output is one
    JSON object."""
    from ...adapters import logs

    if not logs.json_logs_wanted():
        return []
    logs.warnings_as_json()
    return ["--quiet"]


def _serve_worker_metrics(settings: Settings, address: str, port: int) -> None:
    """prometheus_client's multiprocess mode: every pool process writes its samples to a
    folder of this worker's own, and this (main) process serves them all. The mode is fixed
    when prometheus_client is first imported, so the command starts itself again (same
    process id) with the folder set, before anything imports it."""
    folder = settings.home / "run" / f"metrics-{os.getpid()}"
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR") != str(folder):
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(folder)
        os.execv(
            sys.executable, [sys.executable, "-m", "agent_radar.workflows.tools.cli", *sys.argv[1:]]
        )
    from prometheus_client import CollectorRegistry, multiprocess, start_http_server

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(folder))
    start_http_server(port, addr=address, registry=registry)


@cli.command()
@click.option("--schedule-file", default=None, help="Where beat keeps its schedule state.")
@click.option("--loglevel", default="INFO", show_default=True)
@json_option
def beat(schedule_file: str | None, loglevel: str, as_json: bool):
    """Run Celery beat (the sweeper's clock). Run one per deployment."""
    from ....models.migrate import upgrade

    settings = Settings.from_env()
    _prepare_home(settings)
    upgrade(settings.database_url)
    schedule = schedule_file or str(settings.home / "run" / "celerybeat-schedule")
    Path(schedule).parent.mkdir(parents=True, exist_ok=True)
    from ....tasks.app import app

    app.start([*_quiet_banner(), "beat", "-s", schedule, "--loglevel", loglevel])


# Passwords that stand in the example env file or are commonly left unchanged.
EXAMPLE_PASSWORDS = frozenset({"change-me", "changeme", "password", "admin", "flower"})


def flower_auth_problem(auth: str) -> str | None:
    """Why FLOWER_BASIC_AUTH is not acceptable (comma-separated user:password pairs)."""
    if not auth:
        return "is not set"
    for pair in auth.split(","):
        user, sep, password = pair.partition(":")
        if not sep or not user or not password:
            return "must be user:password with a non-empty password"
        if password.lower() in EXAMPLE_PASSWORDS:
            return "still has the example password"
    return None


def _checked_flower_auth(auth: str) -> str:
    problem = flower_auth_problem(auth)
    if problem:
        # A setting, refused as every setting is (exit 1, docs/configuration.md).
        raise ValueError(f"FLOWER_BASIC_AUTH {problem}; set user:password to run Flower")
    return auth


# `up --flower` without FLOWER_BASIC_AUTH makes a password of this many random bytes for the
# run (128 bits: beyond guessing), under this user name.
STACK_FLOWER_PASSWORD_BYTES = 16
STACK_FLOWER_USER = "radar"
# Where `up --flower` runs Flower: the `flower` command's default address and port.
STACK_FLOWER_URL = "http://127.0.0.1:5555/"


def _stack_flower_auth() -> tuple[str, str | None]:
    """FLOWER_BASIC_AUTH for the embedded stack's Flower, and the password to print (None:
    the user chose it). The variable when it is set (checked as `flower` checks it); else a
    password made for this run, so `up --flower` needs no setup yet never serves Flower
    without auth."""
    auth = os.environ.get("FLOWER_BASIC_AUTH", "")
    if auth:
        return _checked_flower_auth(auth), None
    password = secrets.token_urlsafe(STACK_FLOWER_PASSWORD_BYTES)
    return f"{STACK_FLOWER_USER}:{password}", password


def _stack_flower_login(password: str | None) -> tuple[dict, str]:
    """How to log in to the embedded stack's Flower, for --json and for people."""
    if password is None:
        login = {"url": STACK_FLOWER_URL, "user": None, "password": None}
        return login, f" Flower on {STACK_FLOWER_URL} (basic auth from FLOWER_BASIC_AUTH)."
    login = {"url": STACK_FLOWER_URL, "user": STACK_FLOWER_USER, "password": password}
    return login, f" Flower on {STACK_FLOWER_URL} (user {STACK_FLOWER_USER}, password {password})."


# Flower's task list shows each message's arguments (the workspace, session and client submit
# ID lead them, docs/operations.md) and result, not only its name and id.
FLOWER_TASK_COLUMNS = "name,kwargs,state,result,received,runtime,worker,uuid"


@cli.command()
@click.option("--port", type=click.IntRange(1, 65535), default=5555, show_default=True)
@click.option("--address", default="127.0.0.1", show_default=True)
@json_option
def flower(port: int, address: str, as_json: bool):
    """Run Flower behind basic auth from FLOWER_BASIC_AUTH=user:password, which is required
    on every address: on the loopback too, any local user (or a web page, by DNS rebinding)
    could otherwise read every task's arguments and call Flower's API. An empty or example
    password is refused."""
    auth = _checked_flower_auth(os.environ.get("FLOWER_BASIC_AUTH", ""))
    from ....tasks import flower_view
    from ....tasks.app import app

    flower_view.install()
    app.start(
        [
            "flower",
            f"--port={port}",
            f"--address={address}",
            f"--basic-auth={auth}",
            f"--tasks_columns={FLOWER_TASK_COLUMNS}",
        ]
    )


SIM_TOKEN_HELP = "A host's token but `default`'s (AGENT_RADAR_HOST_TOKEN): it signs the reports."


@cli.command("runtime-sim")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8765, show_default=True)
@click.option(
    "--host-id",
    default="default",
    show_default=True,
    help="The agent host this simulator is: its reports name it (register it: host add).",
)
@click.option("--token", envvar="AGENT_RADAR_HOST_TOKEN", help=SIM_TOKEN_HELP)
@json_option
def runtime_sim(host: str, port: int, host_id: str, token: str | None, as_json: bool):
    """Run the agent runtime simulator (an HTTP server) in the foreground."""
    from ...adapters.publisher import TaskPublisher
    from ..simulator import SimServer

    settings = Settings.from_env()
    _prepare_home(settings)
    publisher = TaskPublisher(settings)
    server = SimServer(
        host,
        port,
        settings.runtime_token if host_id == "default" else token,
        reporter=lambda report: publisher.publish(
            "agent_radar.report_activity", {"report": report}
        ),
        host_id=host_id,
    )
    _emit(as_json, {"url": server.url}, f"runtime-sim listening on {server.url}")
    server.serve_forever()


@cli.group()
def db() -> None:
    """Database schema."""


@db.command("upgrade")
@json_option
def db_upgrade(as_json: bool):
    """Apply pending Alembic migrations."""
    from ....models.migrate import upgrade

    settings = Settings.from_env()
    _prepare_home(settings)
    revision = upgrade(settings.database_url)
    _emit(as_json, {"revision": revision}, f"database at revision {revision}")


@cli.command()
@click.option("--flower", "with_flower", is_flag=True, help="Also run Flower on :5555.")
@click.option("--workers", type=click.IntRange(1, 16), default=1, show_default=True)
@json_option
def up(with_flower: bool, workers: int, as_json: bool):
    """Run the embedded stack (runtime-sim, worker, beat) in the foreground until Ctrl-C."""
    import signal

    from ..stack import Stack

    def stop_on_sigterm(_signum, _frame):
        # SIGTERM (a service manager, `kill`) stops the stack as Ctrl-C does: nothing is
        # left running behind it.
        raise KeyboardInterrupt

    settings = Settings.from_env()
    flower_auth, flower_password = _stack_flower_auth() if with_flower else ("", None)
    previous = signal.signal(signal.SIGTERM, stop_on_sigterm)
    stack = Stack(settings)
    try:
        stack.prepare()
        stack.start_sim()
        for _ in range(workers):
            stack.start_worker()
        stack.start_beat()
        if with_flower:
            stack.spawn("flower", ["flower"], extra_env={"FLOWER_BASIC_AUTH": flower_auth})
        payload = {
            "home": str(settings.home),
            "runtime_url": settings.runtime_url,
            "pids": {p.name: p.pid for p in stack.procs},
        }
        text = f"agent-radar is up (home {settings.home}); logs in {stack.log_dir}."
        if with_flower:
            payload["flower"], flower_text = _stack_flower_login(flower_password)
            text += flower_text
        _emit(as_json, payload, f"{text} Ctrl-C stops.")
        while all(p.alive() for p in stack.procs):
            time.sleep(0.5)
        gone = next(p.name for p in stack.procs if not p.alive())
        raise ValueError(f"the stack's {gone} exited: see {stack.log_dir / gone}.log")
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM cannot cut the stop
        stack.stop()
        signal.signal(signal.SIGTERM, previous)


@cli.command()
@click.option(
    "--home",
    type=click.Path(file_okay=False),
    default=None,
    help="Folder for the demo's state (default: a fresh temporary folder).",
)
@json_option
def demo(home: str | None, as_json: bool):
    """Run the scripted scenario on a fresh embedded stack, print the timeline, stop."""
    from ..demo import run_demo

    ok = run_demo(Path(home) if home else None, as_json=as_json)
    sys.exit(0 if ok else EXIT_FAILED)


@cli.command()
@click.option("--operations", type=click.IntRange(10, 100000), default=400, show_default=True)
@click.option("--concurrency", type=click.IntRange(1, 16), default=2, show_default=True)
@click.option(
    "--settled",
    type=click.IntRange(0, 1_000_000_000),
    default=0,
    show_default=True,
    help="(d) Also time an exporter scrape, status, a sweep, a goal and retention's deletes "
    "before and after adding this many settled operations to the database (they stay "
    "there: use a database for benchmarks).",
)
@click.option(
    "--nodes",
    type=click.IntRange(1, 8),
    default=1,
    show_default=True,
    help="(e) Also run the operations once more on this many worker nodes (2 processes each).",
)
@click.option(
    "--hosts",
    type=click.IntRange(1, 8),
    default=1,
    show_default=True,
    help="(e) … and this many agent hosts, the sessions shared equally between them.",
)
@click.option(
    "--slow-hosts",
    is_flag=True,
    help="(f) Also measure agent hosts answering in 200 ms (p99 2 s) beside hosts answering "
    "at once, and the healthy hosts' tail beside one that hangs or trickles.",
)
@json_option
def bench(
    operations: int,
    concurrency: int,
    settled: int,
    nodes: int,
    hosts: int,
    slow_hosts: bool,
    as_json: bool,
):
    """Benchmark (docs/benchmarks.md) on the configured database and broker."""
    from ..bench.run import run_bench

    result = run_bench(
        Settings.from_env(),
        operations=operations,
        concurrency=concurrency,
        settled=settled,
        nodes=nodes,
        hosts=hosts,
        slow_hosts=slow_hosts,
        echo=None if as_json else click.echo,
    )
    _emit(as_json, result, "")
    sys.exit(0 if result["exactly_once"] else EXIT_FAILED)

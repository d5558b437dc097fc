"""The `agent-radar` command (DESIGN 7.2).

Every command takes --json, and exits non-zero with a one-line error on bad input. This
module is the composition root: commands that run Celery processes import `tasks` lazily.
"""

import json
import os
import sys
from pathlib import Path
from typing import Any

import click
from sqlalchemy.exc import SQLAlchemyError

from workflows.broker import WORKER_QUEUES
from workflows.config import Settings
from workflows.errors import AgentRadarError
from workflows.records import as_dict

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1


def _emit(as_json: bool, payload: Any, text: str | None = None) -> None:
    if as_json:
        click.echo(json.dumps(payload, default=str, sort_keys=True))
    else:
        click.echo(text if text is not None else json.dumps(payload, default=str, indent=2))


def json_option(fn):
    return click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")(fn)


def session_arguments(fn):
    """WORKSPACE_ID SESSION_ID and --json, the arguments of every per-session command."""
    for decorate in reversed((click.argument("workspace_id"), click.argument("session_id"),
                              json_option)):
        fn = decorate(fn)
    return fn


def _client():
    from workflows.client import AgentRadar
    return AgentRadar.from_env()


@click.group()
def cli() -> None:
    """agent-radar: a durable control plane for fleets of AI agent sessions."""


# -- processes -------------------------------------------------------------------------------
@cli.command()
@click.option("-c", "--concurrency", type=click.IntRange(1, 64), default=2, show_default=True)
@click.option("-Q", "--queues", default=WORKER_QUEUES, show_default=True)
@click.option("--name", default=None, help="Node name prefix (unique per host).")
@click.option("--loglevel", default="INFO", show_default=True)
@json_option
def worker(concurrency: int, queues: str, name: str | None, loglevel: str, as_json: bool):
    """Run a Celery worker (applies pending migrations first)."""
    from models.migrate import upgrade
    settings = Settings.from_env()
    _prepare_home(settings)
    upgrade(settings.database_url)
    from tasks.app import app
    node = f"{name or 'radar'}-{os.getpid()}@%h"
    # No mingle or gossip: nothing here uses revokes or worker-to-worker state (the database
    # coordinates), mingle costs a second at every start, and gossip fails to restart after
    # a broker reconnect. Events (-E) still feed Flower.
    app.worker_main(["worker", "-c", str(concurrency), "-Q", queues, "-n", node,
                     "--loglevel", loglevel, "-E", "--without-mingle", "--without-gossip"])


@cli.command()
@click.option("--schedule-file", default=None, help="Where beat keeps its schedule state.")
@click.option("--loglevel", default="INFO", show_default=True)
@json_option
def beat(schedule_file: str | None, loglevel: str, as_json: bool):
    """Run Celery beat (the sweeper's clock). Run one per deployment."""
    from models.migrate import upgrade
    settings = Settings.from_env()
    _prepare_home(settings)
    upgrade(settings.database_url)
    schedule = schedule_file or str(settings.home / "run" / "celerybeat-schedule")
    Path(schedule).parent.mkdir(parents=True, exist_ok=True)
    from tasks.app import app
    app.start(["beat", "-s", schedule, "--loglevel", loglevel])


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


@cli.command()
@click.option("--port", type=click.IntRange(1, 65535), default=5555, show_default=True)
@click.option("--address", default="127.0.0.1", show_default=True)
@json_option
def flower(port: int, address: str, as_json: bool):
    """Run Flower; FLOWER_BASIC_AUTH=user:password turns on basic auth, and is required
    when Flower listens beyond this machine. An empty or example password is refused."""
    auth = os.environ.get("FLOWER_BASIC_AUTH", "")
    if auth or address not in ("127.0.0.1", "localhost", "::1"):
        problem = flower_auth_problem(auth)
        if problem:
            raise click.UsageError(f"FLOWER_BASIC_AUTH {problem}; set user:password before "
                                   f"running Flower on {address}")
    from tasks.app import app
    argv = ["flower", f"--port={port}", f"--address={address}"]
    if auth:
        argv.append(f"--basic-auth={auth}")
    app.start(argv)


@cli.command("runtime-sim")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8765, show_default=True)
@json_option
def runtime_sim(host: str, port: int, as_json: bool):
    """Run the agent runtime simulator (an HTTP server) in the foreground."""
    from workflows.broker import TaskPublisher
    from workflows.runtime_sim import SimServer
    settings = Settings.from_env()
    _prepare_home(settings)
    publisher = TaskPublisher(settings)
    server = SimServer(host, port, settings.runtime_token, reporter=lambda report:
                       publisher.publish("agent_radar.report_activity", {"report": report}))
    _emit(as_json, {"url": server.url}, f"runtime-sim listening on {server.url}")
    server.serve_forever()


@cli.group()
def db() -> None:
    """Database schema."""


@db.command("upgrade")
@json_option
def db_upgrade(as_json: bool):
    """Apply pending Alembic migrations."""
    from models.migrate import upgrade
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
    from workflows.stack import Stack
    settings = Settings.from_env()
    stack = Stack(settings)
    try:
        stack.prepare()
        stack.start_sim()
        for _ in range(workers):
            stack.start_worker()
        stack.start_beat()
        if with_flower:
            stack.spawn("flower", ["flower"])
        _emit(as_json, {"home": str(settings.home), "runtime_url": settings.runtime_url,
                        "pids": {p.name: p.pid for p in stack.procs}},
              f"agent-radar is up (home {settings.home}); logs in {stack.log_dir}. Ctrl-C stops.")
        import time
        while all(p.alive() for p in stack.procs):
            time.sleep(0.5)
        raise click.ClickException("a process of the stack exited; see the logs")
    except KeyboardInterrupt:
        pass
    finally:
        stack.stop()


@cli.command()
@click.option("--home", type=click.Path(file_okay=False), default=None,
              help="Folder for the demo's state (default: a fresh temporary folder).")
@json_option
def demo(home: str | None, as_json: bool):
    """Run the scripted scenario on a fresh embedded stack, print the timeline, stop."""
    from workflows.demo import run_demo
    ok = run_demo(Path(home) if home else None, as_json=as_json)
    sys.exit(0 if ok else EXIT_FAILED)


@cli.command()
@click.option("--operations", type=click.IntRange(10, 100000), default=400, show_default=True)
@click.option("--concurrency", type=click.IntRange(1, 16), default=2, show_default=True)
@click.option("--settled", type=click.IntRange(0, 10_000_000), default=0, show_default=True,
              help="Also time a sweep before and after adding this many settled operations "
                   "to the database (they stay there: use a database for benchmarks).")
@json_option
def bench(operations: int, concurrency: int, settled: int, as_json: bool):
    """Benchmark (DESIGN 8) on the configured database and broker."""
    from workflows.bench import run_bench
    result = run_bench(Settings.from_env(), operations=operations, concurrency=concurrency,
                       settled=settled, echo=None if as_json else click.echo)
    _emit(as_json, result, "")
    sys.exit(0 if result["exactly_once"] else EXIT_FAILED)


# -- goal control ----------------------------------------------------------------------------
@cli.group()
def goal() -> None:
    """Set, clear, pause or resume a session's goal."""


def _goal_command(action: str, takes_objective: bool):
    def command(workspace_id, session_id, submit_id, expected_revision, wait_s, as_json,
                objective=None):
        client = _client()
        op = client.goal_control(workspace_id, session_id, action, objective,
                                 client_submit_id=submit_id, expected_revision=expected_revision)
        if wait_s is not None:
            op = client.wait(op, timeout=wait_s)
        _emit(as_json, as_dict(op),
              f"{op.operation_id} {op.action} revision {op.goal_revision}: {op.status}"
              f" ({op.provider_phase})" + (f" - {op.last_error}" if op.last_error else ""))
    command.__name__ = f"goal_{action}"
    command.__doc__ = f"{action.capitalize()} the session's goal."
    params = [click.argument("objective")] if takes_objective else []
    params += [
        click.option("--submit-id", "submit_id", required=True, help="Client submit ID."),
        click.option("--expected-revision", type=int, default=None),
        click.option("--wait", "wait_s", is_flag=False, flag_value=30.0, type=float,
                     default=None, help="Wait (up to N s, default 30) until it settles."),
    ]
    for decorate in reversed(params):  # click lists parameters in decoration order
        command = decorate(command)
    return goal.command(action)(session_arguments(command))


for _action, _takes in (("set", True), ("clear", False), ("pause", False), ("resume", False)):
    _goal_command(_action, _takes)


@goal.command("show")
@session_arguments
def goal_show(workspace_id: str, session_id: str, as_json: bool):
    """Show the session's goal state."""
    state = _client().goal_state(workspace_id, session_id)
    _emit(as_json, as_dict(state),
          f"revision {state.revision} {state.sync_status}: desired={state.desired} "
          f"observed={state.observed}")


# -- fences ----------------------------------------------------------------------------------
@cli.command()
@click.argument("workspace_id")
@click.argument("session_id")
@click.argument("target_operation_id")
@click.option("--submit-id", "submit_id", required=True, help="Client submit ID.")
@click.option("--reason", default="", help="Why this generation is revoked.")
@click.option("--wait", "wait_s", is_flag=False, flag_value=30.0, type=float, default=None,
              help="Wait (up to N s, default 30) until the fence is delivered.")
@json_option
def fence(workspace_id, session_id, target_operation_id, submit_id, reason, wait_s, as_json):
    """Revoke one exact goal generation (and clear it if it is still current)."""
    client = _client()
    record = client.fence_goal_generation(workspace_id, session_id, target_operation_id,
                                          client_submit_id=submit_id, reason=reason)
    if wait_s is not None:
        record = client.wait(record, timeout=wait_s)
    _emit(as_json, as_dict(record),
          f"fence {record.fence_id} on {record.target_operation_id} revision "
          f"{record.target_revision}: {record.status} (intent accepted)"
          + (f", clear {record.clear_operation_id}" if record.clear_operation_id else
             ", no clear: a newer goal is current"))


# -- maintenance and prompts -----------------------------------------------------------------
@cli.group("maintenance")
def maintenance_group() -> None:
    """Exclusive per-session maintenance such as context compaction."""


def _run_line(run) -> str:
    extra = f" ({run.error_code})" if run.error_code else ""
    return f"{run.run_id} {run.kind} revision {run.revision}: {run.status}{extra}"


@maintenance_group.command("start")
@session_arguments
@click.option("--kind", default="compact", show_default=True,
              type=click.Choice(["compact", "summarize_up_to", "summarize_from"]))
@click.option("--turn", type=click.IntRange(1), default=None,
              help="For summarize_up_to / summarize_from.")
@click.option("--submit-id", "submit_id", required=True, help="Client submit ID.")
@click.option("--wait", "wait_s", is_flag=False, flag_value=300.0, type=float, default=None,
              help="Wait (up to N s, default 300) until the run settles.")
def maintenance_start(workspace_id, session_id, as_json, kind, turn, submit_id, wait_s):
    """Start a maintenance run (the session is held until it settles)."""
    client = _client()
    run = client.start_maintenance(workspace_id, session_id, kind, client_submit_id=submit_id,
                                   args={"turn": turn} if turn is not None else None)
    if wait_s is not None:
        run = client.wait(run, timeout=wait_s)
    _emit(as_json, as_dict(run), _run_line(run))


@maintenance_group.command("cancel")
@click.argument("run_id")
@json_option
def maintenance_cancel(run_id, as_json):
    """Ask a running maintenance run to stop."""
    run = _client().cancel_maintenance(run_id)
    _emit(as_json, as_dict(run), _run_line(run))


@maintenance_group.command("show")
@click.argument("run_id")
@json_option
def maintenance_show(run_id, as_json):
    """Show a maintenance run."""
    run = _client().get_maintenance(run_id)
    _emit(as_json, as_dict(run), _run_line(run))


@cli.command()
@session_arguments
@click.argument("text")
@click.option("--submit-id", "submit_id", required=True, help="Client submit ID.")
def prompt(workspace_id, session_id, as_json, text, submit_id):
    """Queue a prompt for the session (sent when it is idle and not held)."""
    record = _client().submit_prompt(workspace_id, session_id, text, client_submit_id=submit_id)
    _emit(as_json, as_dict(record),
          f"{record.prompt_id} position {record.position}: {record.status}")


@cli.command()
@session_arguments
@click.option("--limit", type=click.IntRange(1, 10000), default=50, show_default=True)
def history(workspace_id, session_id, as_json, limit):
    """The session's records: one row per record, at its first position."""
    rows = _client().history(workspace_id, session_id, limit)
    lines = [f"{r.sequence:5d} {r.kind:13s} {r.record_id} revision {r.revision}"
             + (" (pending)" if r.pending else "") for r in rows]
    _emit(as_json, [as_dict(r) for r in rows], "\n".join(lines) or "no records")


# -- sessions --------------------------------------------------------------------------------
@cli.group()
def session() -> None:
    """Session control."""


@session.command("ensure")
@session_arguments
def session_ensure(workspace_id: str, session_id: str, as_json: bool):
    """Resume the session if it is offline (with its fences) and wake its pending work."""
    info = _client().ensure_session(workspace_id, session_id)
    _emit(as_json, as_dict(info), f"{workspace_id}/{session_id} live, epoch {info.runtime_epoch}")


@session.command("drain")
@session_arguments
def session_drain(workspace_id: str, session_id: str, as_json: bool):
    """Stop admitting maintenance on the session."""
    info = _client().drain_session(workspace_id, session_id)
    _emit(as_json, as_dict(info), f"{workspace_id}/{session_id} admission {info.admission}")


@session.command("show")
@session_arguments
def session_show(workspace_id: str, session_id: str, as_json: bool):
    """Show what the database knows of a session."""
    info = _client().session_info(workspace_id, session_id)
    _emit(as_json, as_dict(info))


@cli.command()
@json_option
def status(as_json: bool):
    """The fleet at a glance: counts per status, due and overdue work, sweeper lag."""
    from workflows.status import fleet_status, render_status
    client = _client()
    result = fleet_status(client.engine)
    _emit(as_json, result, render_status(result))


def _prepare_home(settings: Settings) -> None:
    settings.home.mkdir(parents=True, exist_ok=True)


def main(argv: list[str] | None = None) -> None:
    try:
        cli.main(args=argv, prog_name="agent-radar", standalone_mode=False)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as exc:
        click.echo(f"error: {exc.format_message()}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    except AgentRadarError as exc:
        click.echo(f"error: {exc.code}: {exc.message}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    except (ValueError, TimeoutError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_FAILED)
    except SQLAlchemyError as exc:
        first_line = str(getattr(exc, "orig", exc)).strip().splitlines()[0]
        click.echo(f"error: database: {first_line} (is it reachable and upgraded? "
                   "`agent-radar db upgrade`)", err=True)
        sys.exit(EXIT_FAILED)


if __name__ == "__main__":
    main()

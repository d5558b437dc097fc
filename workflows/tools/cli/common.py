"""What every command group shares: the `agent-radar` group, output, errors (docs/operations.md).

Every command takes --json, and exits non-zero with a one-line error on bad input.

Human output is rows, and each row is escaped whole (workflows/escape.py): ids, reasons,
objectives and errors come from the database and from outside, and nothing they say may
start a row or reach the terminal as a control sequence. --json is JSON with every
non-ASCII character as \\uXXXX (ensure_ascii), so U+2028, bidi overrides and control
characters are never raw in it either, and it still parses to the exact values.
"""

import json
import sys
from collections.abc import Sequence
from typing import Any

import click
from sqlalchemy.exc import SQLAlchemyError

from ...adapters.config import Settings
from ...errors import (
    AgentRadarError,
    DatabaseNotReady,
    InvalidArgument,
    NotFound,
    RuntimeDisconnected,
    RuntimeFault,
)
from ...escape import escape
from ...validation import MAX_WAIT_S, check_seconds

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1
# What was asked for does not exist (an id, a session, a submit ID): not a usage error.
EXIT_NOT_FOUND = 3
# What the `server` extra installs (pyproject.toml), as a missing import names it.
SERVER_MODULES = frozenset({"celery", "alembic", "flower", "prometheus_client", "tornado"})


def _emit(as_json: bool, payload: Any, text: str | Sequence[str] | None = None) -> None:
    """`payload` as JSON under --json; else `text`, a row or a list of rows (the payload
    as indented JSON without it)."""
    if as_json:
        click.echo(json.dumps(payload, default=str, sort_keys=True, ensure_ascii=True))
    elif text is None:
        click.echo(json.dumps(payload, default=str, indent=2, ensure_ascii=True))
    else:
        click.echo(_rows(text))


def _rows(text: str | Sequence[str]) -> str:
    """Each row escaped, so that a row is one line whatever the values in it say. A string
    is one row: a caller that means several rows passes a list."""
    return "\n".join(escape(row) for row in ([text] if isinstance(text, str) else text))


def wait_option(default_s: float, until: str):
    """`--wait [N]`: wait up to N seconds (`default_s` without N) until `until`. N is checked
    before the command does anything: a bad one is a usage error and writes nothing."""

    def checked(_ctx, _param, value):
        if value is None:
            return None
        try:
            return check_seconds("--wait", value, maximum=MAX_WAIT_S)
        except InvalidArgument as exc:
            raise click.BadParameter(str(exc)) from None

    return click.option(
        "--wait",
        "wait_s",
        is_flag=False,
        flag_value=default_s,
        type=float,
        default=None,
        callback=checked,
        help=f"Wait (up to N s, default {default_s:g}) until {until}.",
    )


def exit_if_failed(record: Any, waited: bool) -> None:
    """After `--wait`: a record that settled `failed` exits EXIT_FAILED (its row was printed)."""
    if waited and getattr(record, "status", None) == "failed":
        sys.exit(EXIT_FAILED)


def json_option(fn):
    return click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")(fn)


def session_arguments(fn):
    """WORKSPACE_ID SESSION_ID and --json, the arguments of every per-session command."""
    for decorate in reversed(
        (click.argument("workspace_id"), click.argument("session_id"), json_option)
    ):
        fn = decorate(fn)
    return fn


def _client():
    """The command's client, closed as the command ends: what it published is at the broker
    by then (the exit code does not come before the message), and nothing of it outlives
    the command, in its own process or in one that runs commands (tests/tools/test_cli.py)."""
    from ...client import AgentRadar

    client = AgentRadar.from_env()
    click.get_current_context().call_on_close(client.close)
    return client


@click.group()
@click.version_option(package_name="agent-radar", prog_name="agent-radar")
def cli() -> None:
    """agent-radar: a durable control plane for fleets of AI agent sessions."""


def _prepare_home(settings: Settings) -> None:
    settings.home.mkdir(parents=True, exist_ok=True)


def _fail(exit_code: int, code: str, message: str, as_json: bool) -> None:
    """One line on stderr — JSON under --json — and the exit code."""
    if as_json:
        click.echo(json.dumps({"error": code, "message": message}, ensure_ascii=True), err=True)
    else:
        # An error names what it refused (an id, a reason): escaped, the error stays a line.
        line = f"error: {message if code == 'usage' else f'{code}: {message}'}"
        click.echo(_rows(line), err=True)
    sys.exit(exit_code)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    as_json = "--json" in args
    try:
        cli.main(args=args, prog_name="agent-radar", standalone_mode=False)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as exc:
        _fail(EXIT_BAD_INPUT, "usage", exc.format_message(), as_json)
    except NotFound as exc:
        _fail(EXIT_NOT_FOUND, exc.code, exc.message, as_json)
    except (DatabaseNotReady, RuntimeFault, RuntimeDisconnected) as exc:
        # Not bad input: the database is not set up, or the agent host failed or is away.
        _fail(EXIT_FAILED, exc.code, exc.message, as_json)
    except TimeoutError as exc:  # a `--wait` that ran out: nothing failed, it goes on
        _fail(EXIT_FAILED, "timeout", str(exc), as_json)
    except AgentRadarError as exc:
        _fail(EXIT_BAD_INPUT, exc.code, exc.message, as_json)
    except ValueError as exc:
        _fail(EXIT_FAILED, "failed", str(exc), as_json)
    except ModuleNotFoundError as exc:
        if exc.name not in SERVER_MODULES:
            raise
        # A plain install is a client (docs/packaging.md): workers, beat, Flower, the
        # exporter and migrations need the server extra.
        _fail(
            EXIT_FAILED,
            "not_installed",
            f"this command needs {exc.name}, which comes with the server extra: "
            "pip install 'agent-radar[server]'",
            as_json,
        )
    except OSError as exc:
        # What the machine refused (a port in use, a folder it may not write): one line.
        where = f" ({exc.filename})" if exc.filename else ""
        _fail(EXIT_FAILED, "os_error", f"{exc.strerror or exc}{where}", as_json)
    except SQLAlchemyError as exc:
        _fail(
            EXIT_FAILED,
            "database",
            f"{first_line(exc)} (is it reachable and upgraded? `agent-radar db upgrade`)",
            as_json,
        )


def first_line(exc: BaseException) -> str:
    """What a database or broker error says, in one line: the driver's own words, which name
    the server or file (never a password), else the exception's class."""
    said = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return said[0][:300] if said else exc.__class__.__name__


def error_note(status: str, last_error: str | None, sep: str) -> str:
    """An operation's error after its status line: why it failed or waits, or (completed)
    the error of an attempt that failed before it went through."""
    if not last_error:
        return ""
    if status == "completed":
        return f"{sep}after a failed attempt: {last_error}"
    return f"{sep}{last_error}"

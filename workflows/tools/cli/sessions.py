"""`prompt`, `history`, `session ensure|drain|show|stop` (docs/lifecycles.md: prompts, sessions) and
`host add|remove|list` (4.9), `host-check` (docs/host-check.md)."""

import sys

import click

from ...errors import AgentRadarError
from ...records import as_dict
from .common import (
    EXIT_FAILED,
    _client,
    _emit,
    cli,
    error_note,
    exit_if_failed,
    json_option,
    session_arguments,
    wait_option,
)


@cli.command()
@session_arguments
@click.argument("text")
@click.option("--submit-id", "submit_id", required=True, help="Client submit ID.")
@wait_option(300, "its turn has ended")
def prompt(workspace_id, session_id, as_json, text, submit_id, wait_s):
    """Queue a prompt for the session (sent when it is idle and not held)."""
    client = _client()
    record = client.submit_prompt(workspace_id, session_id, text, client_submit_id=submit_id)
    if wait_s is not None:
        record = client.wait(record, timeout=wait_s)
    _emit(
        as_json, as_dict(record), f"{record.prompt_id} position {record.position}: {record.status}"
    )
    exit_if_failed(record, wait_s is not None)


@cli.command()
@session_arguments
@click.option("--limit", type=click.IntRange(1, 10000), default=50, show_default=True)
def history(workspace_id, session_id, as_json, limit):
    """The session's records: one row per record, at its first position, with what became
    of it — its status now and, for an operation that was tried more than once or failed,
    its attempts and the error of its latest failed attempt."""
    client = _client()
    rows = client.history(workspace_id, session_id, limit)
    outcomes = [_outcome(client, workspace_id, r) for r in rows]
    lines = [
        f"{r.created_at:%Y-%m-%d %H:%M:%S}  {r.sequence:5d} {r.kind:15s} "
        f"{outcome['status']:18s} {r.record_id}"
        + (f" revision {r.revision}" if r.revision is not None else "")
        + (" (pending)" if r.pending else "")
        + (f"  reason: {r.payload['reason']}" if (r.payload or {}).get("reason") else "")
        + (f"  attempts: {outcome['attempt']}" if (outcome.get("attempt") or 0) > 1 else "")
        + error_note(outcome["status"], outcome.get("last_error"), "  last error: ")
        for r, outcome in zip(rows, outcomes, strict=True)
    ]
    _emit(
        as_json,
        [as_dict(r) | {"outcome": o} for r, o in zip(rows, outcomes, strict=True)],
        lines or "no records",
    )


def _outcome(client, workspace_id: str, row) -> dict:
    """What became of a history row's record: a maintenance record carries its status, an
    operator action is its action, an operation is looked up (its status now, its attempts
    and the error of its latest failed attempt)."""
    payload = row.payload or {}
    if isinstance(payload.get("record"), dict):
        return {"status": str(payload["record"].get("status"))}
    if "action" in payload and row.kind == "operator-action":
        return {"status": str(payload["action"])}
    try:
        # A record id is `<kind>:<id>`.
        record = client.get_operation(row.record_id.split(":", 1)[-1], workspace_id=workspace_id)
    except AgentRadarError:
        return {"status": "-"}
    return {
        "status": record.status,
        "attempt": getattr(record, "attempt", None),
        "last_error": getattr(record, "last_error", None),
    }


# -- sessions --------------------------------------------------------------------------------
@cli.group()
def session() -> None:
    """Session control."""


@session.command("ensure")
@session_arguments
@click.option("--host", "host_id", default=None, help="Bind the session to this host first.")
def session_ensure(workspace_id: str, session_id: str, as_json: bool, host_id: str | None):
    """Resume the session if it is offline (with its fences) and wake its pending work."""
    info = _client().ensure_session(workspace_id, session_id, host_id=host_id)
    _emit(
        as_json,
        as_dict(info),
        f"{workspace_id}/{session_id} live on {info.host_id}, epoch {info.runtime_epoch}",
    )


REASON = click.option("--reason", required=True, help="Why (kept in the session's events).")


def _admission_command(name: str, method: str, help_text: str) -> None:
    """`session drain` and `session undrain`: the same audited action, two directions."""

    @session.command(name, help=help_text)
    @session_arguments
    @REASON
    def command(workspace_id: str, session_id: str, as_json: bool, reason: str):
        info = getattr(_client(), method)(workspace_id, session_id, reason=reason)
        _emit(as_json, as_dict(info), f"{workspace_id}/{session_id} admission {info.admission}")


_admission_command(
    "drain", "drain_session", "Stop admitting maintenance on the session (an audited action)."
)
_admission_command(
    "undrain", "undrain_session", "Admit maintenance on the session again (an audited action)."
)


@session.command("show")
@session_arguments
def session_show(workspace_id: str, session_id: str, as_json: bool):
    """Show what the database knows of a session."""
    info = _client().session_info(workspace_id, session_id)
    _emit(as_json, as_dict(info))


@session.command("stop")
@session_arguments
@click.option("--submit-id", "submit_id", required=True, help="Client submit ID.")
@click.option("--reason", default="", help="Why the session is stopped (audited).")
@wait_option(60, "the turn and the run have ended")
def session_stop(workspace_id, session_id, as_json, submit_id, reason, wait_s):
    """Cancel the session's running turn and its active maintenance run (queued prompts and
    goal operations stay queued)."""
    client = _client()
    record = client.stop_session(
        workspace_id, session_id, client_submit_id=submit_id, reason=reason
    )
    if wait_s is not None:
        record = client.wait(record, timeout=wait_s)
    _emit(
        as_json,
        as_dict(record),
        f"stop {record.stop_id} {record.status} (turn {record.turn_id or '-'}, "
        f"run {record.run_id or '-'})",
    )
    exit_if_failed(record, wait_s is not None)


@cli.group()
def host() -> None:
    """Agent hosts (docs/lifecycles.md: sessions): where each session's runtime calls go."""


def _host_line(h) -> str:
    # Two spaces between the columns, not a tab: a row is escaped whole, tabs included.
    return f"{h.host_id}  {h.url}  {h.sessions} session(s)"


@host.command("add")
@click.argument("host_id")
@click.argument("url")
@click.option("--replace", is_flag=True, help="Give a registered host a new URL or token.")
@click.option(
    "--token",
    envvar="AGENT_RADAR_HOST_TOKEN",
    default=None,
    help="The bearer token this host alone accepts (or AGENT_RADAR_HOST_TOKEN, which keeps"
    " it out of the shell's history).",
)
@json_option
def host_add(host_id: str, url: str, replace: bool, token: str | None, as_json: bool):
    """Register an agent host at URL, with its own token."""
    h = _client().add_host(host_id, url, replace=replace, token=token)
    _emit(as_json, as_dict(h), _host_line(h))


@host.command("remove")
@click.argument("host_id")
@json_option
def host_remove(host_id: str, as_json: bool):
    """Unregister an agent host that no session is bound to."""
    h = _client().remove_host(host_id)
    _emit(as_json, as_dict(h), f"removed {h.host_id} ({h.url})")


@host.command("list")
@json_option
def host_list(as_json: bool):
    """Every host, with the sessions bound to it."""
    found = _client().list_hosts()
    _emit(as_json, [as_dict(h) for h in found], [_host_line(h) for h in found])


# The brokers a host's reports are read from by `host-check --reports-from`.
REPORT_BROKERS = ("redis", "rediss", "amqp", "amqps")


@cli.command("host-check")
@click.argument("url")
@click.option(
    "--token",
    envvar="AGENT_RADAR_HOST_TOKEN",
    default=None,
    help="The host's bearer token (or AGENT_RADAR_HOST_TOKEN).",
)
@click.option(
    "--deadline-s",
    type=click.FloatRange(0.1, 600),
    default=10.0,
    show_default=True,
    help="How long a whole call may take (the workers' AGENT_RADAR_RUNTIME_TIMEOUT_S).",
)
@click.option(
    "--test-hooks",
    is_flag=True,
    help="Take a check session offline and restart it through the simulator's control calls,"
    " which the host under test offers (docs/host-check.md).",
)
@click.option(
    "--reports-from",
    default=None,
    help="A broker URL (redis:// or amqp://) the host publishes its reports to and no worker"
    " reads: its reports are checked too (docs/host-check.md).",
)
@click.option(
    "--host-id",
    default="default",
    show_default=True,
    help="The id the host signs its reports with (`agent-radar host add ID …`).",
)
@click.option(
    "--reports-prefix",
    default="",
    help="The Redis key prefix the host publishes its reports under"
    " (AGENT_RADAR_BROKER_KEY_PREFIX).",
)
@click.option(
    "--reports-wait-s",
    type=click.FloatRange(0.5, 600),
    default=10.0,
    show_default=True,
    help="How long to wait for the reports a host must send.",
)
@json_option
def host_check(
    url: str,
    token: str | None,
    deadline_s: float,
    test_hooks: bool,
    reports_from: str | None,
    host_id: str,
    reports_prefix: str,
    reports_wait_s: float,
    as_json: bool,
):
    """Check an agent host at URL against the protocol's promises (docs/protocol.md), in any
    language: one line per promise, pass or fail with the evidence; exits 1 on a failure. It
    works in a workspace of its own; point it at a host under test, not one in use."""
    from urllib.parse import urlsplit

    from ..host_check import FAIL, check_host

    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - a port out of range raises here
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise click.BadParameter("an http:// or https:// URL", param_hint="URL")
    if reports_from is not None and urlsplit(reports_from).scheme not in REPORT_BROKERS:
        raise click.BadParameter(
            f"a broker URL ({', '.join(REPORT_BROKERS)})", param_hint="--reports-from"
        )
    lines = check_host(
        url, token, deadline_s, test_hooks, reports_from, host_id, reports_wait_s, reports_prefix
    )
    _emit(as_json, [as_dict(line) for line in lines], [str(line) for line in lines])
    if any(line.verdict == FAIL for line in lines):
        sys.exit(EXIT_FAILED)

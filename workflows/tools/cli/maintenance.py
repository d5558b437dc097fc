"""`maintenance start|cancel|show` (docs/lifecycles.md: maintenance)."""

import click

from ...records import as_dict
from .common import (
    _client,
    _emit,
    cli,
    exit_if_failed,
    json_option,
    session_arguments,
    wait_option,
)


@cli.group("maintenance")
def maintenance_group() -> None:
    """Exclusive per-session maintenance such as context compaction."""


def _run_line(run) -> str:
    extra = f" ({run.error_code})" if run.error_code else ""
    return f"{run.run_id} {run.kind} revision {run.revision}: {run.status}{extra}"


@maintenance_group.command("start")
@session_arguments
@click.option(
    "--kind",
    default="compact",
    show_default=True,
    type=click.Choice(["compact", "summarize_up_to", "summarize_from"]),
)
@click.option(
    "--turn", type=click.IntRange(1), default=None, help="For summarize_up_to / summarize_from."
)
@click.option("--submit-id", "submit_id", required=True, help="Client submit ID.")
@click.option(
    "--expected-epoch",
    "expected_epoch",
    type=click.IntRange(0),
    default=None,
    help="The runtime epoch you saw; refused (runtime_draining) if the session moved on.",
)
@wait_option(300, "the run settles")
def maintenance_start(
    workspace_id, session_id, as_json, kind, turn, submit_id, expected_epoch, wait_s
):
    """Start a maintenance run (the session is held until it settles)."""
    client = _client()
    run = client.start_maintenance(
        workspace_id,
        session_id,
        kind,
        client_submit_id=submit_id,
        args={"turn": turn} if turn is not None else None,
        expected_runtime_epoch=expected_epoch,
    )
    if wait_s is not None:
        run = client.wait(run, timeout=wait_s)
    _emit(as_json, as_dict(run), _run_line(run))
    exit_if_failed(run, wait_s is not None)


@maintenance_group.command("cancel")
@click.argument("run_id")
@json_option
def maintenance_cancel(run_id, as_json):
    """Ask a running maintenance run to stop."""
    run = _client().cancel_maintenance(run_id)
    _emit(as_json, as_dict(run), _run_line(run))


@maintenance_group.command("resolve")
@click.argument("run_id")
@click.option("--to", "to", type=click.Choice(["failed", "completed"]), required=True)
@click.option("--reason", required=True, help="Why (kept in the session's events).")
@click.option("--workspace", "workspace_id", default=None, help="Only in this workspace.")
@json_option
def maintenance_resolve(run_id, to, reason, workspace_id, as_json):
    """End a run in recovery_required as failed or completed; its session's held work goes
    on (an audited operator action)."""
    run = _client().resolve_maintenance(run_id, to=to, reason=reason, workspace_id=workspace_id)
    _emit(as_json, as_dict(run), _run_line(run))


@maintenance_group.command("show")
@click.argument("run_id")
@json_option
def maintenance_show(run_id, as_json):
    """Show a maintenance run."""
    run = _client().get_maintenance(run_id)
    _emit(as_json, as_dict(run), _run_line(run))

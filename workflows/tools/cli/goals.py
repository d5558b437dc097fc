"""`goal set|clear|pause|resume|show` and `fence` (docs/lifecycles.md: goals, fences)."""

import click

from ...records import as_dict
from .common import (
    _client,
    _emit,
    cli,
    error_note,
    exit_if_failed,
    json_option,
    session_arguments,
    wait_option,
)


@cli.group()
def goal() -> None:
    """Set, clear, pause or resume a session's goal."""


def _goal_command(action: str, takes_objective: bool):
    def command(
        workspace_id, session_id, submit_id, expected_revision, wait_s, as_json, objective=None
    ):
        client = _client()
        op = client.goal_control(
            workspace_id,
            session_id,
            action,
            objective,
            client_submit_id=submit_id,
            expected_revision=expected_revision,
        )
        if wait_s is not None:
            op = client.wait(op, timeout=wait_s)
        _emit(
            as_json,
            as_dict(op),
            f"{op.operation_id} {op.action} revision {op.goal_revision}: {op.status}"
            f" ({op.provider_phase})" + error_note(op.status, op.last_error, " - "),
        )
        exit_if_failed(op, wait_s is not None)

    command.__name__ = f"goal_{action}"
    command.__doc__ = f"{action.capitalize()} the session's goal."
    params = [click.argument("objective")] if takes_objective else []
    params += [
        click.option("--submit-id", "submit_id", required=True, help="Client submit ID."),
        click.option("--expected-revision", type=int, default=None),
        wait_option(30, "it settles"),
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
    _emit(
        as_json,
        as_dict(state),
        f"revision {state.revision} {state.sync_status}: desired={state.desired} "
        f"observed={state.observed}",
    )


# -- fences ----------------------------------------------------------------------------------
@cli.command()
@click.argument("workspace_id")
@click.argument("session_id")
@click.argument("target_operation_id")
@click.option("--submit-id", "submit_id", required=True, help="Client submit ID.")
@click.option("--reason", default="", help="Why this generation is revoked.")
@wait_option(30, "the fence is delivered")
@json_option
def fence(workspace_id, session_id, target_operation_id, submit_id, reason, wait_s, as_json):
    """Revoke one exact goal generation (and clear it if it is still current)."""
    client = _client()
    record = client.fence_goal_generation(
        workspace_id, session_id, target_operation_id, client_submit_id=submit_id, reason=reason
    )
    if wait_s is not None:
        record = client.wait(record, timeout=wait_s)
    _emit(
        as_json,
        as_dict(record),
        f"fence {record.fence_id} on {record.target_operation_id} revision "
        f"{record.target_revision}: {record.status} (intent accepted)"
        + (
            f", clear {record.clear_operation_id}"
            if record.clear_operation_id
            else ", no clear: a newer goal is current"
        ),
    )
    exit_if_failed(record, wait_s is not None)

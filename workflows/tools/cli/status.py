"""`status`: the fleet at a glance (DESIGN 7.2)."""

import sys

import click

from workflows.tools.cli.common import EXIT_FAILED, _client, _emit, cli, json_option


@cli.command()
@json_option
@click.option(
    "--check",
    is_flag=True,
    help="Exit 1 when work is overdue, a run needs recovery, or the sweeper is not running.",
)
def status(as_json: bool, check: bool):
    """The fleet at a glance: counts per status, due and overdue work, sweeper lag and
    heartbeat, and the worst offenders by name."""
    from workflows.tools.status import fleet_status, problems, render_status

    client = _client()
    result = fleet_status(client.engine)
    found = problems(result, client.settings.sweep_interval_s)
    result["problems"] = found
    text = render_status(result) + "".join(f"\nproblem: {p}" for p in found)
    _emit(as_json, result, text)
    if check and found:
        sys.exit(EXIT_FAILED)

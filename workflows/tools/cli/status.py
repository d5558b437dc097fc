"""`status`: the fleet at a glance (DESIGN 7.2)."""

from workflows.tools.cli.common import _client, _emit, cli, json_option


@cli.command()
@json_option
def status(as_json: bool):
    """The fleet at a glance: counts per status, due and overdue work, sweeper lag."""
    from workflows.tools.status import fleet_status, render_status

    client = _client()
    result = fleet_status(client.engine)
    _emit(as_json, result, render_status(result))

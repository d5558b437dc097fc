"""`status`: the fleet at a glance (docs/operations.md), and `metrics`, its Prometheus exporter."""

import sys

import click

from .common import EXIT_FAILED, _client, _emit, cli, json_option


@cli.command()
@json_option
@click.option(
    "--check",
    is_flag=True,
    help=(
        "Exit 1 on a problem: overdue goal work, a goal operation or fence failed in the last"
        " hour, a run in recovery, a host skipped, a diverged goal, a restore out of budget,"
        " a wedged session, or no sweep for five intervals."
    ),
)
def status(as_json: bool, check: bool):
    """The fleet at a glance: counts per status, due and overdue work, sweeper lag and
    heartbeat, and the worst offenders by name."""
    from ..status import fleet_status, problems, render_status

    client = _client()
    result = fleet_status(client.engine)
    if not client.settings.runtime_token:  # `default` is AGENT_RADAR_RUNTIME_URL's host
        result["unsigned_report_hosts"] = ["default", *result["unsigned_report_hosts"]]
    found = problems(result, client.settings.sweep_interval_s)
    result["problems"] = found
    _emit(as_json, result, render_status(result) + [f"problem: {p}" for p in found])
    if check and found:
        sys.exit(EXIT_FAILED)


@cli.command()
@click.option("--address", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=9808, show_default=True)
@click.option("--once", is_flag=True, help="Print the metrics once (exposition format) and exit.")
@click.option(
    "--top-workspaces",
    type=click.IntRange(0, 1000),
    default=20,
    show_default=True,
    help="Workspaces with series of their own (the most operations); the rest are 'other'.",
)
def metrics(address: str, port: int, once: bool, top_workspaces: int):
    """A Prometheus exporter: fleet gauges read from the database on every scrape."""
    from prometheus_client import CollectorRegistry, generate_latest, start_http_server

    from ..metrics import FleetCollector

    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(_client().engine, top_workspaces))
    if once:
        click.echo(generate_latest(registry).decode(), nl=False)
        return
    server, thread = start_http_server(port, addr=address, registry=registry)
    click.echo(f"metrics on http://{address}:{server.server_port}/metrics", err=True)
    try:
        thread.join()
    except KeyboardInterrupt:
        server.shutdown()

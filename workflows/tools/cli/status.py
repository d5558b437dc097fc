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
        "Exit 1 on a problem: overdue goal work, a goal operation, fence or cancel failed in the"
        " last hour, a run in recovery, a host skipped, a diverged goal, a restore out of budget,"
        " a wedged session, a run its host does not stop, or no sweep for five intervals."
    ),
)
def status(as_json: bool, check: bool):
    """The fleet at a glance: counts per status, due and overdue work, sweeper lag and
    heartbeat, and the worst offenders by name."""
    from ..status import fleet_status, problems

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


def render_status(status: dict) -> list[str]:
    """The status as rows for a person (the CLI escapes each row: ids and errors in them
    come from the database)."""
    per_status = ", ".join(f"{k} {v}" for k, v in sorted(status["goal_operations"].items()))
    runs = ", ".join(f"{k} {v}" for k, v in sorted(status["maintenance_runs"].items()))
    fences = ", ".join(f"{k} {v}" for k, v in sorted(status["fences"].items()))
    cancels = ", ".join(f"{k} {v}" for k, v in sorted(status["cancels"].items()))
    prompts = ", ".join(f"{k} {v}" for k, v in sorted(status["prompts"].items()))
    exhausted = ", ".join(
        f"{k.replace('_', ' ')} {v}" for k, v in status["budget_exhausted"].items()
    )
    heartbeat = status["sweeper_heartbeat_age_s"]
    return [
        f"goal operations: {per_status or 'none'}",
        f"fences: {fences or 'none'}; turn cancels: {cancels or 'none'}",
        f"maintenance runs: {runs or 'none'}; held sessions: {status['held_sessions']}, "
        f"in recovery: {status['sessions_in_recovery']}; "
        f"queued prompts: {status['queued_prompts']}",
        f"prompts: {prompts or 'none'}; out of budget: {exhausted}",
        f"goals diverged: {status['goals_diverged']}, unknown: {status['goals_unknown']}; "
        f"restores retrying: {status['restores_retrying']}, out of budget: "
        f"{status['restores_out_of_budget']}; wedged sessions: {status['wedged_sessions']}; "
        f"runs not stopping: {status['runs_not_stopping']}",
        f"due now: {status['due']} (overdue {status['overdue']}), in flight: {status['in_flight']}",
        f"sweeper lag: {status['sweeper_lag_s']} s; last sweep: "
        + ("never" if heartbeat is None else f"{heartbeat} s ago"),
        *(
            [
                "unsigned reports taken from (hosts without a token; development only): "
                + ", ".join(status["unsigned_report_hosts"])
            ]
            if status.get("unsigned_report_hosts")
            else []
        ),
        *(
            f"reports refused from host {r['host_id']}: {r['refused']} "
            f"(the last {r['last_at']}: {r['last_code']})"
            for r in status.get("report_refusals", [])
        ),
        *(
            f"host {h['host_id']} skipped for {h['for_s']} s: {h['failures']} calls failed"
            f" in a row ({h['last_error']})"
            for h in status.get("hosts_skipped", [])
        ),
        *_render_worst(status["worst"]),
    ]


def _render_worst(worst: dict) -> list[str]:
    lines = []
    for item in worst["overdue_operations"]:
        lines.append(
            f"  overdue {item['overdue_s']} s: goal operation {item['operation_id']} "
            f"({item['session']}, attempt {item['attempt']}"
            + (f", {item['last_error']}" if item["last_error"] else "")
            + ")"
        )
    for item in worst["failed_recently"]:
        lines.append(
            f"  failed: {item['kind']} {item['id']} ({item['session']}, {item['last_error']})"
        )
    for item in worst["runs_in_recovery"]:
        lines.append(
            f"  in recovery: run {item['run_id']} ({item['session']}, {item['error_code']})"
        )
    for item in worst["prompts_retrying"]:
        lines.append(
            f"  retrying: prompt {item['prompt_id']} ({item['session']}, attempt "
            f"{item['attempt']}, {item['last_error']})"
        )
    for item in worst["restores_out_of_budget"]:
        lines.append(f"  restore out of budget: {item['session']} ({item['last_error']})")
    for item in worst["diverged_goals"]:
        lines.append(f"  diverged: goal of {item['session']} (revision {item['revision']})")
    for session in worst["wedged_sessions"]:
        lines.append(f"  wedged: {session}")
    for item in worst["fences_waiting_on_a_turn"]:
        lines.append(
            f"  waiting on a turn: fence {item['fence_id']} ({item['session']}, cancel "
            f"{item['cancel_operation_id']})"
        )
    return ["worst:", *lines] if lines else []

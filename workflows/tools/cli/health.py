"""`health worker|beat|db|broker`: probes for compose and Kubernetes (exit 0 healthy, 1 not,
one line saying why)."""

import sys

import click

from ...adapters.config import Settings
from .common import EXIT_FAILED, _emit, cli, first_line, json_option


def _report(as_json: bool, ok: bool, what: str, detail: str) -> None:
    _emit(as_json, {"ok": ok, "what": what, "detail": detail}, f"{what}: {detail}")
    if not ok:
        sys.exit(EXIT_FAILED)


@cli.group()
def health() -> None:
    """Health probes: exit 0 when healthy, 1 when not."""


@health.command("db")
@json_option
def health_db(as_json: bool):
    """The database answers and is migrated to this version's schema."""
    from ....models.migrate import current_revision, head_revision

    settings = Settings.from_env()
    try:
        current = current_revision(settings.database_url)
    except Exception as exc:  # noqa: BLE001 - a probe reports, it does not raise
        _report(as_json, False, "db", f"unreachable: {first_line(exc)}")
        return
    head = head_revision()
    _report(as_json, current == head, "db", f"at revision {current}, this version needs {head}")


@health.command("broker")
@json_option
def health_broker(as_json: bool):
    """The broker accepts a connection."""
    from ...adapters.broker import broker_connection

    settings = Settings.from_env()
    try:
        with broker_connection(settings, connect_timeout=5) as conn:
            # Each node of a cluster's `;`-separated URL is tried once (docs/broker-cluster.md).
            nodes = max(1, len(conn.alt))
            conn.ensure_connection(max_retries=nodes, timeout=5 * nodes)
    except Exception as exc:  # noqa: BLE001
        _report(as_json, False, "broker", f"unreachable: {first_line(exc)}")
        return
    _report(as_json, True, "broker", "connected")


@health.command("beat")
@json_option
def health_beat(as_json: bool):
    """A sweep finished within the last 5 sweep intervals."""
    from ....models.base import utcnow
    from ....models.db import engine_for, run_read
    from ... import leases
    from ..status import SWEEP_HEARTBEAT, sweeper_problem

    settings = Settings.from_env()
    age = run_read(
        engine_for(settings.database_url),
        lambda s: leases.heartbeat_age_s(s, SWEEP_HEARTBEAT, utcnow()),
    )
    problem = sweeper_problem(age, settings.sweep_interval_s)
    _report(as_json, problem is None, "beat", problem or f"last sweep {age:.1f} s ago")


@health.command("worker")
@click.option(
    "--host",
    "hostname",
    default=None,
    help="Only a worker on this host (its node name ends with @HOST): a pod's own probe.",
)
@click.option("--timeout", type=float, default=5.0, show_default=True)
@json_option
def health_worker(hostname: str | None, timeout: float, as_json: bool):
    """A worker answers a ping over the broker."""
    from ....tasks.app import app

    replies = app.control.ping(timeout=timeout) or []
    nodes = sorted(name for reply in replies for name in reply)
    if hostname is not None:
        nodes = [n for n in nodes if n.endswith(f"@{hostname}")]
    _report(
        as_json,
        bool(nodes),
        "worker",
        f"{len(nodes)} answered: {', '.join(nodes)}" if nodes else "no worker answered",
    )

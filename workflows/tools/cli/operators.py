"""`op show|find|list` (docs/operations.md): any operation, of any kind, found by an operator."""

import re

import click

from ...errors import InvalidArgument, NotFound
from ...kinds import KINDS
from ...operators import catalog
from ...operators.catalog import STATUSES, kind_of
from ...records import as_dict
from ...validation import MAX_LIMIT
from .common import _client, _emit, cli, error_note, json_option

AGE = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")
AGE_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_age(text: str | None, option: str = "--older-than") -> float | None:
    """`90`, `90s`, `15m`, `2h`, `7d` as seconds."""
    if text is None:
        return None
    match = AGE.match(text.strip())
    seconds = None if match is None else float(match[1]) * AGE_UNITS[match[2]]
    if seconds is None or seconds > catalog.MAX_AGE_S:
        raise InvalidArgument(
            f"{option} {text!r}: a number with s, m, h or d (e.g. 15m), at most 10 years",
            field=option.strip("-").replace("-", "_"),
        )
    return seconds


def _described(record) -> dict:
    """A record as `op show|find` print it: its operation kind under `kind`, as `op list` has
    it; a field of the record's own by that name (what a maintenance run does) goes under
    `<its kind>_kind`."""
    kind, fields = kind_of(record), as_dict(record)
    if "kind" in fields:
        fields[f"{kind}_kind"] = fields.pop("kind")
    return {"kind": kind, **fields}


def _line(item: dict) -> str:
    kind = KINDS[item["kind"]]  # a summary's id is `id`; a record's, its kind's key
    ident = item.get("id") or item[kind.key.key]
    created = item.get("created_at") or item.get(kind.created.key) or "-"
    submit = item.get("client_submit_id") or "-"
    error = error_note(item["status"], item.get("last_error"), "  ")
    return (
        f"{created}  {item['kind']:<11} {item['status']:<18} {ident}  "
        f"{item['workspace_id']}/{item['session_id']}  submit={submit}{error}"
    )


@cli.group()
def op() -> None:
    """Find and list operations of every kind (`op list --kind`)."""


@op.command("show")
@click.argument("operation_id")
@click.option("--workspace", "workspace_id", default=None, help="Only in this workspace.")
@json_option
def op_show(operation_id: str, workspace_id: str | None, as_json: bool):
    """Show the operation with this id, whatever its kind."""
    record = _described(_client().get_operation(operation_id, workspace_id=workspace_id))
    _emit(as_json, record)


@op.command("find")
@click.argument("workspace_id")
@click.argument("session_id")
@click.argument("submit_id")
@json_option
def op_find(workspace_id: str, session_id: str, submit_id: str, as_json: bool):
    """Every operation submitted under SUBMIT_ID in the session (one per family)."""
    found = [_described(r) for r in _client().find_operations(workspace_id, session_id, submit_id)]
    if not found:
        raise NotFound(f"nothing was submitted as {submit_id!r} in {workspace_id}/{session_id}")
    _emit(as_json, found, [_line(f) for f in found])


@op.command("list")
@click.option("--kind", type=click.Choice(sorted(KINDS)), default=None)
@click.option("--status", type=click.Choice(STATUSES), default=None, help="Any kind's status.")
@click.option("--workspace", "workspace_id", default=None)
@click.option("--session", "session_id", default=None, help="Needs --workspace.")
@click.option("--older-than", "older_than", default=None, help="Age, e.g. 90s, 15m, 2h, 7d.")
@click.option("--since", "since", default=None, help="Accepted within this age, e.g. 1h.")
@click.option("--oldest-first", is_flag=True, help="Oldest first (default: newest first).")
@click.option("--limit", type=int, default=50, show_default=True)
@json_option
def op_list(
    kind, status, workspace_id, session_id, older_than, since, oldest_first, limit, as_json
):
    """Operations, newest first."""
    found = [
        as_dict(o)
        for o in _client().list_operations(
            kind=kind,
            status=status,
            workspace_id=workspace_id,
            session_id=session_id,
            older_than_s=parse_age(older_than),
            newer_than_s=parse_age(since, "--since"),
            newest_first=not oldest_first,
            limit=limit,
        )
    ]
    _emit(as_json, found, [_line(f) for f in found] or "no operations")


@op.command("retry")
@click.argument("operation_id")
@click.option("--reason", required=True, help="Why (kept in the session's events).")
@click.option("--workspace", "workspace_id", default=None, help="Only in this workspace.")
@json_option
def op_retry(operation_id: str, reason: str, workspace_id: str | None, as_json: bool):
    """Retry a failed goal operation or fence: same id, a fresh budget (audited)."""
    record = _described(
        _client().retry_operation(operation_id, reason=reason, workspace_id=workspace_id)
    )
    _emit(as_json, record, f"{record['kind']} {operation_id}: {record['status']}")


@cli.command()
@click.option("--dry-run", is_flag=True, help="Count one batch of what would go; delete nothing.")
@click.option(
    "--retention-days",
    type=float,
    default=None,
    help="Override AGENT_RADAR_RETENTION_DAYS (at least 1).",
)
@click.option("--batch", type=click.IntRange(1, MAX_LIMIT), default=500, show_default=True)
@click.option("--max-batches", type=click.IntRange(1, 10_000), default=1, show_default=True)
@json_option
def prune(dry_run, retention_days, batch, max_batches, as_json):
    """Delete settled operations and events older than the retention window (fences are
    permanent and stay). Beat does this every 10 minutes in bounded batches."""
    result = _client().prune(
        dry_run=dry_run, retention_days=retention_days, batch=batch, max_batches=max_batches
    )
    verb = "would delete" if dry_run else "deleted"
    lines = [f"{verb} (settled before {result['cutoff']}):"] + [
        f"  {name}: {count}" for name, count in result["rows"].items()
    ]
    _emit(as_json, result, lines)

"""Remote control: what a worker answers over the broker (docs/security.md: remote control).

Anyone who may publish to the broker may broadcast Celery's remote control commands, as they
may publish tasks. A worker keeps only the commands that read what Flower's pages and
`agent-radar health worker` show, checks each command's arguments and envelope before
Celery's code sees them, and answers without the arguments of any task (another tenant's
prompt text) or a password:
- `shutdown`, `pool_restart`, `add_consumer`, `revoke`, `terminate`, rate and time limits,
  autoscale: gone. An operator stops and scales workers with signals and the orchestrator.
- Nothing revokes: `hello` (which merged any revoked ids it was sent) is gone, and the
  worker's set of revoked ids keeps none, so no message can make a worker discard a
  producer's task that carries a known id. An expired message is still discarded.
- A command with an argument it does not take, a `pattern`/`matcher` (a regular expression
  run in the worker's main process), or a reply address other than the mailbox's own is
  refused with one log line: no traceback, no reply.
"""

import logging
from collections.abc import Callable
from typing import Any

from celery.app.utils import HIDDEN_SETTINGS
from celery.worker import pidbox
from celery.worker import state as worker_state
from celery.worker.control import Panel

from ..workflows.adapters.config import mask_url
from .envelope import reason
from .headers import printable_id

log = logging.getLogger("agent_radar.gate")

# A command's arguments: name -> check(value).
Arguments = dict[str, Callable[[Any], bool]]


def _optional_flag(value: Any) -> bool:
    return value is None or isinstance(value, bool)


# The commands a worker answers, with the arguments each takes (as Celery's `inspect` and
# `control` send them, which is what Flower and `celery inspect` use).
COMMANDS: dict[str, Arguments] = {
    "ping": {},
    "stats": {},
    "active_queues": {},
    "registered": {
        "taskinfoitems": lambda v: isinstance(v, (list, tuple)) and not v,
    },
    "active": {"safe": _optional_flag},
    "reserved": {"safe": _optional_flag},
    "scheduled": {"safe": _optional_flag},
    "revoked": {},
    "conf": {"with_defaults": _optional_flag},
    # Flower turns task events on when it starts.
    "enable_events": {},
}
# The fields of a command as kombu's mailbox sends it.
ENVELOPE_KEYS = frozenset(
    {"method", "arguments", "destination", "pattern", "matcher", "ticket", "reply_to"}
)
# Replies go to the mailbox's reply exchange (kombu: `reply.<namespace>.pidbox`), nowhere else.
REPLY_EXCHANGE = "reply.celery.pidbox"
# A command names at most this many workers.
MAX_DESTINATIONS = 1024
# A Lamport clock value, as kombu's mailbox sends it in its `clock` header.
MAX_CLOCK = 2**62


class CommandRefused(Exception):  # noqa: N818 - a refusal, logged in one line
    pass


def _check_reply_to(reply_to: Any) -> None:
    if reply_to is None:
        return
    if not (isinstance(reply_to, dict) and set(reply_to) == {"exchange", "routing_key"}):
        raise CommandRefused("reply_to is not {exchange, routing_key}")
    if reply_to["exchange"] != REPLY_EXCHANGE or not printable_id(reply_to["routing_key"]):
        raise CommandRefused(f"replies go to {REPLY_EXCHANGE} only")


def check_command(body: Any, headers: Any) -> None:
    """Raise CommandRefused unless `body` is a command this worker answers, with arguments it
    takes, in kombu's envelope."""
    if not isinstance(body, dict) or not set(body) <= ENVELOPE_KEYS:
        raise CommandRefused("not a remote control command")
    method = body.get("method")
    arguments = body.get("arguments") or {}
    takes = COMMANDS.get(method) if isinstance(method, str) else None
    if takes is None:
        raise CommandRefused("not a command this worker answers")
    if not isinstance(arguments, dict):
        raise CommandRefused("arguments are not an object")
    for name, value in arguments.items():
        check = takes.get(name) if isinstance(name, str) else None
        if check is None or not check(value):
            raise CommandRefused(f"{method} takes no argument {str(name)[:64]!r} like that")
    destination = body.get("destination")
    if destination is not None and not (
        isinstance(destination, (list, tuple))
        and len(destination) <= MAX_DESTINATIONS
        and all(printable_id(node) for node in destination)
    ):
        raise CommandRefused("destination is not a list of node names")
    if body.get("pattern") is not None or body.get("matcher") is not None:
        raise CommandRefused("pattern and matcher are refused (name workers in destination)")
    if body.get("ticket") is not None and not printable_id(body["ticket"]):
        raise CommandRefused("ticket is not a printable id")
    _check_reply_to(body.get("reply_to"))
    if not isinstance(headers, dict) or not set(headers) <= {"clock", "expires"}:
        raise CommandRefused("headers are not {clock, expires}")
    clock = headers.get("clock")
    if clock is not None and not (
        isinstance(clock, int) and not isinstance(clock, bool) and 0 <= clock <= MAX_CLOCK
    ):
        raise CommandRefused("header 'clock' is not a clock value")


# -- answers ---------------------------------------------------------------------------------
def _without_arguments(info: Any) -> Any:
    """A request's description (`Request.info()`) without the text of its arguments."""
    if isinstance(info, dict):
        info = {**info, "args": "", "kwargs": ""}
        if isinstance(info.get("request"), dict):  # `scheduled`: {eta, priority, request}
            info["request"] = _without_arguments(info["request"])
    return info


def _requests_without_arguments(handler: Callable) -> Callable:
    def answer(state, **kwargs):
        return [_without_arguments(info) for info in handler(state, **kwargs)]

    return answer


def _password_masked(value: Any) -> Any:
    """A reply with every secret (a password, a key, a token: Celery's own rule for what its
    configuration hides) and every URL's password masked."""
    if isinstance(value, dict):
        return {
            k: "********"
            if isinstance(k, str) and (k == "password" or HIDDEN_SETTINGS.search(k)) and value[k]
            else mask_url(v)
            if isinstance(v, str) and "://" in v
            else _password_masked(v)
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [_password_masked(v) for v in value]
    return value


def _masked(handler: Callable) -> Callable:
    def answer(state, **kwargs):
        return _password_masked(handler(state, **kwargs))

    return answer


ANSWERS: dict[str, Callable[[Callable], Callable]] = {
    "active": _requests_without_arguments,
    "reserved": _requests_without_arguments,
    "scheduled": _requests_without_arguments,
    "stats": _masked,
    "conf": _masked,
}


# -- installing it, in a worker's main process -------------------------------------------
class _KeepsNone:
    """What a revoked-id set's `add` and `update` become: they keep nothing."""

    def __call__(self, *_args: Any, **_kwargs: Any) -> None:
        return None


def limit_remote_control() -> None:
    """Keep only COMMANDS, answered as ANSWERS says, check every command before Celery's
    mailbox reads it, and revoke nothing; in this process, once."""
    if getattr(pidbox.Pidbox.on_message, "guarded", False):
        return
    for name in list(Panel.data):
        if name not in COMMANDS:
            del Panel.data[name]
    for name, wrap in ANSWERS.items():
        Panel.data[name] = wrap(Panel.data[name])
    worker_state.revoked.clear()
    worker_state.revoked.add = worker_state.revoked.update = _KeepsNone()
    worker_state.revoked_stamps.clear()
    received = pidbox.Pidbox.on_message

    def on_message(self, body, message):
        try:
            check_command(body, getattr(message, "headers", None))
        except CommandRefused as exc:
            log.error("refused a remote control command: %s", reason(exc))
            return
        received(self, body, message)

    on_message.guarded = True  # type: ignore[attr-defined]
    pidbox.Pidbox.on_message = on_message  # gPidbox (eventlet, gevent) inherits it

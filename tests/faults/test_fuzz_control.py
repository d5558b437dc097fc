"""Hostile-input campaign, remote control: Celery's remote control commands (kombu's mailbox)
broadcast raw to a real worker, as any broker client could, on the filesystem transport,
Redis and RabbitMQ — every command Celery has and names of none, with arguments, envelopes and
headers of any type (docs/security.md: remote control).

Invariants: the worker's main and pool processes never change; it still answers a ping; its
set of revoked ids stays empty (nothing revokes); no line of its log is forged; no lease is
left held; good work after the commands completes. `make fuzz` runs it long
(AGENT_RADAR_FUZZ_EXAMPLES per backend).
"""

import struct
from itertools import count

import amqp.exceptions
import pytest
from celery.worker.control import Panel
from hypothesis import given
from hypothesis import strategies as st

from agent_radar.tasks.control import COMMANDS, REPLY_EXCHANGE
from tests.end_to_end.test_gate import apply_good_goal
from tests.faults.test_fuzz import ANY_JSON, ANY_TEXT, FUZZ, Tally, report_tally  # noqa: F401
from tests.faults.test_fuzz_headers import assert_unharmed
from tests.helpers import eventually
from tests.hostile import raw_broadcast

FORGED = "[2026-01-01 00:00:00,000: CRITICAL/MainProcess] forged"
# Every command Celery's worker knows (Panel.data holds them before a worker limits it), and
# kombu's mailbox's own.
CELERY_COMMANDS = sorted(
    set(Panel.data)
    | set(COMMANDS)
    | {
        "hello",
        "heartbeat",
        "revoke",
        "revoke_by_stamped_headers",
        "terminate",
        "shutdown",
        "pool_restart",
        "pool_grow",
        "pool_shrink",
        "add_consumer",
        "cancel_consumer",
        "rate_limit",
        "time_limit",
        "autoscale",
        "query_task",
        "dump_tasks",
        "memdump",
        "memsample",
        "objgraph",
        "election",
        "report",
        "clock",
        "disable_events",
    }
)
ARGUMENT_NAMES = [
    "safe",
    "with_defaults",
    "taskinfoitems",
    "revoked",
    "from_node",
    "task_id",
    "terminate",
    "signal",
    "queue",
    "n",
    "max",
    "min",
    "type",
    "id",
    f"x\n{FORGED}\x1b[31m",
]


@st.composite
def commands(draw, serial=count()):
    """(body, headers) of one remote control command: mostly kombu's envelope with parts of
    any type, sometimes anything at all."""
    next(serial)
    if draw(st.integers(0, 9)) == 0:
        return draw(ANY_JSON), draw(st.none() | st.dictionaries(ANY_TEXT, ANY_JSON, max_size=3))
    body: dict = {
        "method": draw(st.sampled_from(CELERY_COMMANDS) | ANY_TEXT | ANY_JSON),
        "arguments": draw(
            st.dictionaries(st.sampled_from(ARGUMENT_NAMES) | ANY_TEXT, ANY_JSON, max_size=3)
            | ANY_JSON
        ),
        "destination": draw(st.none() | st.lists(ANY_TEXT, max_size=3) | ANY_JSON),
    }
    if draw(st.integers(0, 4)) == 0:
        body["ticket"] = draw(ANY_TEXT | ANY_JSON)
        body["reply_to"] = draw(
            st.fixed_dictionaries(
                {"exchange": st.just(REPLY_EXCHANGE) | ANY_TEXT, "routing_key": ANY_TEXT}
            )
            | ANY_JSON
        )
    if draw(st.integers(0, 9)) == 0:
        body[draw(st.sampled_from(["pattern", "matcher"]) | ANY_TEXT)] = draw(ANY_JSON)
    headers = draw(
        st.fixed_dictionaries({"clock": st.integers(0, 2**40)})
        | st.dictionaries(st.sampled_from(["clock", "expires"]) | ANY_TEXT, ANY_JSON, max_size=3)
    )
    return body, headers


@pytest.mark.parametrize("backend", ["embedded", "production", "rabbitmq"], indirect=True)
def test_remote_control_commands(client, stack, settings, sim_control, backend):
    from agent_radar.tasks.app import create_app

    worker = stack.start_worker(concurrency=1)
    pool = worker.children()
    app = create_app(settings)
    try:
        eventually(lambda: app.control.ping(timeout=1), what="a first ping")

        @FUZZ
        @given(command=commands())
        def one(command):
            body, headers = command
            try:
                raw_broadcast(app, body, serializer="json", headers=headers)
            except (
                TypeError,
                ValueError,
                OverflowError,
                UnicodeError,
                struct.error,
                amqp.exceptions.IrrecoverableConnectionError,
            ):
                return  # not JSON, or not a header the broker can carry: nobody can send it
            Tally.add("remote control", backend)

        one()
        # Every command taken (the mailbox answers in order), then: still answering, nothing
        # revoked.
        assert eventually(lambda: app.control.ping(timeout=2), timeout_s=120, what="a ping")
        revoked = eventually(lambda: app.control.inspect(timeout=2, limit=1).revoked())
        assert next(iter(revoked.values())) == []
    finally:
        app.close()
    assert apply_good_goal(client, settings, sim_control, "after-control").status == "completed"
    log = worker.log_path.read_text()
    assert not any(line.startswith(FORGED) for line in log.splitlines())
    assert "\x1b[31m" not in log and "Unrecoverable" not in log
    assert "refused a remote control command" in log  # the commands did reach it
    assert_unharmed(worker, pool, client.engine, "remote control", backend)

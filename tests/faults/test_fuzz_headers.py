"""Hostile-input campaign, second part: what fails below our task wrapper — the headers of
a message (every type, for every header Celery reads), compression, every Celery built-in
task name, ETA and expiry extremes — against a real worker on the filesystem transport,
Redis and RabbitMQ; and the worker's gate as a function, on any headers at all.

Invariants: the worker's main and pool processes never change; no message is restored,
requeued or stops the consumer; each message is either refused (one line naming its id),
discarded as expired, or applied — never refused and applied; good work after bad completes.
`make fuzz` runs it long (AGENT_RADAR_FUZZ_EXAMPLES per family and backend).
"""

import bz2
import json
import lzma
import struct
import zlib
from collections import Counter
from datetime import UTC, datetime, timedelta
from itertools import count

import amqp.exceptions
import pytest
from celery.exceptions import InvalidTaskError
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import select

from agent_radar.models.db import run_transaction
from agent_radar.models.operations import GoalOperation
from agent_radar.models.tables import Lease
from agent_radar.tasks.gate import check_headers
from agent_radar.tasks.headers import HEADERS
from agent_radar.tasks.strict import TASK_NAMES
from tests.faults.test_fuzz import ANY_JSON, FUZZ, Tally, report_tally  # noqa: F401
from tests.helpers import eventually, queue_depth
from tests.hostile import raw_publish, task_headers

WS = "w-headers"
# Every task Celery registers on an app of its own accord: none may run from a message.
CELERY_BUILTINS = [
    "celery.accumulate",
    "celery.backend_cleanup",
    "celery.chain",
    "celery.chord",
    "celery.chord_unlock",
    "celery.chunks",
    "celery.group",
    "celery.map",
    "celery.starmap",
]
HEADER_NAMES = [
    "task",
    "id",
    "root_id",
    "parent_id",
    "group",
    "group_index",
    "shadow",
    "eta",
    "expires",
    "retries",
    "timelimit",
    "argsrepr",
    "kwargsrepr",
    "origin",
    "lang",
    "compression",
    "ignore_result",
    "stamped_headers",
    "stamps",
    "replaced_task_nesting",
]
COMPRESSIONS = {
    "application/x-bz2": bz2.compress,
    "bzip2": bz2.compress,
    "application/x-gzip": zlib.compress,
    "zlib": zlib.compress,
    "application/x-lzma": lzma.compress,
    "xz": lzma.compress,
    "application/zstd": None,
    "application/x-brotli": None,
    "application/x-nope": None,
}


def dates():
    now = datetime.now(UTC)
    return st.one_of(
        st.sampled_from(
            [
                "9999-12-31T23:59:59+00:00",
                "0001-01-01T00:00:00",
                "2026-13-45T99:99:99",
                "",
                "now",
                "1e308",
                "2026-12-02T10:00:00+25:00",
            ]
        ),
        st.integers(-(2**70), 2**70).map(
            lambda s: (now + timedelta(seconds=s % 10**9)).isoformat()
        ),
        st.floats(-5, 3).map(lambda s: (now + timedelta(seconds=s)).isoformat()),
        ANY_JSON,
    )


HEADER_NAMES = sorted(set(HEADER_NAMES) | set(HEADERS))
# Headers of no producer of ours: random names, and names that look like Celery's or the
# broker's own.
STRANGE_NAMES = st.text(max_size=20) | st.sampled_from(
    ["x", "X-Death", "x-death-x", "reply_to", "delivery_info", "kwargs", "task\n", "\x1b[8m"]
)


def sized():
    """Values of every size a header can reach below the envelope's bound: texts, lists of
    empty objects (each costs a dict when decoded), nested lists."""
    sizes = st.sampled_from([0, 1, 300, 5000, 40_000, 100_000])
    return st.one_of(
        sizes.map(lambda n: "x" * n),
        sizes.map(lambda n: [{}] * (n // 4)),
        sizes.map(lambda n: [[[]]] * (n // 6)),
        st.integers(1, 200).map(lambda depth: json.loads("[" * depth + "]" * depth)),
    )


TIME_LIMITS = st.sampled_from(
    [[0.002, 0.001], [0.0082, 0.008], [None, 0.001], [1e-300, None], [0, 0], [-1, -1], [1]]
)
HEADER_VALUES = {
    "task": st.sampled_from(sorted(TASK_NAMES) + CELERY_BUILTINS + ["", "agent_radar.nope"])
    | ANY_JSON,
    "id": st.sampled_from(["", " x", "a\nb", "i" * 300, "\x1b[8m"]) | ANY_JSON,
    "eta": dates(),
    "expires": dates(),
    "compression": st.sampled_from(sorted(COMPRESSIONS)) | ANY_JSON,
    "timelimit": TIME_LIMITS | ANY_JSON,
    "shadow": st.text(max_size=30) | ANY_JSON,
    "retries": st.sampled_from([-1, 51, 10**11, 2**63]) | ANY_JSON,
}


@st.composite
def hostile_messages(draw, serial=count()):
    """A goal message for a session of its own, with one to three headers replaced by a value
    of any type (or dropped), and its body sometimes compressed as a header says."""
    session = f"h-{next(serial)}"
    headers = task_headers()
    for name in draw(st.lists(st.sampled_from(HEADER_NAMES), min_size=1, max_size=3)):
        if draw(st.integers(0, 9)) == 0:
            headers.pop(name, None)
        elif draw(st.integers(0, 5)) == 0:
            headers[name] = draw(sized())
        else:
            headers[name] = draw(HEADER_VALUES.get(name, ANY_JSON))
    if draw(st.integers(0, 3)) == 0:
        headers[draw(STRANGE_NAMES)] = draw(ANY_JSON | sized())
    body = json.dumps([[], {**GOAL, "session_id": session}, None]).encode()
    named = headers.get("compression")
    packer = COMPRESSIONS.get(named) if isinstance(named, str) else None
    if packer is not None and draw(st.booleans()):
        body = packer(body)
    return session, headers, body


GOAL = {"workspace_id": WS, "action": "set", "objective": "o", "client_submit_id": "1"}


@FUZZ
@given(
    headers=st.dictionaries(
        st.sampled_from(HEADER_NAMES) | st.text(max_size=9), ANY_JSON, max_size=6
    )
)
def test_the_gate_raises_nothing_but_invalid_task_on_any_headers(headers):
    try:
        check_headers(headers, frozenset(TASK_NAMES), datetime.now(UTC))
    except InvalidTaskError:
        pass
    Tally.add("gate on any headers", "-")


def _printable(value) -> bool:
    return isinstance(value, str) and 0 < len(value) <= 255 and value.isprintable()


@pytest.mark.parametrize("backend", ["embedded", "production", "rabbitmq"], indirect=True)
def test_raw_headers(client, stack, settings, sim_control, backend):
    worker = stack.start_worker(concurrency=1)
    pool = worker.children()
    sent: list[tuple[str, dict]] = []

    @FUZZ
    @given(message=hostile_messages())
    def one(message):
        session, headers, body = message
        try:
            raw_publish(settings, body, headers=headers)
        except (
            struct.error,
            OverflowError,
            UnicodeError,
            amqp.exceptions.IrrecoverableConnectionError,
        ):
            # AMQP cannot carry this header value (RabbitMQ closes the connection on an
            # infinite float, or headers past its frame size): no producer can send it
            return
        sent.append((session, headers))
        Tally.add("raw headers", backend)

    one()
    good = task_headers()
    raw_publish(settings, [[], {**GOAL, "session_id": "good"}, None], headers=good)
    eventually(lambda: queue_depth(settings) == 0, timeout_s=600, what="an empty queue")

    def applied() -> set[str]:
        return set(
            run_transaction(
                client.engine,
                lambda s: s.scalars(
                    select(GoalOperation.session_id).where(GoalOperation.workspace_id == WS)
                ).all(),
            )
        )

    eventually(lambda: "good" in applied(), timeout_s=120, what="the good message")
    log = worker.log_path.read_text()

    def refused(task_id) -> bool:
        return f"message {task_id!r}" in log or f"message {task_id}:" in log

    def accounted() -> list:
        done, text = applied(), worker.log_path.read_text()
        return [
            (session, headers.get("id"))
            for session, headers in sent
            if session not in done
            and _printable(headers.get("id"))
            and f"{headers['id']!r}" not in text
            and f"message {headers['id']}:" not in text
            and f"[{headers['id']}]" not in text  # Celery's "Discarding revoked task" line
        ]

    # Near-future ETAs are held a few seconds at most; every message then has its fate.
    eventually(lambda: not accounted(), timeout_s=120, what="every message refused or applied")
    log = worker.log_path.read_text()
    done = applied()
    # A refusal names its message by id: only an id no other message carried tells which.
    ids = Counter(str(headers.get("id")) for _session, headers in sent)
    both = [
        headers.get("id")
        for session, headers in sent
        if session in done
        and _printable(headers.get("id"))
        and ids[headers["id"]] == 1
        and refused(headers["id"])
    ]
    assert not both, f"refused and applied: {both[:5]}"
    unprintable = [s for s, h in sent if not _printable(h.get("id")) and s in done]
    assert not unprintable, f"applied with an id no log can show: {unprintable[:5]}"
    assert_unharmed(worker, pool, client.engine, "raw headers", backend)
    assert "Restoring" not in log and "Unrecoverable" not in log


def held_leases(engine) -> list[str]:
    """The leases a holder still has (the sweeper's, a session's lane)."""
    now = datetime.now(UTC)
    return run_transaction(
        engine,
        lambda s: s.scalars(
            select(Lease.name).where(Lease.token.is_not(None), Lease.expires_at > now)
        ).all(),
    )


def assert_unharmed(worker, pool: list[int], engine, family: str, backend: str) -> None:
    """The worker and every pool process it started with are alive, and no lease is left
    held once the queue is empty; what was not is tallied (make fuzz prints it)."""
    killed = len(set(pool) - set(worker.children()))
    Tally.record_harm(family, backend, "pool processes killed", killed)
    try:  # a lane is released as its drain ends: give it that long
        eventually(lambda: not held_leases(engine), timeout_s=30, what="every lease released")
        held = []
    except AssertionError:
        held = held_leases(engine)
    Tally.record_harm(family, backend, "leases left held", len(held))
    assert worker.alive() and killed == 0 and not held, (killed, held)


def test_the_gate_refuses_oversized_headers():
    from celery.exceptions import InvalidTaskError

    allowed = frozenset({"agent_radar.goal_control"})
    headers = {"task": "agent_radar.goal_control", "id": "x1", "kwargsrepr": "k" * 20_000}
    with pytest.raises(InvalidTaskError, match="'kwargsrepr' must be a text of at most"):
        check_headers(headers, allowed, datetime.now(UTC))
    headers["kwargsrepr"] = "k" * 1000
    check_headers(headers, allowed, datetime.now(UTC))
    # Each header within its own bound, all of them together over the whole's: RabbitMQ's
    # record of a message's deaths is a list of tables, whatever they hold.
    headers["x-death"] = [{"reason": "expired", "queue": "q" * 1000}] * 40
    with pytest.raises(InvalidTaskError, match="headers of over"):
        check_headers(headers, allowed, datetime.now(UTC))

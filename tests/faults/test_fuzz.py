"""Hostile-input campaign (Hypothesis), on both backends, for every entry point: client methods,
activity reports, agent-host answers (through the real HTTP adapter, the dispatcher and the
maintenance executor) and raw broker messages of every public task to a real worker.

Invariants: nothing but a typed AgentRadarError (or, for a host answer, a runtime fault)
comes out; a rejected input writes no row; no worker dies; good work after bad completes.

`make test` runs a bounded, derandomized number of examples per family; `make fuzz` runs a
long random campaign (AGENT_RADAR_FUZZ_EXAMPLES per family and backend, default 2000) and
prints how many inputs each family tried.
"""

import json
import os
import time
import uuid
from itertools import count

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from agent_radar.workflows.adapters.answers import HostState
from agent_radar.workflows.adapters.http_runtime import HttpRuntime
from agent_radar.workflows.errors import AgentRadarError, RuntimeDisconnected, RuntimeFault
from agent_radar.workflows.maintenance import runs
from agent_radar.workflows.steps.goals.dispatch import Dispatcher
from agent_radar.workflows.steps.maintenance import MaintenanceExecutor
from tests.helpers import eventually, queue_depth, row_counts
from tests.hostile import IDLE_STATE, applied, raw_publish, task_headers

CAMPAIGN = "AGENT_RADAR_FUZZ_EXAMPLES" in os.environ
EXAMPLES = int(os.environ.get("AGENT_RADAR_FUZZ_EXAMPLES") or 100)
FUZZ = hsettings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    derandomize=not CAMPAIGN,
    suppress_health_check=list(HealthCheck),
)
pytestmark = pytest.mark.timeout(0 if CAMPAIGN else 600)

# -- values ------------------------------------------------------------------------------
HOSTILE_TEXT = st.sampled_from(
    [
        "",
        " ",
        "\x00",
        "a\x00b",
        "\ud800",
        "x\udfffy",
        "\t",
        "\n",
        "\u202e",
        "é" * 200,
        "x" * 256,
        "x" * (17 * 1024),
        "o" * (65 * 1024),
        "goal-generation-fence:x",
        "../../etc",
        "NaN",
        "null",
        "{}",
        "%s%n",
        "\\u0000",
        "💥" * 70,
    ]
)
ANY_TEXT = st.text(alphabet=st.characters(blacklist_categories=()), max_size=40) | HOSTILE_TEXT
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([2**31 - 1, 2**31, -1, 0, 2**63, -(2**63) - 1])
    | st.floats(allow_nan=True, allow_infinity=True)
    | ANY_TEXT
)
ANY_JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(ANY_TEXT, inner, max_size=4),
    max_leaves=8,
)
IDS = st.sampled_from(["w1", "s1", "s2", "c-1", "x"])


def maybe(valid):
    """Mostly a plausible value, sometimes anything at all."""
    return st.one_of(valid, valid, ANY_JSON)


# host-b is registered by the tests that use it; nowhere never is.
HOSTS = maybe(st.sampled_from(["default", "host-b", "nowhere"]))


class Tally:
    """Inputs tried per family, printed at the end of the test session."""

    counts: dict[str, int] = {}
    # What a family's run did to the worker (pool processes killed, leases left held).
    harm: dict[str, int] = {}

    @classmethod
    def add(cls, family: str, backend: str) -> None:
        key = f"{family} [{backend}]"
        cls.counts[key] = cls.counts.get(key, 0) + 1

    @classmethod
    def record_harm(cls, family: str, backend: str, what: str, n: int) -> None:
        key = f"{what} by {family} [{backend}]"
        cls.harm[key] = cls.harm.get(key, 0) + n


@pytest.fixture(scope="module", autouse=True)
def report_tally():
    yield
    if Tally.counts:
        total = sum(Tally.counts.values())
        lines = [f"  {k}: {v}" for k, v in sorted(Tally.counts.items())]
        print("\nfuzz inputs tried:\n" + "\n".join(lines) + f"\n  total: {total}")
    if Tally.harm:
        lines = [f"  {k}: {v}" for k, v in sorted(Tally.harm.items())]
        print("harm done:\n" + "\n".join(lines))


def expect_typed(call):
    """Run a call: only an AgentRadarError may come out. Returns the error or None."""
    try:
        call()
    except AgentRadarError as exc:
        return exc
    return None


# -- client methods -----------------------------------------------------------------------
def client_calls():
    ws, sid = maybe(IDS), maybe(IDS)
    submit = maybe(IDS)
    return st.one_of(
        st.tuples(
            st.just("goal_control"),
            st.tuples(
                ws,
                sid,
                maybe(st.sampled_from(["set", "clear", "pause", "resume"])),
                maybe(st.sampled_from(["ship it", None])),
            ),
            st.fixed_dictionaries(
                {
                    "client_submit_id": submit,
                    "expected_revision": maybe(st.none() | st.integers(0, 3)),
                }
            ),
        ),
        st.tuples(
            st.just("fence_goal_generation"),
            st.tuples(ws, sid, maybe(IDS)),
            st.fixed_dictionaries({"client_submit_id": submit, "reason": maybe(st.just(""))}),
        ),
        st.tuples(
            st.just("start_maintenance"),
            st.tuples(
                ws, sid, maybe(st.sampled_from(["compact", "summarize_up_to", "summarize_from"]))
            ),
            st.fixed_dictionaries(
                {"client_submit_id": submit, "args": maybe(st.none() | st.just({"turn": 2}))}
            ),
        ),
        st.tuples(
            st.just("submit_prompt"),
            st.tuples(ws, sid, maybe(st.just("hello"))),
            st.fixed_dictionaries({"client_submit_id": submit}),
        ),
        st.tuples(
            st.just("cancel_maintenance"),
            st.tuples(maybe(IDS)),
            st.fixed_dictionaries({"workspace_id": maybe(st.none() | IDS)}),
        ),
        st.tuples(
            st.sampled_from(["get_goal_operation", "get_fence", "get_maintenance", "get_prompt"]),
            st.tuples(maybe(IDS)),
            st.fixed_dictionaries({"workspace_id": maybe(st.none() | IDS)}),
        ),
        st.tuples(st.just("history"), st.tuples(ws, sid, maybe(st.integers(1, 5))), st.just({})),
        st.tuples(st.just("find_goal_operation"), st.tuples(ws, sid, submit), st.just({})),
        st.tuples(st.sampled_from(["goal_state", "session_info"]), st.tuples(ws, sid), st.just({})),
        st.tuples(
            st.just("add_host"),
            st.tuples(HOSTS, maybe(st.sampled_from(["http://127.0.0.1:9", "https://h.example"]))),
            st.fixed_dictionaries({"replace": maybe(st.booleans())}),
        ),
        st.tuples(st.just("remove_host"), st.tuples(HOSTS), st.just({})),
    )


def test_client_methods(client, backend):
    @FUZZ
    @given(call=client_calls())
    def one(call):
        method, args, kwargs = call
        before = row_counts(client.engine)
        error = expect_typed(lambda: getattr(client, method)(*args, **kwargs))
        Tally.add("client methods", backend)
        if error is not None:
            assert row_counts(client.engine) == before, (method, args, kwargs, error)

    one()


# -- activity reports ---------------------------------------------------------------------
def reports():
    now_ms = st.integers(-(10**3), 10**3).map(lambda d: int(time.time() * 1000) + d)
    session = st.fixed_dictionaries(
        {},
        optional={
            "live": maybe(st.booleans()),
            "runtime_epoch": maybe(st.integers(0, 5)),
            "provider": maybe(st.just("claude")),
            "provider_session_id": maybe(IDS),
            "host_id": HOSTS,
        },
    )
    turn = st.fixed_dictionaries(
        {
            "turn_id": maybe(IDS),
            "phase": maybe(st.sampled_from(["submitted", "running", "settled"])),
        },
        optional={
            "outcome": maybe(st.sampled_from(["completed", "failed", "canceled", "interrupted"])),
            "origin": maybe(st.sampled_from(["user_prompt", "goal_continuation"])),
            "source_goal_operation_id": maybe(IDS),
            "source_goal_revision": maybe(st.integers(1, 4)),
            "prompt_id": maybe(IDS),
        },
    )
    applied_goal = st.fixed_dictionaries(
        {"operation_id": maybe(IDS), "revision": maybe(st.integers(1, 4))},
        optional={"goal": maybe(st.just({"objective": "o"}))},
    )
    report = st.fixed_dictionaries(
        {"workspace_id": maybe(IDS), "session_id": maybe(IDS), "occurred_at_ms": maybe(now_ms)},
        optional={
            "session": maybe(session),
            "turn": maybe(turn),
            "goal_applied": maybe(applied_goal),
            "colour": ANY_JSON,
        },
    )
    return st.one_of(report, report, report, ANY_JSON)


def test_activity_reports(client, backend):
    client.add_host("host-b", "http://127.0.0.1:9")

    @FUZZ
    @given(report=reports())
    def one(report):
        before = row_counts(client.engine)
        error = expect_typed(lambda: client.report_activity(report))
        Tally.add("activity reports", backend)
        if error is not None:
            assert row_counts(client.engine) == before, (report, error)

    one()


# -- agent host answers -------------------------------------------------------------------
def answers():
    body = st.one_of(
        ANY_JSON.map(lambda v: json.dumps(v).encode()),
        st.fixed_dictionaries(
            {"phase": maybe(st.sampled_from(["applied", "accepted"]))},
            optional={
                "goal": ANY_JSON,
                "evidence": ANY_JSON,
                "error": ANY_JSON,
                "detail": ANY_JSON,
                "current_revision": ANY_JSON,
            },
        ).map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=64),
    )
    return st.tuples(st.sampled_from([200, 200, 200, 404, 409, 422, 500]), body)


def test_runtime_answers_through_the_dispatcher(client, backend, host):
    runtime = HttpRuntime(host.url, timeout_s=5.0)
    dispatcher = Dispatcher(client.engine, runtime, worker_id="fuzz", lease_s=30.0)
    host.answers["good"] = applied
    sessions = count()

    @FUZZ
    @given(answer=answers())
    def one(answer):
        sid = f"fz-{next(sessions)}"
        host.answers[sid] = answer
        op = client.set_goal("w-ans", sid, "objective", client_submit_id="1")
        good = client.set_goal("w-ans", "good", f"good {sid}", client_submit_id=sid)
        outcomes = {
            r.operation_id: r.outcome
            for r in dispatcher.dispatch_many([op.operation_id, good.operation_id])
        }
        Tally.add("host answers (dispatch)", backend)
        assert outcomes[good.operation_id] == "applied"
        assert outcomes[op.operation_id] in {"applied", "accepted", "retry", "failed", "superseded"}
        row = client.get_goal_operation(op.operation_id)
        assert row.lease_token is None and "\x00" not in (row.last_error or "")

    one()


def test_runtime_answers_to_every_call(host, backend):
    runtime = HttpRuntime(host.url, timeout_s=5.0)
    calls = [
        lambda sid: runtime.liveness("w", sid),
        lambda sid: runtime.resume("w", sid, []),
        lambda sid: runtime.install_fence(
            "w", sid, target_operation_id="o", target_revision=1, require_live=True
        ),
        lambda sid: runtime.cancel_turn(
            "w", sid, "t", operation_id="c", reason="", require_live=True
        ),
        lambda sid: runtime.submit_prompt("w", sid, prompt_id="p", text="hi"),
        lambda sid: runtime.start_maintenance("w", sid, run_id="r", kind="compact", args=None),
        lambda sid: runtime.maintenance_status("w", sid, "r"),
        lambda sid: runtime.cancel_maintenance("w", sid, "r"),
        lambda sid: runtime.session_state("w", sid),
    ]

    @FUZZ
    @given(answer=answers(), call=st.sampled_from(calls))
    def one(answer, call):
        sid = uuid.uuid4().hex
        host.answers[sid] = answer
        try:
            result = call(sid)
        except (RuntimeFault, RuntimeDisconnected) as exc:
            assert isinstance(exc.code, str)
        else:
            assert isinstance(result, (dict, HostState))
        Tally.add("host answers (every call)", backend)

    one()


def outcomes():
    return st.fixed_dictionaries(
        {"state": st.just("done")},
        optional={
            "applied": maybe(st.booleans()),
            "cancelled": maybe(st.booleans()),
            "error": maybe(st.none() | st.just("boom")),
            "input_tokens": maybe(st.integers(0, 10**6)),
            "result_tokens": maybe(st.integers(0, 10**6)),
            "summary": maybe(st.just("short")),
        },
    )


def test_maintenance_outcomes_are_stored_or_fail_the_run(client, backend, host):
    runtime = HttpRuntime(host.url, timeout_s=5.0)
    executor = MaintenanceExecutor(
        client.engine,
        runtime,
        worker_id="fuzz",
        lease_s=30.0,
        publish=lambda *_: True,
        poll_s=0.001,
    )
    sessions = count()

    @FUZZ
    @given(outcome=outcomes())
    def one(outcome):
        sid = f"fm-{next(sessions)}"
        host.answers[(sid, "maintenance")] = (200, b'{"state": "running"}')
        host.answers[(sid, "state")] = (200, IDLE_STATE)
        host.answers[sid] = (200, json.dumps(outcome).encode())
        run = client.start_maintenance("w-m", sid, client_submit_id="m")
        status = executor.execute(run.run_id)
        Tally.add("maintenance outcomes", backend)
        assert status in runs.TERMINAL, status
        assert client.get_maintenance(run.run_id).status == status

    one()


# -- raw broker messages of every public task --------------------------------------------
def bad_id():
    return st.one_of(
        st.integers(),
        st.none(),
        st.booleans(),
        st.lists(st.just("a")),
        st.just(""),
        st.just("x" * 256),
        st.just("a\x00b"),
        st.just("\ud800"),
        st.just("tab\there"),
    )


def bad_text():
    return st.one_of(
        st.integers(),
        st.just(""),
        st.just("a\x00"),
        st.just("\udc00"),
        st.just("x" * (70 * 1024)),
        st.lists(st.just("a")),
    )


def good_kwargs(task: str, n: int) -> dict:
    base = {"workspace_id": "w-broker", "session_id": f"b-{n}", "client_submit_id": "1"}
    return {
        "agent_radar.goal_control": {**base, "action": "set", "objective": "o"},
        "agent_radar.fence_goal_generation": {**base, "target_operation_id": "op", "reason": ""},
        "agent_radar.start_maintenance": {**base, "kind": "compact"},
        "agent_radar.cancel_maintenance": {"workspace_id": "w-broker", "run_id": "r"},
        "agent_radar.submit_prompt": {**base, "text": "hi"},
        "agent_radar.get_operation": {
            "operation_id": str(uuid.uuid4()),
            "workspace_id": "w-broker",
        },
        # (No optional field: a bad value drawn for one may be a valid one, "" or None.)
        "agent_radar.ensure_session": {"workspace_id": "w-broker", "session_id": f"b-{n}"},
        "agent_radar.stop_session": base,
        "agent_radar.retry_operation": {
            "workspace_id": "w-broker",
            "operation_id": str(uuid.uuid4()),
            "reason": "fixed",
        },
        "agent_radar.report_activity": {
            "report": {
                "workspace_id": "w-broker",
                "session_id": f"b-{n}",
                "occurred_at_ms": int(time.time() * 1000),
            }
        },
        # named, as the message of one submit is: the name's fields are fuzzed too
        "agent_radar.goal.dispatch": {
            "operation_id": str(uuid.uuid4()),
            "workspace_id": "w-broker",
            "session_id": f"b-{n}",
        },
        "agent_radar.fence.apply": {"fence_id": str(uuid.uuid4())},
        "agent_radar.cancel.apply": {"operation_id": str(uuid.uuid4())},
        "agent_radar.maintenance.execute": {"run_id": str(uuid.uuid4())},
        "agent_radar.prompt.dispatch": {"workspace_id": "w-broker", "session_id": f"b-{n}"},
    }[task]


BAD_FIELD = {
    "workspace_id": bad_id(),
    "session_id": bad_id(),
    "client_submit_id": bad_id(),
    "target_operation_id": bad_id(),
    "run_id": bad_id(),
    "operation_id": bad_id(),
    "fence_id": bad_id(),
    "objective": bad_text(),
    "text": bad_text(),
    "reason": bad_text(),
    "action": st.one_of(st.integers(), st.just("launch"), st.lists(st.just("set"))),
    "kind": st.one_of(
        st.just("defrag"),
        st.lists(st.just("compact")),
        st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    ),
    "report": st.one_of(
        ANY_JSON.filter(lambda v: not isinstance(v, dict)),
        st.just({"workspace_id": "w", "session_id": "s", "occurred_at_ms": 10**30}),
    ),
}


@st.composite
def broker_messages(draw, serial=count()):
    """A message of a public or internal task that is invalid by construction: a field with
    a bad value, a missing field, an unknown field, or a body of the wrong shape."""
    n = next(serial)
    task = draw(
        st.sampled_from(
            sorted(
                {
                    "agent_radar.goal_control",
                    "agent_radar.fence_goal_generation",
                    "agent_radar.start_maintenance",
                    "agent_radar.cancel_maintenance",
                    "agent_radar.submit_prompt",
                    "agent_radar.get_operation",
                    "agent_radar.ensure_session",
                    "agent_radar.stop_session",
                    "agent_radar.retry_operation",
                    "agent_radar.report_activity",
                    "agent_radar.goal.dispatch",
                    "agent_radar.fence.apply",
                    "agent_radar.cancel.apply",
                    "agent_radar.maintenance.execute",
                    "agent_radar.prompt.dispatch",
                }
            )
        )
    )
    kwargs = good_kwargs(task, n)
    how = draw(st.sampled_from(["bad value", "bad value", "missing", "unknown", "shape"]))
    if how == "bad value":
        field = draw(st.sampled_from(sorted(kwargs)))
        kwargs[field] = draw(BAD_FIELD[field])
    elif how == "missing":  # a required one: without `kind` or `reason` a call is valid
        kwargs.pop(draw(st.sampled_from(sorted(set(kwargs) - {"kind", "reason"}))))
    elif how == "unknown":
        kwargs[draw(st.sampled_from(["colour", "__class__", "ctx", "self"]))] = draw(ANY_JSON)
    if how == "shape":
        body = draw(
            st.one_of(
                ANY_JSON.filter(lambda v: not (isinstance(v, list) and len(v) == 3)),
                st.tuples(
                    ANY_JSON.filter(lambda v: not isinstance(v, list)), st.just(kwargs), st.none()
                ).map(list),
                st.tuples(
                    st.just([]), st.just(kwargs), ANY_JSON.filter(lambda v: v not in (None, {}))
                ).map(list),
            )
        )
    else:
        body = [[], kwargs, None]
    return task, json.dumps(body).encode()


def test_raw_broker_messages(client, stack, settings, sim_control, backend):
    worker = stack.start_worker(concurrency=1)
    pool = worker.children()
    before = row_counts(client.engine)

    @FUZZ
    @given(message=broker_messages())
    def one(message):
        task, body = message
        raw_publish(settings, body, headers=task_headers(task))
        Tally.add("raw broker messages", backend)

    one()

    def good(submit_id):
        raw_publish(
            settings,
            [
                [],
                {
                    "workspace_id": "w-broker",
                    "session_id": "good",
                    "action": "set",
                    "objective": f"after {submit_id}",
                    "client_submit_id": submit_id,
                },
                None,
            ],
            headers=task_headers(),
        )
        op = eventually(
            lambda: client.find_goal_operation("w-broker", "good", submit_id),
            timeout_s=300,
            what="the good message after the hostile ones",
        )
        return client.wait(op, timeout=60)

    good("good-1")
    eventually(lambda: queue_depth(settings) == 0, timeout_s=300, what="an empty queue")
    good("good-2")  # published after the queue drained: every hostile one was handled
    assert worker.alive() and worker.children() == pool
    after = row_counts(client.engine)
    assert after["goal_operations"] == before["goal_operations"] + 2
    assert after["agent_sessions"] == before["agent_sessions"] + 1
    # (the good goals start continuation turns at the simulator; nothing else is written)
    for table in ("goal_fences", "maintenance_runs", "prompts", "cancel_operations"):
        assert after[table] == before[table], table
    log = worker.log_path.read_text()
    assert "Restoring" not in log and "Unrecoverable error" not in log

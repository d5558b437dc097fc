"""`agent-radar host-check` (docs/host-check.md): the simulator keeps every promise, and a host
that breaks one fails on that promise's line, with the evidence. The broken hosts are the
simulator with one behaviour changed, on a real socket."""

import os
import subprocess
import sys
import time

import pytest

from agent_radar.workflows.tools.host_check import FAIL, PASS, SKIP, check_host
from tests.helpers import QuickStopSimServer

TOKEN = "check-token"
SHAPES = "answers have their documented shapes"
IDEMPOTENT = "idempotent by operation_id"
KEYED = "prompts, cancels and runs idempotent by their keys"
FORWARD = "revisions only move forward"
ONE_AT_A_TIME = "one thing at a time"
LATE_START = "a run cancelled before its start never starts"
FENCE = "a fence holds"
REQUIRE_LIVE = "require_live never wakes a session"
RESTART = "a fence holds across a restart, or the epoch moves"
AUTH = "calls need the host's token"
DEADLINE = "every answer within the deadline"
REPORTS = "reports are signed, well formed and sent"


@pytest.fixture
def backend():
    return "embedded"  # no database or broker: the check talks to a host only


@pytest.fixture
def host():
    server = QuickStopSimServer(port=0, token=TOKEN).start()
    yield server
    server.stop()


def verdicts(server, token=TOKEN, deadline_s=2.0, hooks=True) -> dict[str, tuple[str, str]]:
    lines = check_host(server.url, token, deadline_s, hooks)
    return {line.promise: (line.verdict, line.evidence) for line in lines}


def broken(server, change):
    """The host's calls with one behaviour changed: `change(sim, call, ws, sid, body)` runs
    before the simulator answers (and may answer instead, by returning an answer)."""
    sim = server.sim
    original = sim.handle

    def handle(call, ws, sid, body):
        answer = change(sim, call, ws, sid, body)
        return original(call, ws, sid, body) if answer is None else answer

    sim.handle = handle


def only_failure(found: dict, promise: str) -> str:
    failed = {name for name, (verdict, _) in found.items() if verdict == FAIL}
    assert failed == {promise}, found
    return found[promise][1]


def test_the_simulator_keeps_every_promise(host):
    found = verdicts(host)
    assert {name: verdict for name, (verdict, _) in found.items()} == dict.fromkeys(
        (
            SHAPES,
            IDEMPOTENT,
            KEYED,
            ONE_AT_A_TIME,
            LATE_START,
            FORWARD,
            FENCE,
            REQUIRE_LIVE,
            RESTART,
            AUTH,
            DEADLINE,
        ),
        PASS,
    ) | {REPORTS: SKIP}
    assert "--reports-from" in found[REPORTS][1]
    # Without the test hooks, the two promises that need them say so instead.
    quiet = verdicts(host, hooks=False)
    assert quiet[REQUIRE_LIVE][0] == quiet[RESTART][0] == SKIP
    assert "--test-hooks" in quiet[REQUIRE_LIVE][1]


def test_a_host_that_is_not_idempotent_fails_that_line(host):
    def forgets_answers(sim, call, ws, sid, body):
        if call == "goal":
            sim.answers.clear()  # the same operation_id is applied anew

    broken(host, forgets_answers)
    assert "refused" in only_failure(verdicts(host), IDEMPOTENT)


def test_a_host_that_starts_a_prompt_twice_fails_that_line(host):
    def forgets_prompts(sim, call, ws, sid, body):
        if call == "prompts":
            # The same prompt_id: a new turn (the first one forgotten too, so none is busy).
            sim.session(ws, sid).prompts.clear()
            sim.session(ws, sid).turns.clear()

    broken(host, forgets_prompts)
    assert "the same prompt_id twice" in only_failure(verdicts(host), KEYED)


def test_a_host_that_takes_revisions_backwards_fails_that_line(host):
    def forgets_revisions(sim, call, ws, sid, body):
        if call == "goal":
            sim.session(ws, sid).revision = 0

    broken(host, forgets_revisions)
    assert "revision 1 after 2 was applied" in only_failure(verdicts(host), FORWARD)


def test_a_host_that_forgets_a_fence_at_a_restart_without_a_new_epoch_fails_that_line(host):
    sim = host.sim
    control = sim.control

    def restart_at_the_same_epoch(path, body):
        answer = control(path, body)
        if body.get("restart"):
            # The fences went, the epoch stays.
            sim.session(*path.split("/")[3:5]).runtime_epoch -= 1
        return answer

    sim.control = restart_at_the_same_epoch
    assert "the fenced generation was applied" in only_failure(verdicts(host), RESTART)


def test_a_host_that_ignores_require_live_fails_that_line(host):
    def wakes_sessions(sim, call, ws, sid, body):
        if call == "goal" and body.get("require_live"):
            sim.session(ws, sid).live = True

    broken(host, wakes_sessions)
    assert "applied" in only_failure(verdicts(host), REQUIRE_LIVE)


def test_a_host_that_runs_things_side_by_side_fails_that_line(host, monkeypatch):
    from agent_radar.workflows.host import calls

    monkeypatch.setattr(calls, "one_at_a_time", lambda s, starting: None)
    assert "beside a running maintenance run" in only_failure(verdicts(host), ONE_AT_A_TIME)


def test_a_host_that_starts_a_run_cancelled_before_it_came_fails_that_line(host):
    from agent_radar.workflows.host.server import HostError

    def forgets_cancels(sim, call, ws, sid, body):
        if call.startswith("maintenance/") and call.endswith("/cancel"):
            raise HostError(404, "not_found")  # and keeps nothing of it

    broken(host, forgets_cancels)
    assert "must be refused" in only_failure(verdicts(host), LATE_START)


def test_a_host_slow_past_the_deadline_fails_that_line(host):
    def slow(sim, call, ws, sid, body):
        if call == "goal" and sid == "forward":
            time.sleep(0.8)

    broken(host, slow)
    found = verdicts(host, deadline_s=0.5)
    assert found[DEADLINE][0] == FAIL and "of 0.5 s" in found[DEADLINE][1]
    assert found[FORWARD][0] == FAIL and "timed out" in found[FORWARD][1]


def test_a_host_whose_goal_answer_has_another_shape_fails_that_line(host):
    original = host.sim.handle

    def a_key_more(sim, call, ws, sid, body):
        if call == "goal":
            answer = original(call, ws, sid, body)
            return {**answer, "goal": {**(answer["goal"] or {}), "mood": "fine"}}

    broken(host, a_key_more)
    assert "exactly {objective, status}" in only_failure(verdicts(host), SHAPES)


def test_a_host_that_takes_calls_without_its_token_fails_that_line():
    server = QuickStopSimServer(port=0, token=None).start()
    try:
        assert "a call with no token was answered" in only_failure(verdicts(server), AUTH)
    finally:
        server.stop()


def test_the_command_prints_a_line_per_promise_and_exits_1_on_a_failure(host):
    env = {**os.environ, "AGENT_RADAR_HOST_TOKEN": TOKEN}
    command = [sys.executable, "-m", "agent_radar.workflows.tools.cli", "host-check", host.url]
    ok = subprocess.run(
        [*command, "--test-hooks"], env=env, capture_output=True, text=True, timeout=60
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    verdicts_printed = [line.split()[0] for line in ok.stdout.splitlines()]
    assert verdicts_printed == ["PASS"] * 10 + ["SKIP", "PASS"]  # reports: no --reports-from
    wrong = subprocess.run(
        [*command, "--token", "not-it"], env=env, capture_output=True, text=True, timeout=60
    )
    assert wrong.returncode == 1
    assert wrong.stdout.splitlines()[0].startswith("FAIL answers have their documented shapes")
    bad = subprocess.run(
        [*command[:-1], "ftp://host"], env=env, capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "http:// or https://" in bad.stderr
    not_a_broker = subprocess.run(
        [*command, "--reports-from", "http://host"], env=env, capture_output=True, text=True
    )
    assert not_a_broker.returncode == 2 and "a broker URL" in not_a_broker.stderr


def test_a_hostile_host_gets_fail_lines_of_bounded_size_and_no_traceback(host):
    """A host may answer anything: answers that differ every time and are large (quoted in
    the evidence), a state with no epoch. Each promise it breaks fails on its own line, cut
    short; the check never ends in a traceback."""
    original = host.sim.handle
    calls = []

    def hostile(sim, call, ws, sid, body):
        calls.append(call)
        answer = original(call, ws, sid, body)
        if call == "goal":
            return {**answer, "evidence": {"noise": "x" * 200_000 + str(len(calls))}}
        if call == "state":
            return {**answer, "runtime_epoch": None}
        return answer

    broken(host, hostile)
    found = verdicts(host)
    assert found[IDEMPOTENT][0] == FAIL and found[RESTART][0] == FAIL
    assert all(len(evidence) <= 401 for _, evidence in found.values())


def test_a_host_that_answers_nothing_fails_every_line():
    import socket

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    lines = check_host(f"http://127.0.0.1:{port}", TOKEN, 1.0, True)
    assert {line.verdict for line in lines if line.promise != REPORTS} == {FAIL}
    # With a broker to read, the reports line fails too: no call made a report due.
    lines = check_host(
        f"http://127.0.0.1:{port}", TOKEN, 1.0, True, reports_from="redis://127.0.0.1:1/0"
    )
    assert {line.verdict for line in lines} == {FAIL}
    assert lines[-1].evidence == "no call was answered at all"


# -- reports (docs/host-check.md: reports) -----------------------------------------------------
@pytest.fixture
def reports_broker():
    """A Redis database no worker reads (the module of unprefixed producers'), emptied before
    and after: where the host's reports go, as celery-node publishes them (queue `celery`)."""
    from tests.end_to_end.test_results import RESULTS_REDIS, clean_results

    clean_results()
    yield RESULTS_REDIS
    clean_results()


def reporting_host(broker_url: str, change=None, **conf):
    """The simulator, publishing its signed reports as a Celery client would; `change(report)`
    alters each one (None: dropped); `conf`, the client's Celery settings."""
    from celery import Celery

    producer = Celery("host", broker=broker_url)
    producer.conf.update(conf)

    def publish(report):
        report = report if change is None else change(report)
        if report is not None:
            producer.send_task("agent_radar.report_activity", kwargs={"report": report})

    server = QuickStopSimServer(port=0, token=TOKEN, reporter=publish).start()
    return server, producer


def report_verdict(broker_url, change=None, wait_s=10.0, prefix="", **conf) -> tuple[str, str]:
    server, producer = reporting_host(broker_url, change, **conf)
    try:
        lines = check_host(
            server.url,
            TOKEN,
            2.0,
            True,
            reports_from=broker_url,
            reports_wait_s=wait_s,
            reports_prefix=prefix,
        )
    finally:
        server.stop()
        producer.close()
    found = {line.promise: (line.verdict, line.evidence) for line in lines}
    others = {name for name, (verdict, _) in found.items() if verdict != PASS} - {REPORTS}
    assert not others, found
    return found[REPORTS]


def test_the_simulator_s_reports_pass(reports_broker):
    verdict, evidence = report_verdict(reports_broker)
    assert verdict == PASS, evidence
    assert "signed by default" in evidence and "a session gone offline" in evidence
    assert "the new epoch 2" in evidence and "its end (canceled)" in evidence


def test_unsigned_reports_fail_the_reports_line(reports_broker):
    def unsigned(report):
        return {k: v for k, v in report.items() if k not in ("signature", "signed_by")}

    verdict, evidence = report_verdict(reports_broker, unsigned)
    assert verdict == FAIL and "not signed by default" in evidence, evidence


def test_reports_signed_with_another_token_fail(reports_broker):
    from agent_radar.workflows.adapters.report_auth import sign

    verdict, evidence = report_verdict(
        reports_broker, lambda report: sign(report, "default", "another-token")
    )
    assert verdict == FAIL and "not signed by default" in evidence, evidence


def test_reports_dated_in_seconds_fail(reports_broker):
    from agent_radar.workflows.adapters.report_auth import sign

    def in_seconds(report):
        return sign({**report, "occurred_at_ms": int(time.time())}, "default", TOKEN)

    verdict, evidence = report_verdict(reports_broker, in_seconds)
    assert verdict == FAIL and "refuses" in evidence and "occurred_at_ms" in evidence, evidence


def test_a_host_that_never_reports_a_turn_s_end_fails(reports_broker):
    def no_ends(report):
        return None if (report.get("turn") or {}).get("phase") == "settled" else report

    verdict, evidence = report_verdict(reports_broker, no_ends, wait_s=1.0)
    assert verdict == FAIL and "none of its end" in evidence, evidence


def test_reports_in_celery_s_message_protocol_1_fail(reports_broker):
    """The workers' gate takes protocol 2 only: a host whose client sends protocol 1 has
    every report refused, and the check says so."""
    verdict, evidence = report_verdict(reports_broker, task_protocol=1)
    assert verdict == FAIL and "protocol 1" in evidence, evidence


def test_a_host_that_never_reports_its_goal_turns_fails(reports_broker):
    """The turns a fence waits for: each turn the state call lists must have had its start
    reported."""

    def no_goal_turns(report):
        return None if (report.get("turn") or {}).get("origin") == "goal_continuation" else report

    verdict, evidence = report_verdict(reports_broker, no_goal_turns, wait_s=1.0)
    assert verdict == FAIL and "which the state call listed" in evidence, evidence


def test_reports_under_a_key_prefix_are_read_with_the_prefix(reports_broker):
    import redis

    options = {"broker_transport_options": {"global_keyprefix": "acme-check:"}}
    try:
        verdict, evidence = report_verdict(reports_broker, prefix="acme-check:", **options)
        assert verdict == PASS, evidence
        verdict, evidence = report_verdict(reports_broker, wait_s=1.0, **options)
        assert verdict == FAIL and "0 reports came" in evidence, evidence
    finally:
        client = redis.Redis.from_url(reports_broker)
        for key in client.scan_iter("acme-check:*"):
            client.delete(key)
        client.close()

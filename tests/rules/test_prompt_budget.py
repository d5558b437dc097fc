"""Prompts have a budget like every background kind (docs/lifecycles.md: fences, prompts), on both
backends: a failed send goes back to the queue at its place and uses one attempt; an offline session
is a wait and uses none; a final answer, or a spent budget, ends the prompt `failed` with a stable
code that `status` counts, and the queue moves on."""

from datetime import timedelta

from sqlalchemy import update

from agent_radar.models.base import utcnow
from agent_radar.models.db import run_transaction
from agent_radar.models.operations import Prompt
from agent_radar.workflows import budgets
from agent_radar.workflows.adapters.http_runtime import HttpRuntime
from agent_radar.workflows.steps.prompt_dispatch import dispatch_next
from agent_radar.workflows.tools.status import fleet_status

WS, SID = "ws-prompt-budget", "s1"


def send(client, settings):
    return dispatch_next(client.engine, HttpRuntime(settings.runtime_url), WS, SID)


def row(client, prompt_id):
    return run_transaction(client.engine, lambda s: s.get(Prompt, prompt_id))


def test_failed_sends_use_the_budget_and_waits_do_not(client, settings, sim_control):
    first = client.submit_prompt(WS, SID, "first", client_submit_id="p1")
    second = client.submit_prompt(WS, SID, "second", client_submit_id="p2")

    sim_control.fault("prompts", status=503, count=1)
    assert send(client, settings) == "retry: server_error"
    failed_once = row(client, first.prompt_id)
    assert (failed_once.status, failed_once.attempt) == ("queued", 1)
    assert failed_once.failing_since is not None and "503" in failed_once.last_error

    sim_control.session(WS, SID, live=False)  # offline: a wait, no budget used
    assert send(client, settings) == "retry: disconnected"
    waited = row(client, first.prompt_id)
    assert (waited.status, waited.attempt, waited.failing_since) == ("queued", 1, None)

    # One attempt short of the budget; the next failure spends it.
    sim_control.session(WS, SID, live=True)
    run_transaction(
        client.engine,
        lambda s: s.execute(
            update(Prompt)
            .where(Prompt.prompt_id == first.prompt_id)
            .values(attempt=budgets.MAX_ATTEMPTS - 1)
        ),
    )
    sim_control.fault("prompts", status=503, count=1)
    assert send(client, settings) == "failed"
    spent = client.get_prompt(first.prompt_id)
    assert spent.status == "failed" and spent.settled
    assert spent.last_error.startswith("budget_exhausted (24 attempts): ")
    status = fleet_status(client.engine)
    assert status["prompts"] == {"failed": 1, "queued": 1}
    assert status["budget_exhausted"]["prompts"] == 1

    # The queue moves on: the next prompt goes.
    assert send(client, settings) == "dispatched"
    assert [e["text"] for e in sim_control.effects("prompt")] == ["second"]
    assert client.get_prompt(second.prompt_id).status == "dispatched"


def test_a_final_answer_fails_the_prompt_at_once(client, settings, sim_control):
    prompt = client.submit_prompt(WS, SID, "hello", client_submit_id="p1")
    sim_control.fault("prompts", status=422, error="rejected", count=1)
    assert send(client, settings) == "failed"
    failed = client.get_prompt(prompt.prompt_id)
    assert failed.status == "failed" and "rejected" in failed.last_error
    assert failed.attempt == 1


def test_a_prompt_failing_for_too_long_fails_on_age(client, settings, sim_control):
    prompt = client.submit_prompt(WS, SID, "hello", client_submit_id="p1")
    since = utcnow() - timedelta(seconds=budgets.MAX_FAILING_S + 1)
    run_transaction(
        client.engine,
        lambda s: s.execute(update(Prompt).values(attempt=2, failing_since=since)),
    )
    sim_control.fault("prompts", status=503, count=1)
    assert send(client, settings) == "failed"
    assert client.get_prompt(prompt.prompt_id).last_error.startswith(
        "budget_exhausted (failing for "
    )


def test_an_answer_without_a_turn_spends_budget_and_status_names_the_prompt(client, settings, host):
    """A host answering {} to a prompt started no turn anyone can settle: the prompt was
    re-sent every ~32 s for ever, using no budget, and the prompts after it waited. Now it
    is a bad_response like any other failure: it spends budget, `status` names it, and once
    the budget is spent it fails and the queue moves on."""
    host.answers[SID] = (200, b"{}")
    runtime = HttpRuntime(host.url)
    stuck = client.submit_prompt(WS, SID, "first", client_submit_id="p1")
    after = client.submit_prompt(WS, SID, "second", client_submit_id="p2")
    assert dispatch_next(client.engine, runtime, WS, SID) == "retry: bad_response"
    assert row(client, stuck.prompt_id).attempt == 1
    named = fleet_status(client.engine)["worst"]["prompts_retrying"]
    assert [(p["prompt_id"], p["attempt"]) for p in named] == [(stuck.prompt_id, 1)]
    assert "turn_id" in named[0]["last_error"]
    later = utcnow() + timedelta(seconds=budgets.MAX_FAILING_S + 1)
    assert dispatch_next(client.engine, runtime, WS, SID, clock=lambda: later) == "failed"
    assert row(client, stuck.prompt_id).status == "failed"
    assert row(client, after.prompt_id).status == "queued"  # the queue moves on
    assert fleet_status(client.engine)["worst"]["prompts_retrying"] == []

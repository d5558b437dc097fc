"""Reports are signed facts from one host, and hints (docs/protocol.md: reports), on both backends:
a report counts only with an HMAC of its canonical body made with its host's token, and even then
it never completes an operation, or moves a session a host already serves."""

import time

import pytest

from agent_radar.models.db import run_transaction
from agent_radar.models.tables import AgentSession, Turn
from agent_radar.workflows import ids
from agent_radar.workflows.adapters import report_auth
from agent_radar.workflows.errors import InvalidArgument
from agent_radar.workflows.steps.goals.dispatch import Dispatcher
from agent_radar.workflows.tools.simulator import SimControl
from tests.helpers import eventually, restorer, row_counts

WS = "ws-auth"
TOKEN = "gpu-2-secret"


def body(sid, **parts):
    return {
        "workspace_id": WS,
        "session_id": sid,
        "occurred_at_ms": int(time.time() * 1000),
        **parts,
    }


def session_row(client, sid):
    return run_transaction(client.engine, lambda s: s.get(AgentSession, (WS, sid)))


@pytest.fixture
def gpu2(client, sim_b):
    """host `gpu-2` (a simulator of its own) registered with a token; a session there."""
    client.add_host("gpu-2", sim_b.url, token=TOKEN)
    client.ensure_session(WS, "s-gpu", host_id="gpu-2")
    return SimControl(sim_b.url)


def test_the_canonical_body_and_its_signature_match_the_documented_vector():
    """The test vector of docs/protocol.md: a host in any language checks its signing here."""
    report = {
        "workspace_id": "acme",
        "session_id": "s1",
        "occurred_at_ms": 1764770000000,
        "turn": {"turn_id": "t-17", "phase": "running", "origin": "user_prompt"},
        "signed_by": "gpu-2",
        "session": {"live": True},
    }
    assert report_auth.canonical(report) == (
        b'{"occurred_at_ms":1764770000000,"session":{"live":true},"session_id":"s1",'
        b'"signed_by":"gpu-2","turn":{"origin":"user_prompt","phase":"running",'
        b'"turn_id":"t-17"},"workspace_id":"acme"}'
    )
    assert report_auth.signature_of(report, "gpu-2-secret") == SIGNATURE_OF_THE_VECTOR


SIGNATURE_OF_THE_VECTOR = "0116a232a4b40d36109b21593792a8ee1b96a9761c535a580c66c5d52e603626"


def test_a_report_signed_by_the_session_s_host_is_applied(client, gpu2):
    signed = report_auth.sign(
        body("s-gpu", turn={"turn_id": "t1", "phase": "running"}), "gpu-2", TOKEN
    )
    client.receive_report(signed)
    turn = run_transaction(client.engine, lambda s: s.get(Turn, (WS, "s-gpu", "t1")))
    assert turn.phase == "running"
    # The client signs as the host's own process would, with the token of the host it reads.
    client.report_activity(
        body("s-gpu", turn={"turn_id": "t1", "phase": "settled", "outcome": "completed"})
    )
    turn = run_transaction(client.engine, lambda s: s.get(Turn, (WS, "s-gpu", "t1")))
    assert (turn.phase, turn.outcome) == ("settled", "completed")


def forged(sid):
    good = report_auth.sign(body(sid, turn={"turn_id": "t-x", "phase": "running"}), "gpu-2", TOKEN)
    old = dict(good, occurred_at_ms=good["occurred_at_ms"] - 700_000)
    return {
        "unsigned": body(sid, turn={"turn_id": "t-x", "phase": "running"}),
        "tampered": dict(good, turn={"turn_id": "t-y", "phase": "running"}),
        "another token": report_auth.sign(
            body(sid, turn={"turn_id": "t-x", "phase": "running"}), "gpu-2", "guess"
        ),
        "a replay past the bound": dict(old, signature=report_auth.signature_of(old, TOKEN)),
        "signed by default for gpu-2's session": report_auth.sign(
            body(sid, turn={"turn_id": "t-x", "phase": "running"}), "default", "x"
        ),
    }


@pytest.mark.parametrize(
    "kind",
    [
        "unsigned",
        "tampered",
        "another token",
        "a replay past the bound",
        "signed by default for gpu-2's session",
    ],
)
def test_a_report_without_its_host_s_proof_is_refused_and_writes_nothing(client, gpu2, kind):
    before = row_counts(client.engine)
    with pytest.raises(InvalidArgument):
        client.receive_report(forged("s-gpu")[kind])
    assert row_counts(client.engine) == before


def test_a_forged_goal_applied_completes_nothing(client, gpu2, sim_b):
    """Row 9: a forged `goal_applied` naming the computable (uuid5) operation id of a session
    on gpu-2 completed the operation with the forger's objective; gpu-2 never saw it. Unsigned
    it is refused; even signed, a report only asks for the host's state, and the host's
    answer decides."""
    op_id = ids.goal_operation_id(WS, "s-gpu", "g1")
    gpu2.session(WS, "s-gpu", goal_mode="accepted", apply_delay_ms=1500, continuation_turns=False)
    op = client.set_goal(WS, "s-gpu", "the owner's goal", client_submit_id="g1")
    assert op.operation_id == op_id
    d = Dispatcher(client.engine, client.runtime, worker_id="d", lease_s=5)
    assert [r.outcome for r in d.dispatch(op_id)] == ["accepted"]
    claim = {"operation_id": op_id, "revision": 1, "goal": {"objective": "the forger's"}}
    with pytest.raises(InvalidArgument):
        client.receive_report(body("s-gpu", goal_applied=claim))
    # Signed with gpu-2's own token: a hint, which has the host asked.
    signed = report_auth.sign(body("s-gpu", goal_applied=claim), "gpu-2", TOKEN)
    assert client.receive_report(signed) is True
    assert client.get_goal_operation(op_id).status == "dispatched"
    assert restorer(client).restore(WS, "s-gpu") == "restored"
    assert client.get_goal_operation(op_id).status == "dispatched"  # gpu-2 has not applied it
    eventually(lambda: gpu2.session(WS, "s-gpu")["applied_revision"] == 1, what="the apply")
    assert client.receive_report(signed) is True
    assert restorer(client).restore(WS, "s-gpu") == "restored"
    done = client.get_goal_operation(op_id)
    assert (done.status, done.provider_phase) == ("completed", "applied")
    assert client.goal_state(WS, "s-gpu").observed == {
        "objective": "the owner's goal",
        "status": "active",
    }


def test_a_report_cannot_take_a_session_a_host_already_serves(client, sim_control, gpu2):
    """Row 10: a session served by `default` (goals applied there, no report yet) got a
    report naming gpu-2, was bound to it, and its next (confidential) goal went there."""
    first = client.set_goal(WS, "s-def", "applied at default", client_submit_id="g1")
    d = Dispatcher(client.engine, client.runtime, worker_id="d", lease_s=5)
    assert [r.outcome for r in d.dispatch(first.operation_id)] == ["applied"]
    before = row_counts(client.engine)
    claim = body("s-def", session={"host_id": "gpu-2", "live": True})
    with pytest.raises(InvalidArgument, match="bound to host 'default'"):
        client.receive_report(report_auth.sign(claim, "gpu-2", TOKEN))
    assert row_counts(client.engine) == before
    secret = client.set_goal(WS, "s-def", "confidential", client_submit_id="g2")
    assert [r.outcome for r in d.dispatch(secret.operation_id)] == ["applied"]
    assert [e["operation_id"] for e in sim_control.effects()] == [
        first.operation_id,
        secret.operation_id,
    ]
    assert [e for e in gpu2.effects() if e.get("session_id") == "s-def"] == []

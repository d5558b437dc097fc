"""Named leases (docs/lifecycles.md: leases) on both backends: one claim takes every free, expired
or never-used name under one token, skips held ones, and only the token's holder releases."""

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest

from agent_radar.models.base import utcnow
from agent_radar.models.db import run_transaction
from agent_radar.workflows import leases
from tests.helpers import eventually, lock_waits, statements_sent


def _claim(client, names, owner, now, ttl_s=10):
    return run_transaction(client.engine, lambda s: leases.claim_many(s, names, owner, ttl_s, now))


def test_a_claim_takes_new_free_and_expired_names_and_skips_held_ones(client):
    now = utcnow()
    token_a, taken = _claim(client, ["held", "expires", "released"], "a", now)
    assert taken == {"held", "expires", "released"}
    _token_b, taken = _claim(client, ["held", "expires"], "b", now, ttl_s=1)  # both held
    assert taken == set()
    run_transaction(client.engine, lambda s: leases.release_many(s, ["released"], token_a))
    # The token that took "expires" at `now` held it for 10 s; 12 s later it is free.
    later = now + timedelta(seconds=12)
    _token_c, taken = _claim(client, ["released", "new", "held"], "c", now + timedelta(seconds=1))
    assert taken == {"released", "new"}
    token_d, taken = _claim(client, ["expires", "new", "fresh"], "d", later)
    assert taken == {"expires", "new", "fresh"}  # "new" expired too (c's 10 s are over)
    assert (
        run_transaction(client.engine, lambda s: leases.release_many(s, ["expires"], token_a)) == 0
    )
    assert (
        run_transaction(
            client.engine, lambda s: leases.release_many(s, ["expires", "fresh"], token_d)
        )
        == 2
    )


def test_a_claim_is_one_statement_on_postgresql(client, backend):
    with statements_sent(client.engine) as statements:
        _token, taken = _claim(client, ["first-use", "second"], "a", utcnow())
    assert taken == {"first-use", "second"}
    if backend == "production":
        assert statements == ["WITH"]


@pytest.mark.parametrize("backend", ["production"])
def test_a_lease_being_taken_right_now_is_skipped_only_where_asked(client):
    """A dispatch stealing a backlog does not wait for a lane that another transaction is
    taking (it leaves it to that one); a dispatch for its own operation waits, and then
    finds the lane held."""
    from sqlalchemy.orm import Session

    now = utcnow()
    token, _taken = _claim(client, ["busy", "free"], "setup", now)
    run_transaction(client.engine, lambda s: leases.release_many(s, ["busy", "free"], token))
    pool = ThreadPoolExecutor(1)
    try:
        with Session(client.engine) as other, other.begin():
            assert leases.claim_many(other, ["busy"], "other", 10, now)[1] == {"busy"}
            # Uncommitted: the "busy" row is locked until `other` commits.
            skipping = pool.submit(
                lambda: run_transaction(
                    client.engine,
                    lambda s: leases.claim_many(
                        s, ["busy", "free"], "stealer", 10, now, unlocked_only={"busy", "free"}
                    ),
                )
            )
            assert skipping.result(timeout=30)[1] == {"free"}
            waiting = pool.submit(_claim, client, ["busy"], "owner", now)
            eventually(
                lambda: lock_waits(client.engine) == 1, what="the plain claim to wait for the lock"
            )
            assert not waiting.done()
        assert waiting.result(timeout=30)[1] == set()  # `other` committed: held
    finally:
        pool.shutdown()


@pytest.mark.parametrize("backend", ["production"])
def test_a_new_sessions_first_submit_creates_its_lane_free(client):
    """So a dispatch takes the lane by an update, which a stealing dispatch can skip while
    another is taking it (an insert of a new row would wait for the other's commit)."""
    from sqlalchemy import select

    from agent_radar.models.tables import Lease
    from agent_radar.workflows import ids

    client.set_goal("ws-lanes", "new", "x", client_submit_id="1")
    rows = run_transaction(
        client.engine,
        lambda s: s.execute(
            select(Lease.owner, Lease.token, Lease.expires_at).where(
                Lease.name == ids.lane_name("ws-lanes", "new")
            )
        ).all(),
    )
    assert [tuple(row) for row in rows] == [(None, None, None)]

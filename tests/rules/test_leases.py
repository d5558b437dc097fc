"""Named leases (DESIGN 4.8) on both backends: one claim takes every free, expired or
never-used name under one token, skips held ones, and only the token's holder releases."""

from datetime import timedelta

from models.base import utcnow
from models.db import run_transaction
from tests.helpers import statements_sent
from workflows import leases


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

"""Fixtures the chaos tests share with the broker restart test."""

from tests.faults.test_broker_restart import own_redis  # noqa: F401 - a fixture

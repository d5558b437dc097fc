"""Settings from the environment: every numeric setting is a finite number within its bounds,
and a bad one is refused with one line naming the variable (docs/configuration.md)."""

from dataclasses import replace

import pytest

from agent_radar.workflows.adapters import config
from agent_radar.workflows.adapters.config import Settings
from agent_radar.workflows.errors import InvalidArgument
from agent_radar.workflows.operators.retention import check_retention_days

# Each numeric setting and its upper bound.
BOUNDS = {
    "AGENT_RADAR_SWEEP_INTERVAL_S": config.MAX_SWEEP_INTERVAL_S,
    "AGENT_RADAR_MAINTENANCE_CANCEL_GRACE_S": config.MAX_MAINTENANCE_CANCEL_GRACE_S,
    "AGENT_RADAR_LEASE_S": config.MAX_LEASE_S,
    "AGENT_RADAR_RUNTIME_TIMEOUT_S": config.MAX_RUNTIME_TIMEOUT_S,
    "AGENT_RADAR_RETENTION_DAYS": config.MAX_RETENTION_DAYS,
    "AGENT_RADAR_HOST_CONCURRENCY": config.MAX_HOST_CONCURRENCY,
}


def _bad_values(maximum: float) -> list[str]:
    return ["nan", "NaN", "-nan", "inf", "-inf", "1e400", "-1", "0", f"{maximum * 1.01:g}"]


@pytest.mark.parametrize(
    "name, raw",
    [(name, raw) for name, maximum in BOUNDS.items() for raw in _bad_values(maximum)],
)
def test_a_bad_number_is_refused_naming_the_variable(name, raw):
    with pytest.raises(ValueError) as refused:
        Settings.from_env({name: raw})
    message = str(refused.value)
    assert message.startswith(f"{name} must be ") and repr(raw) in message
    assert "\n" not in message


@pytest.mark.parametrize("name", BOUNDS)
def test_a_newline_in_the_value_cannot_forge_a_second_line(name):
    with pytest.raises(ValueError) as refused:
        Settings.from_env({name: "nan\nerror: forged"})
    assert str(refused.value).splitlines() == [str(refused.value)]
    assert name in str(refused.value)


@pytest.mark.parametrize("name, maximum", BOUNDS.items())
def test_the_bound_itself_is_accepted(name, maximum):
    settings = Settings.from_env({name: f"{maximum:g}"})
    # The settings round-trip to a child process's environment.
    assert Settings.from_env(settings.to_env()) == settings


def test_a_count_is_a_whole_number():
    with pytest.raises(ValueError, match="AGENT_RADAR_HOST_CONCURRENCY must be a whole number"):
        Settings.from_env({"AGENT_RADAR_HOST_CONCURRENCY": "2.5"})
    assert Settings.from_env({"AGENT_RADAR_HOST_CONCURRENCY": "4"}).host_concurrency == 4


def test_pulling_is_a_flag():
    assert Settings.from_env({}).pull is True
    for raw, value in (("false", False), ("0", False), ("Off", False), ("TRUE", True), ("1", True)):
        settings = Settings.from_env({"AGENT_RADAR_PULL": raw})
        assert settings.pull is value and Settings.from_env(settings.to_env()) == settings
    with pytest.raises(ValueError, match="AGENT_RADAR_PULL must be true or false"):
        Settings.from_env({"AGENT_RADAR_PULL": "sometimes"})


def test_the_defaults_are_within_the_bounds():
    defaults = Settings.from_env({})
    assert defaults == Settings.from_env(defaults.to_env())


def test_the_runtime_timeout_bound_is_within_the_task_time_limit():
    from agent_radar.tasks.strict import TASK_SOFT_TIME_LIMIT_S

    assert config.MAX_RUNTIME_TIMEOUT_S <= TASK_SOFT_TIME_LIMIT_S


def test_the_retention_bounds_are_those_of_prune():
    assert check_retention_days(config.MAX_RETENTION_DAYS) == config.MAX_RETENTION_DAYS
    assert check_retention_days(config.MIN_RETENTION_DAYS) == config.MIN_RETENTION_DAYS
    for outside in (config.MAX_RETENTION_DAYS + 1, config.MIN_RETENTION_DAYS / 2):
        with pytest.raises(InvalidArgument):
            check_retention_days(outside)


@pytest.mark.parametrize(
    "name, url",
    [
        ("AGENT_RADAR_DATABASE_URL", "mysql://radar:secret@db/radar"),
        ("AGENT_RADAR_BROKER_URL", "redsi://:secret@127.0.0.1:6379/0"),
        ("AGENT_RADAR_RESULT_BACKEND", "rpc://"),
        ("AGENT_RADAR_RESULT_BACKEND", "mongodb://radar:secret@db/results"),
    ],
)
def test_a_url_of_another_scheme_is_refused_without_its_password(name, url):
    with pytest.raises(ValueError, match=name) as refused:
        Settings.from_env({name: url})
    assert "secret" not in str(refused.value)


def test_a_broker_of_several_nodes_is_checked_node_by_node():
    """docs/broker-cluster.md: each node's URL, `;`-separated."""
    nodes = "redis://127.0.0.1:6379/0;redis://127.0.0.1:6380/0;redis://127.0.0.1:6381/11"
    assert Settings.from_env({"AGENT_RADAR_BROKER_URL": nodes}).broker_url == nodes
    amqp = "amqp://agent:secret@mq-1:5672/radar;amqp://agent:secret@mq-2:5672/radar"
    assert Settings.from_env({"AGENT_RADAR_BROKER_URL": amqp}).broker_url == amqp
    for bad in (nodes + ";redis://127.0.0.1:6382/x", nodes + ";redis://", amqp + ";ftp://x"):
        with pytest.raises(ValueError, match="AGENT_RADAR_BROKER_URL"):
            Settings.from_env({"AGENT_RADAR_BROKER_URL": bad})


def test_a_tls_redis_url_takes_its_tls_settings():
    url = "rediss://radar:secret@redis.internal:6380/0?ssl_cert_reqs=required"
    assert Settings.from_env({"AGENT_RADAR_BROKER_URL": url}).broker_url == url


def test_a_redis_database_is_any_number_a_redis_server_can_have():
    for db in ("", "/", "/0", "/15", f"/{config.MAX_REDIS_DB}"):
        url = f"redis://127.0.0.1:6379{db}"
        assert Settings.from_env({"AGENT_RADAR_BROKER_URL": url}).broker_url == url


def test_the_result_backend_is_off_unless_set_and_passes_to_children():
    assert Settings.from_env({}).result_backend is None
    on = Settings.from_env({"AGENT_RADAR_RESULT_BACKEND": "redis://127.0.0.1:6379/1"})
    assert on.result_backend == "redis://127.0.0.1:6379/1"
    assert Settings.from_env(on.to_env()).result_backend == on.result_backend
    assert "AGENT_RADAR_RESULT_BACKEND" not in Settings.from_env({}).to_env()


def test_a_multi_host_database_url_passes_to_children_with_its_password_hidden():
    """libpq's multi-host form, for a primary and its standbys (docs/database-failover.md)."""
    url = (
        "postgresql+psycopg://radar:secret@/radar?host=db-a:5432&host=db-b:5432"
        "&target_session_attrs=read-write"
    )
    settings = Settings.from_env({"AGENT_RADAR_DATABASE_URL": url})
    assert Settings.from_env(settings.to_env()).database_url == url
    assert "secret" not in repr(settings)


# Found by the edge review (issue 43): each was accepted. Beneath a lower bound a setting is a
# slip of unit that busy-loops the sweeper or times out every host call before it is sent.
@pytest.mark.parametrize(
    "name, raw",
    [
        ("AGENT_RADAR_SWEEP_INTERVAL_S", "1e-300"),
        ("AGENT_RADAR_SWEEP_INTERVAL_S", "0.01"),
        ("AGENT_RADAR_RUNTIME_TIMEOUT_S", "0.0000001"),
        ("AGENT_RADAR_LEASE_S", "0.5"),
        ("AGENT_RADAR_MAINTENANCE_CANCEL_GRACE_S", "1e-9"),
        ("AGENT_RADAR_LOG_FORMAT", "xml"),
        ("AGENT_RADAR_BROKER_KEY_PREFIX", "radar\nCRITICAL forged:"),
        ("AGENT_RADAR_BROKER_KEY_PREFIX", "with space:"),
        ("AGENT_RADAR_BROKER_KEY_PREFIX", "p" * 129),
        ("AGENT_RADAR_RUNTIME_TOKEN", "token\r\nX-Forged: 1"),
        ("AGENT_RADAR_RUNTIME_URL", "ftp://127.0.0.1:8765"),
        # Found by the gate's second attack: each started a worker that failed at its first
        # connection (a traceback, exit status 0) or connected to another deployment's Redis.
        ("AGENT_RADAR_BROKER_URL", "redis://"),
        ("AGENT_RADAR_BROKER_URL", "redis://127.0.0.1:6379/notadb"),
        ("AGENT_RADAR_BROKER_URL", "redis://127.0.0.1:6379/\u0663"),
        ("AGENT_RADAR_BROKER_URL", "redis://127.0.0.1:6379/\u00b2"),
        ("AGENT_RADAR_BROKER_URL", "redis://127.0.0.1:6379/99999999999999999999999"),
        ("AGENT_RADAR_RESULT_BACKEND", "redis://127.0.0.1:6379/2147483647"),
        ("AGENT_RADAR_BROKER_URL", "redis://127.0.0.1:6379/0?x=1"),
        ("AGENT_RADAR_BROKER_URL", "redis://127.0.0.1:6379/5?db=7"),
        ("AGENT_RADAR_BROKER_URL", "redis://127.0.0.1:6379/0?socket_timeout=5"),
        ("AGENT_RADAR_BROKER_URL", "redis://127.0.0.1:6379/0?ssl_cert_reqs=required"),
        ("AGENT_RADAR_BROKER_URL", "rediss://127.0.0.1:6379/0?protocol=9"),
        ("AGENT_RADAR_RESULT_BACKEND", "redis://127.0.0.1:6379/1?max_connections=0"),
        ("AGENT_RADAR_BROKER_URL", "redis://127.0.0.1:123456/0"),
        ("AGENT_RADAR_BROKER_URL", "redis://127.0.0.1:0/0"),
        ("AGENT_RADAR_BROKER_URL", "filesystem://\x00"),
        ("AGENT_RADAR_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672/\n"),
        ("AGENT_RADAR_BROKER_URL", "amqp://"),
        ("AGENT_RADAR_RESULT_BACKEND", "redis://127.0.0.1:6379/x"),
        ("AGENT_RADAR_RESULT_BACKEND", "redis://127.0.0.1:6379/1\nforged"),
        ("AGENT_RADAR_RESULT_BACKEND", "db+sqlite:///results.db"),
        ("AGENT_RADAR_DATABASE_URL", "postgresql+psycopg://u@127.0.0.1:0/db"),
        ("AGENT_RADAR_DATABASE_URL", "sqlite:///a\x1b[31mb.db"),
        ("AGENT_RADAR_HOME", "/tmp/radar\nforged"),
        ("AGENT_RADAR_PULL", " TRUE\n"),
    ],
)
def test_a_setting_out_of_its_kind_is_refused_naming_the_variable(name, raw):
    env = {name: raw}
    if name == "AGENT_RADAR_BROKER_KEY_PREFIX":
        env["AGENT_RADAR_BROKER_URL"] = "redis://127.0.0.1:6379/0"
    with pytest.raises(ValueError) as refused:
        Settings.from_env(env)
    message = str(refused.value)
    assert message.startswith(name) and "\n" not in message and "\r" not in message


@pytest.mark.parametrize(
    "name, minimum",
    [
        ("AGENT_RADAR_SWEEP_INTERVAL_S", config.MIN_SWEEP_INTERVAL_S),
        ("AGENT_RADAR_RUNTIME_TIMEOUT_S", config.MIN_RUNTIME_TIMEOUT_S),
        ("AGENT_RADAR_LEASE_S", config.MIN_LEASE_S),
        ("AGENT_RADAR_MAINTENANCE_CANCEL_GRACE_S", config.MIN_MAINTENANCE_CANCEL_GRACE_S),
    ],
)
def test_the_lower_bound_itself_is_accepted(name, minimum):
    settings = Settings.from_env({name: f"{minimum:g}"})
    assert Settings.from_env(settings.to_env()) == settings


def test_the_log_format_is_text_or_json_in_any_case():
    assert Settings.from_env({}).log_format == "text"
    assert Settings.from_env({"AGENT_RADAR_LOG_FORMAT": ""}).log_format == "text"
    settings = Settings.from_env({"AGENT_RADAR_LOG_FORMAT": "JSON"})
    assert settings.log_format == "json" and Settings.from_env(settings.to_env()) == settings


@pytest.mark.parametrize("backend", ["production"])
def test_a_worker_says_when_producers_publish_without_its_key_prefix(settings, caplog):
    """With AGENT_RADAR_BROKER_KEY_PREFIX on Redis, a producer that cannot set the prefix
    (celery-node) leaves its messages under the bare queue name, where no worker reads them:
    a worker's start says so, one line per such queue, with what to do."""
    import logging

    import redis

    from agent_radar.workflows.adapters.broker import unprefixed_backlog, warn_of_unprefixed

    assert settings.broker_key_prefix  # the test settings' own
    assert unprefixed_backlog(replace(settings, broker_key_prefix="")) == {}
    client = redis.Redis.from_url(settings.broker_url)
    name = "celery"
    before = client.llen(name)
    client.lpush(name, b'{"a celery-node message": true}')
    # A bare name that is no list (another program's key) is passed over, not the end.
    had_maintenance = client.exists("maintenance")
    if not had_maintenance:
        client.set("maintenance", "not a queue")
    try:
        with caplog.at_level(logging.WARNING, logger="agent_radar.workflows.adapters.broker"):
            found = warn_of_unprefixed(settings)
    finally:
        client.lrem(name, 1, b'{"a celery-node message": true}')
        if not had_maintenance:
            client.delete("maintenance")
        client.close()
    assert found[name] == before + 1
    (line,) = [r.getMessage() for r in caplog.records if repr(name) in r.getMessage()]
    assert "AGENT_RADAR_BROKER_KEY_PREFIX" in line and settings.broker_key_prefix in line

"""Configuration from the environment (docs/configuration.md)."""

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from ..errors import InvalidArgument
from ..validation import check_url
from . import logs

DEFAULT_RUNTIME_URL = "http://127.0.0.1:8765"
AMQP_SCHEMES = frozenset({"amqp", "amqps", "pyamqp"})
BROKER_SCHEMES = AMQP_SCHEMES | {"redis", "rediss", "filesystem"}
# Where the public tasks' results go, if anywhere: Redis, or a database through Celery's
# SQLAlchemy backend (`db+postgresql+psycopg://…`).
RESULT_BACKEND_SCHEMES = frozenset({"redis", "rediss", "db"})
# The databases agent-radar runs on, as SQLAlchemy URLs name them (an optional +driver).
DATABASE_BACKENDS = frozenset({"sqlite", "postgresql"})


def _url(env: Mapping[str, str], name: str, default: str, schemes, what: str) -> str:
    """A URL setting whose scheme is one agent-radar runs on: a typo (`redsi://`) or another
    database is a setting error at start, not an outage the product retries for ever."""
    url = env.get(name) or default
    scheme = urlsplit(url).scheme if "://" in url else ""
    if scheme.split("+")[0] not in schemes:
        # The scheme only: the rest of a URL may hold a password.
        raise ValueError(
            f"{name} must be {what}, got {scheme[:40] + '://' if scheme else 'no scheme'}"
        )
    # A broker of several nodes lists each node's URL, `;`-separated (docs/broker-cluster.md).
    for one in url.split(";") if base_of(scheme) in BROKER_SCHEMES else [url]:
        problem = _url_problem(one)
        if problem is not None:
            raise ValueError(f"{name} {problem}")
    return url


def base_of(scheme: str) -> str:
    return scheme.split("+")[0]


# Hosts reached over the network by name: an empty host is the client library's localhost
# (`redis://` reached another deployment's Redis database 0).
NETWORK_SCHEMES = AMQP_SCHEMES | {"redis", "rediss"}
# What a Redis URL may say after `?`: only the TLS settings of a `rediss://` URL, which
# kombu and Celery read themselves; any other option (`db`, `socket_timeout`, …) reached
# kombu's connection as an argument it does not take, and ended a worker at its first
# connection with a TypeError.
REDIS_TLS_OPTIONS = frozenset({"ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile"})
# The largest database number a Redis server can have (its `databases` setting is a C int). A
# number past it, or one in other digits than ASCII's (kombu reads `/٣` as database 3, and
# fails on `/²` at its first connection), is no database.
MAX_REDIS_DB = 2**31 - 2


def _url_problem(url: str) -> str | None:
    """What is wrong with a URL of a known scheme, in words that quote nothing of it but
    an option's name (the rest may hold a password); None if nothing. Each of these
    started a worker that then failed at its first connection, with a traceback and exit
    status 0, or connected somewhere else."""
    if not url.isprintable() or any(char.isspace() for char in url):
        return "must not hold spaces or control characters"
    parts = urlsplit(url)
    scheme = parts.scheme if "://" in url else ""
    base = base_of(scheme)
    if base not in BROKER_SCHEMES | RESULT_BACKEND_SCHEMES | DATABASE_BACKENDS:
        return "lists a URL of another scheme"
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0:
        return "has a port that is not 1 to 65535"
    if base in NETWORK_SCHEMES and not parts.hostname:
        return "must name its host (redis://host:6379/0, amqp://user:password@host/vhost)"
    if base in ("redis", "rediss"):
        db = parts.path[1:]
        if parts.path not in ("", "/") and not (
            db.isascii() and db.isdigit() and int(db) <= MAX_REDIS_DB
        ):
            return "must name its Redis database by number (redis://host:6379/0)"
        options = {key for key, _value in parse_qsl(parts.query, keep_blank_values=True)}
        if parts.query and not options:
            options = {parts.query}
        allowed = REDIS_TLS_OPTIONS if base == "rediss" else frozenset()
        if options - allowed:
            return f"takes no option {sorted(options - allowed)[0][:40]!r}"
    if base == "db" and not scheme.startswith("db+postgresql"):
        return "must be a db+postgresql… URL when it names a database"
    return None


# Upper bounds of the numeric settings. Each is far above any sensible value, so reaching one
# means a slip of unit (milliseconds or days written as seconds) that would otherwise start
# without complaint and misbehave for hours.
# The sweeper re-publishes lost work and `status --check` calls it dead after 5 intervals:
# sweeping less often than every 10 minutes leaves lost work waiting longer than anyone would.
MAX_SWEEP_INTERVAL_S = 600.0
# A maintenance cancel that has not finished within an hour will not finish; the session
# stays held until the run is marked `cancel_timeout`.
MAX_MAINTENANCE_CANCEL_GRACE_S = 3600.0
# A crashed worker's operations and session lanes are freed only when its lease expires:
# beyond an hour, one crash stalls its sessions for longer than any operator would wait.
MAX_LEASE_S = 3600.0
# One agent host call may not outlast the task that makes it: the task's soft time limit
# (tasks/app.py, 300 s) would cut it anyway.
MAX_RUNTIME_TIMEOUT_S = 300.0
# Lower bounds, each far below any sensible value: beneath it a setting is a slip of unit
# (milliseconds written as seconds, `1e-300`) that would busy-loop the sweeper, time out
# every host call before it is sent, or free every lease as soon as it is taken.
MIN_SWEEP_INTERVAL_S = 0.1
MIN_RUNTIME_TIMEOUT_S = 0.1
MIN_LEASE_S = 1.0
MIN_MAINTENANCE_CANCEL_GRACE_S = 0.1
# A Redis key prefix is part of every key name the deployment writes: printable ASCII, no
# space, at most this long.
MAX_KEY_PREFIX_CHARS = 128
# Calls at once to one agent host from one worker process (docs/dispatch.md); a worker process
# keeps at most 256 calls in flight in all (workflows/steps/goals/flight.py).
DEFAULT_HOST_CONCURRENCY = 32
MAX_HOST_CONCURRENCY = 256
# A replay within a day must always find its operation (docs/operations.md).
MIN_RETENTION_DAYS = 1.0
# A century: "keep for ever" in practice, the limit `prune --retention-days` has too, and
# far inside what a date computed from it (now - retention) can hold.
MAX_RETENTION_DAYS = 36500.0


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    """true/false (also 1/0, yes/no, on/off, any case)."""
    raw = env.get(name)
    if raw in (None, ""):
        return default
    if not raw.isprintable():
        raise ValueError(f"{name} must be true or false, got {raw!r}")
    word = raw.strip().lower()
    if word in ("true", "1", "yes", "on"):
        return True
    if word in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"{name} must be true or false, got {raw!r}")


def _float(
    env: Mapping[str, str],
    name: str,
    default: float,
    *,
    maximum: float,
    minimum: float | None = None,
) -> float:
    """A positive, finite number up to `maximum` (and at least `minimum`). Every error is
    one line naming the variable, with the value as repr: a newline in it stays escaped."""
    raw = env.get(name)
    if raw in (None, ""):
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {raw!r}") from None
    # float() accepts "nan" and "inf", and turns "1e400" into inf: none is a duration.
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {raw!r}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {raw!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum:g}, got {raw!r}")
    if value > maximum:
        raise ValueError(f"{name} must be at most {maximum:g}, got {raw!r}")
    return value


def _whole(env: Mapping[str, str], name: str, default: int, *, maximum: int) -> int:
    """A whole number from 1 up to `maximum` (errors as _float's)."""
    value = _float(env, name, default, maximum=maximum, minimum=1)
    if not float(value).is_integer():
        raise ValueError(f"{name} must be a whole number, got {env.get(name)!r}")
    return int(value)


def _token(env: Mapping[str, str], name: str) -> str | None:
    """A bearer token: it goes into an HTTP header, so printable, without spaces."""
    raw = env.get(name) or None
    if raw is not None and not (raw.isprintable() and raw.isascii() and " " not in raw):
        raise ValueError(f"{name} must be printable ASCII without spaces")
    return raw


def _runtime_url(env: Mapping[str, str]) -> str:
    raw = env.get("AGENT_RADAR_RUNTIME_URL") or DEFAULT_RUNTIME_URL
    try:
        return check_url(raw)
    except InvalidArgument as exc:
        raise ValueError(f"AGENT_RADAR_RUNTIME_URL: {exc.message}, got {raw!r}") from None


def mask_url(url: str) -> str:
    """The URL with any password replaced by asterisks; each URL of a broker URL that lists
    a cluster's nodes, `;`-separated (docs/broker-cluster.md), too."""
    urls = url.split(";")
    if len(urls) > 1 and all("://" in one for one in urls):
        return ";".join(mask_url(one) for one in urls)
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":********@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


@dataclass(frozen=True, repr=False)
class Settings:
    home: Path
    database_url: str
    broker_url: str
    runtime_url: str = DEFAULT_RUNTIME_URL
    runtime_token: str | None = None
    sweep_interval_s: float = 2.0
    maintenance_cancel_grace_s: float = 15.0
    # How long a worker owns an operation or a session lane without renewing it. Longer than
    # the runtime call timeout, so a healthy call never loses its lease mid-flight.
    lease_s: float = 30.0
    runtime_timeout_s: float = 10.0
    host_concurrency: int = DEFAULT_HOST_CONCURRENCY
    # Whether a worker's running drain pulls goal work on PostgreSQL (docs/dispatch.md).
    pull: bool = True
    # Prefix for every broker key (Redis): lets deployments, or test runs, share one Redis.
    broker_key_prefix: str = ""
    # Settled operations and events older than this are pruned (docs/operations.md); at least 1.
    retention_days: float = 30.0
    # Celery's result backend for the public tasks (None: results are not kept).
    result_backend: str | None = None
    # How the processes write their log lines: text or json (workflows/adapters/logs.py).
    log_format: str = "text"

    @property
    def broker_folder(self) -> Path:
        return self.home / "broker"

    @property
    def is_embedded_broker(self) -> bool:
        return self.broker_url.startswith("filesystem://")

    @property
    def is_redis_broker(self) -> bool:
        return urlsplit(self.broker_url).scheme in ("redis", "rediss")

    @property
    def is_amqp_broker(self) -> bool:
        """RabbitMQ (or any AMQP 0-9-1 broker): `amqp://`, `amqps://`, `pyamqp://`."""
        return urlsplit(self.broker_url).scheme in AMQP_SCHEMES

    def __repr__(self) -> str:
        # Settings reach logs and operator tools; neither may show a secret in clear text.
        return (
            f"Settings(home={str(self.home)!r}, database_url={mask_url(self.database_url)!r}, "
            f"broker_url={mask_url(self.broker_url)!r}, runtime_url={self.runtime_url!r}, "
            f"runtime_token={'********' if self.runtime_token else None!r})"
        )

    def with_home(self, home: Path) -> "Settings":
        return replace(self, home=home)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Settings":
        env = os.environ if env is None else env
        raw_home = env.get("AGENT_RADAR_HOME") or "./.agent-radar"
        if not raw_home.isprintable():
            raise ValueError("AGENT_RADAR_HOME must not hold control characters")
        home = Path(raw_home).resolve()
        timeout_s = _float(
            env,
            "AGENT_RADAR_RUNTIME_TIMEOUT_S",
            10.0,
            minimum=MIN_RUNTIME_TIMEOUT_S,
            maximum=MAX_RUNTIME_TIMEOUT_S,
        )
        lease_s = _float(env, "AGENT_RADAR_LEASE_S", 30.0, minimum=MIN_LEASE_S, maximum=MAX_LEASE_S)
        return cls(
            home=home,
            database_url=_url(
                env,
                "AGENT_RADAR_DATABASE_URL",
                f"sqlite:///{home / 'agent-radar.db'}",
                DATABASE_BACKENDS,
                "a SQLite or PostgreSQL URL (sqlite:///path, postgresql+psycopg://…)",
            ),
            broker_url=_url(
                env,
                "AGENT_RADAR_BROKER_URL",
                "filesystem://",
                BROKER_SCHEMES,
                "a Redis, RabbitMQ or filesystem URL (redis://, amqp://, filesystem://)",
            ),
            runtime_url=_runtime_url(env),
            runtime_token=_token(env, "AGENT_RADAR_RUNTIME_TOKEN"),
            sweep_interval_s=_float(
                env,
                "AGENT_RADAR_SWEEP_INTERVAL_S",
                2.0,
                minimum=MIN_SWEEP_INTERVAL_S,
                maximum=MAX_SWEEP_INTERVAL_S,
            ),
            maintenance_cancel_grace_s=_float(
                env,
                "AGENT_RADAR_MAINTENANCE_CANCEL_GRACE_S",
                15.0,
                minimum=MIN_MAINTENANCE_CANCEL_GRACE_S,
                maximum=MAX_MAINTENANCE_CANCEL_GRACE_S,
            ),
            lease_s=max(lease_s, timeout_s + 1),
            runtime_timeout_s=timeout_s,
            host_concurrency=_whole(
                env,
                "AGENT_RADAR_HOST_CONCURRENCY",
                DEFAULT_HOST_CONCURRENCY,
                maximum=MAX_HOST_CONCURRENCY,
            ),
            pull=_flag(env, "AGENT_RADAR_PULL", True),
            broker_key_prefix=_broker_key_prefix(env),
            retention_days=_float(
                env,
                "AGENT_RADAR_RETENTION_DAYS",
                30.0,
                minimum=MIN_RETENTION_DAYS,
                maximum=MAX_RETENTION_DAYS,
            ),
            result_backend=_url(
                env,
                "AGENT_RADAR_RESULT_BACKEND",
                "",
                RESULT_BACKEND_SCHEMES,
                "a Redis URL or a db+postgresql… URL (Celery's result backend)",
            )
            if env.get("AGENT_RADAR_RESULT_BACKEND")
            else None,
            log_format="json" if logs.json_logs_wanted(env) else "text",
        )

    def to_env(self) -> dict[str, str]:
        """The environment that reproduces these settings in a child process."""
        env = {
            "AGENT_RADAR_HOME": str(self.home),
            "AGENT_RADAR_DATABASE_URL": self.database_url,
            "AGENT_RADAR_BROKER_URL": self.broker_url,
            "AGENT_RADAR_RUNTIME_URL": self.runtime_url,
            "AGENT_RADAR_SWEEP_INTERVAL_S": str(self.sweep_interval_s),
            "AGENT_RADAR_MAINTENANCE_CANCEL_GRACE_S": str(self.maintenance_cancel_grace_s),
            "AGENT_RADAR_LEASE_S": str(self.lease_s),
            "AGENT_RADAR_RUNTIME_TIMEOUT_S": str(self.runtime_timeout_s),
            "AGENT_RADAR_HOST_CONCURRENCY": str(self.host_concurrency),
            "AGENT_RADAR_PULL": "true" if self.pull else "false",
        }
        if self.runtime_token:
            env["AGENT_RADAR_RUNTIME_TOKEN"] = self.runtime_token
        if self.broker_key_prefix:
            env["AGENT_RADAR_BROKER_KEY_PREFIX"] = self.broker_key_prefix
        env["AGENT_RADAR_RETENTION_DAYS"] = str(self.retention_days)
        if self.log_format != "text":
            env["AGENT_RADAR_LOG_FORMAT"] = self.log_format
        if self.result_backend:
            env["AGENT_RADAR_RESULT_BACKEND"] = self.result_backend
        return env


def _broker_key_prefix(env: Mapping[str, str]) -> str:
    prefix = env.get("AGENT_RADAR_BROKER_KEY_PREFIX", "")
    broker = env.get("AGENT_RADAR_BROKER_URL") or ""
    if prefix and urlsplit(broker).scheme in AMQP_SCHEMES:
        # A setting that would silently do nothing is a trap: RabbitMQ separates deployments
        # by virtual host (the URL's path), not by key prefix.
        raise ValueError(
            "AGENT_RADAR_BROKER_KEY_PREFIX applies to Redis only; on RabbitMQ give each "
            "deployment its own virtual host in AGENT_RADAR_BROKER_URL (amqp://…/vhost)"
        )
    if len(prefix) > MAX_KEY_PREFIX_CHARS or not all(" " < ch <= "~" for ch in prefix):
        raise ValueError(
            f"AGENT_RADAR_BROKER_KEY_PREFIX must be printable ASCII without spaces, at most "
            f"{MAX_KEY_PREFIX_CHARS} characters, got {prefix[:80]!r}"
        )
    return prefix

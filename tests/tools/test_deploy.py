"""docker-compose.yml cannot run here (no Docker engine); check what can be checked: it
parses, has the services of the product card, and every command it runs is a real CLI
command with valid options."""

import os
import shlex
from pathlib import Path

import click
import yaml

from agent_radar.workflows.tools.cli import cli

ROOT = Path(__file__).resolve().parents[2]


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _resolve(args: list[str]) -> click.Context:
    """Parse args the way `agent-radar ARGS` would, without running anything."""
    command: click.Command = cli
    name = "agent-radar"
    while isinstance(command, click.Group):
        assert args, f"{name} needs a subcommand"
        sub = command.get_command(click.Context(command), args[0])
        assert sub is not None, f"{args[0]!r} is not a command of {name}"
        name, command, args = args[0], sub, args[1:]
    return command.make_context(name, list(args))


def test_compose_has_the_product_services():
    services = _compose()["services"]
    assert set(services) == {
        "redis",
        "rabbitmq",
        "postgres",
        "runtime-sim",
        "worker",
        "beat",
        "flower",
        "metrics",
        "prometheus",
        "grafana",
    }
    monitoring = {name for name, svc in services.items() if "monitoring" in svc.get("profiles", [])}
    assert monitoring == {"metrics", "prometheus", "grafana"}
    # Either broker: RabbitMQ on its profile; ours wait for whichever of the two runs.
    assert services["rabbitmq"]["profiles"] == ["rabbitmq"]
    for name in ("worker", "beat", "runtime-sim", "flower"):
        needs = services[name]["depends_on"]
        assert needs["redis"]["required"] is False and needs["rabbitmq"]["required"] is False


def test_every_service_of_ours_runs_a_real_cli_command():
    services = _compose()["services"]
    ours = {name: svc for name, svc in services.items() if "build" in svc}
    assert set(ours) == {"runtime-sim", "worker", "beat", "flower", "metrics"}
    for name, svc in ours.items():
        assert svc["build"]["dockerfile"] == "deploy/Dockerfile"
        ctx = _resolve(svc["command"])
        assert ctx.command.name == svc["command"][0], name


def test_worker_scales_and_beat_is_single():
    services = _compose()["services"]
    for name in ("worker", "beat"):
        svc = services[name]
        # --scale worker=N fails on a fixed container name or host port
        assert "container_name" not in svc and "ports" not in svc
    assert "replicas" not in str(services["beat"])


def test_dockerfile_installs_the_console_script():
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["agent-radar"]' in dockerfile
    for package in ("agent_radar", "models", "workflows", "tasks", "beat"):
        assert f"COPY {package} ./{package}" in dockerfile
    assert (ROOT / "deploy" / "example.env").exists()


def test_resolve_rejects_an_unknown_command():
    import pytest

    with pytest.raises(AssertionError):
        _resolve(["launch-rockets"])
    with pytest.raises(click.UsageError):
        _resolve(["beat", "--no-such-option"])


def test_compose_reads_a_required_untracked_env_file_and_hides_secrets():
    compose = _compose()
    text = (ROOT / "docker-compose.yml").read_text()
    assert "example.env" not in text.replace("cp deploy/example.env deploy/.env", "")
    assert "deploy/.env" in (ROOT / ".gitignore").read_text().split()
    services = compose["services"]
    for name, svc in services.items():
        assert "env_file" not in svc, f"{name} would get every variable of the file"
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} publicly"
        for key, value in (svc.get("environment") or {}).items():
            if any(word in key for word in ("URL", "TOKEN", "PASSWORD", "AUTH", "USER", "DB")):
                assert str(value).startswith("${") and ":?" in str(value), (name, key)
    env = {name: set(svc.get("environment") or {}) for name, svc in services.items()}
    broker = {"AGENT_RADAR_BROKER_URL", "AGENT_RADAR_BROKER_KEY_PREFIX", "AGENT_RADAR_LOG_FORMAT"}
    assert env["flower"] == broker | {"FLOWER_BASIC_AUTH"}
    # Each setting reaches the processes that read it (docs/configuration.md).
    assert {"AGENT_RADAR_RUNTIME_TIMEOUT_S", "AGENT_RADAR_HOST_CONCURRENCY"} <= env["worker"]
    assert "AGENT_RADAR_RETENTION_DAYS" in env["beat"]
    assert broker <= env["worker"] & env["beat"] & env["runtime-sim"]
    assert "AGENT_RADAR_DATABASE_URL" not in env["runtime-sim"]
    assert "AGENT_RADAR_RUNTIME_TOKEN" not in env["beat"] | env["flower"]
    assert "POSTGRES_PASSWORD" not in set().union(*(env[s] for s in env if s != "postgres"))
    assert "AGENT_RADAR_DATABASE_URL" in env["worker"]


def test_the_example_env_is_complete_and_its_flower_password_is_refused():
    from agent_radar.workflows.tools.cli.services import flower_auth_problem

    example = dict(
        line.split("=", 1)
        for line in (ROOT / "deploy" / "example.env").read_text().splitlines()
        if line and not line.startswith("#")
    )
    needed = set()
    for svc in _compose()["services"].values():
        for value in (svc.get("environment") or {}).values():
            if str(value).startswith("${"):
                needed.add(str(value)[2:].split(":")[0].split("}")[0])
    assert needed <= set(example), needed - set(example)
    assert flower_auth_problem(example["FLOWER_BASIC_AUTH"]) == "still has the example password"
    assert flower_auth_problem("ops:" + "long-random-secret") is None
    for bad in ("", "admin", "admin:", ":pw", "a:pw,b:"):
        assert flower_auth_problem(bad)


def test_dockerfile_installs_with_the_constraints_and_no_test_extras():
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert 'pip install -c constraints.txt ".[server]"' in dockerfile
    assert "[test]" not in dockerfile and "server,test" not in dockerfile
    pins = (ROOT / "constraints.txt").read_text()
    for package in ("celery==", "kombu==", "redis==", "packaging==", "SQLAlchemy=="):
        assert package in pins


def test_the_package_declares_ranges_a_client_and_a_server_extra():
    """A plain install is a client (docs/packaging.md); Celery (with its own Redis extra),
    Alembic, Flower and the Prometheus client come with `server`."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps, extras = project["dependencies"], project["optional-dependencies"]
    names = {d.split("[")[0].split(">")[0].split("<")[0].lower() for d in deps}
    assert names == {"sqlalchemy", "psycopg", "kombu", "click"}
    assert any(d.startswith("kombu[redis]") for d in deps)  # its Redis transport's imports
    assert any(d.startswith("celery[redis]") for d in extras["server"])
    for needed in ("alembic", "flower", "prometheus-client"):
        assert any(d.startswith(needed) for d in extras["server"])
    assert not any("==" in d for d in deps + extras["server"] + extras["test"])
    assert project["scripts"]["agent-radar"].startswith("agent_radar.")


def _exported_metrics() -> set[str]:
    """The exporter's gauges and the workers' own series (histograms as Prometheus names
    their parts)."""
    from agent_radar.workflows.adapters.metrics import WORKER_CIRCUIT_METRICS, WORKER_METRICS
    from agent_radar.workflows.tools.metrics import METRICS

    parts = ("", "_bucket", "_count", "_sum")
    worker = WORKER_METRICS + WORKER_CIRCUIT_METRICS
    return set(METRICS) | {m + p for m in worker for p in parts}


def _metric_names(expr: str) -> set[str]:
    import re

    return set(re.findall(r"\bagent_radar_[a-z_]+", expr))


def test_the_alert_rules_use_only_metrics_the_exporter_serves():
    import shutil
    import subprocess

    path = ROOT / "deploy" / "prometheus" / "alerts.yml"
    rules = [r for g in yaml.safe_load(path.read_text())["groups"] for r in g["rules"]]
    assert len(rules) >= 5
    served = _exported_metrics()
    for rule in rules:
        assert rule["alert"] and rule["expr"] and rule["annotations"]["summary"]
        used = _metric_names(rule["expr"])
        assert used and used <= served, (rule["alert"], used - served)
    if shutil.which("promtool") or os.environ.get("CI"):
        check = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True)
        assert check.returncode == 0, check.stdout + check.stderr
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    assert config["scrape_configs"][0]["static_configs"][0]["targets"] == ["metrics:9808"]
    workers = config["scrape_configs"][1]["dns_sd_configs"][0]
    assert (workers["names"], workers["port"]) == (["worker"], 9809)
    worker_command = _compose()["services"]["worker"]["command"]
    assert worker_command[worker_command.index("--metrics-port") + 1] == "9809"


def test_the_alert_rules_fire_as_their_unit_tests_say():
    """`promtool test rules` over deploy/prometheus/alerts.test.yml: among others, a first
    failed operation (its series did not exist before) fires AgentRadarOperationsFailing."""
    import shutil
    import subprocess

    import pytest

    if not shutil.which("promtool"):
        if os.environ.get("CI"):
            pytest.fail("promtool is missing (Debian's prometheus package; .ci/run installs it)")
        pytest.skip("promtool is not installed")
    tests = ROOT / "deploy" / "prometheus" / "alerts.test.yml"
    run = subprocess.run(
        ["promtool", "test", "rules", str(tests)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_dashboard_uses_only_metrics_the_exporter_serves():
    import json

    dashboard = json.loads(
        (ROOT / "deploy" / "grafana" / "dashboards" / "agent-radar.json").read_text()
    )
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = set().union(*(_metric_names(e) for e in exprs))
    assert used <= _exported_metrics(), used - _exported_metrics()
    assert len(used) >= 8  # every gauge has a panel


def test_compose_probes_are_real_health_commands():
    import shlex

    services = _compose()["services"]
    for name, what in (("worker", "worker"), ("beat", "beat")):
        test = services[name]["healthcheck"]["test"]
        argv = shlex.split(test[1]) if test[0] == "CMD-SHELL" else test[1:]
        assert argv[:3] == ["agent-radar", "health", what], (name, argv)
        ctx = _resolve(
            [a.replace('"$(hostname)"', "h").replace("$(hostname)", "h") for a in argv[1:]]
        )
        assert ctx.command.name == what


def _kubernetes() -> list[dict]:
    path = ROOT / "deploy" / "kubernetes" / "agent-radar.yaml"
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _container_commands(doc: dict) -> list[tuple[str, list[str]]]:
    """(what, argv) of every command a manifest runs: container args and exec probes."""
    spec = doc["spec"]["template"]["spec"]
    found = []
    for container in spec["containers"]:
        found.append((f"{doc['metadata']['name']} args", container["args"]))
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            command = (container.get(probe) or {}).get("exec", {}).get("command")
            if command:
                if command[:2] == ["sh", "-c"]:
                    command = shlex.split(command[2].replace('"$(hostname)"', "h"))
                assert command[0] == "agent-radar", command
                found.append((f"{doc['metadata']['name']} {probe}", command[1:]))
    return found


SECRET_KEYS = {
    "agent-radar-migrate": {"AGENT_RADAR_DATABASE_URL"},
    "agent-radar-worker": {
        "AGENT_RADAR_DATABASE_URL",
        "AGENT_RADAR_BROKER_URL",
        "AGENT_RADAR_RUNTIME_URL",
        "AGENT_RADAR_RUNTIME_TOKEN",
        "AGENT_RADAR_REDIS_ADDRESS",
    },
    "agent-radar-beat": {"AGENT_RADAR_DATABASE_URL", "AGENT_RADAR_BROKER_URL"},
    "agent-radar-metrics": {"AGENT_RADAR_DATABASE_URL"},
}


def test_the_kubernetes_pods_run_unprivileged_with_resources():
    for doc in _kubernetes():
        if doc["kind"] not in ("Job", "Deployment"):
            continue
        name, pod = doc["metadata"]["name"], doc["spec"]["template"]["spec"]
        context = pod["securityContext"]
        assert context["runAsNonRoot"] is True and context["runAsUser"] == 10001, name
        for container in pod["containers"]:
            own = container["securityContext"]
            assert own["allowPrivilegeEscalation"] is False, name
            assert own["readOnlyRootFilesystem"] is True, name
            assert own["capabilities"]["drop"] == ["ALL"], name
            assert container["resources"]["requests"]["memory"], name
            assert container["resources"]["limits"]["memory"], name
            # what it writes (beat's schedule, a worker's metrics) goes to its own volumes
            assert {m["mountPath"] for m in container["volumeMounts"]} >= {"/tmp"}, name
    # KEDA's Redis address is one the worker's container has.
    keda = next(d for d in _kubernetes() if d["kind"] == "ScaledObject")
    address = keda["spec"]["triggers"][0]["metadata"]["addressFromEnv"]
    assert address in SECRET_KEYS["agent-radar-worker"]


def test_the_kubernetes_manifests_match_the_kubernetes_schema(tmp_path):
    """kubernetes-validate --strict (the API's own schemas, unknown fields refused); a
    manifest with a wrong field fails it, so the check can fail."""
    import shutil
    import subprocess
    import sys

    validate = Path(sys.executable).parent / "kubernetes-validate"
    assert validate.exists() or shutil.which("kubernetes-validate"), "kubernetes-validate"
    manifest = ROOT / "deploy" / "kubernetes" / "agent-radar.yaml"
    run = subprocess.run(
        [str(validate), "--strict", str(manifest)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stdout + run.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text(manifest.read_text().replace("replicas: 2", "replicas: two", 1))
    run = subprocess.run(
        [str(validate), "--strict", str(broken)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode != 0


def test_the_dockerfile_passes_hadolint_and_runs_unprivileged_with_a_healthcheck():
    import subprocess
    import sys

    dockerfile = ROOT / "deploy" / "Dockerfile"
    hadolint = Path(sys.executable).parent / "hadolint"
    run = subprocess.run([str(hadolint), str(dockerfile)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    text = dockerfile.read_text()
    assert "USER 10001:10001" in text and "HEALTHCHECK" in text
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", ".agent-radar", "deploy/.env"} <= set(ignored)


def test_the_kubernetes_manifests_run_real_commands_with_probes():
    docs = _kubernetes()
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {
        ("Job", "agent-radar-migrate"),
        ("Deployment", "agent-radar-worker"),
        ("Deployment", "agent-radar-beat"),
        ("Deployment", "agent-radar-metrics"),
        ("Service", "agent-radar-metrics"),
        ("ScaledObject", "agent-radar-worker"),
    } <= kinds
    for doc in docs:
        if doc["kind"] not in ("Job", "Deployment"):
            continue
        for what, argv in _container_commands(doc):
            # parses as `agent-radar ARGV` would: an unknown command or option fails here
            ctx = _resolve(list(argv))
            assert ctx.command.name in argv, what
        containers = doc["spec"]["template"]["spec"]["containers"]
        for container in containers:
            env_names = {e["name"] for e in container.get("env", [])}
            assert env_names, f"{doc['metadata']['name']} gets no settings"
            for e in container.get("env", []):
                assert "value" not in e, "secrets come from the Secret, never inline"
            # Each container gets the Secret's keys it needs, never the whole Secret.
            assert not [f for f in container.get("envFrom", []) if "secretRef" in f]
            name = doc["metadata"]["name"]
            assert env_names <= SECRET_KEYS[name], (name, env_names - SECRET_KEYS[name])
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    assert deployments["agent-radar-beat"]["spec"]["replicas"] == 1
    worker = deployments["agent-radar-worker"]["spec"]["template"]["spec"]
    assert "livenessProbe" in worker["containers"][0]
    beat = deployments["agent-radar-beat"]["spec"]["template"]["spec"]["containers"][0]
    assert beat["livenessProbe"]["exec"]["command"] == ["agent-radar", "health", "beat"]
    # Compose and Kubernetes give a stopping worker the same time.
    grace = worker["terminationGracePeriodSeconds"]
    assert f"{grace}s" == _compose()["services"]["worker"]["stop_grace_period"]


def _without_required(node):
    """The compose file without `depends_on.<service>.required` (Compose 2.20), which
    Compose v1 — the `docker-compose` Debian ships — does not know; each must be a bool."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "depends_on" and isinstance(value, dict):
                for dependency in value.values():
                    assert isinstance(dependency.pop("required", False), bool)
            else:
                _without_required(value)
    elif isinstance(node, list):
        for item in node:
            _without_required(item)
    return node


def test_compose_config_validates_and_names_a_missing_setting(tmp_path):
    """`docker-compose config`: the file passes Compose's own schema and interpolation with
    deploy/example.env (every service, every profile), and without a required setting it
    stops naming it."""
    import shutil
    import subprocess

    from tests.conftest import skip_or_fail

    exe = shutil.which("docker-compose")
    if exe is None:
        skip_or_fail("no docker-compose (Debian: apt-get install docker-compose)")
    checked = tmp_path / "docker-compose.yml"
    checked.write_text(yaml.safe_dump(_without_required(_compose())))

    def config(env_file: Path, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [exe, "-f", str(checked), "--project-directory", str(ROOT)]
            + ["--env-file", str(env_file), *args, "config"],
            capture_output=True,
            text=True,
            timeout=120,
        )

    example = ROOT / "deploy" / "example.env"
    for profile in ([], ["--profile", "monitoring"], ["--profile", "rabbitmq"]):
        done = config(example, *profile)
        assert done.returncode == 0, done.stderr
        resolved = yaml.safe_load(done.stdout)
        assert {"postgres", "worker", "beat", "flower"} <= set(resolved["services"])
        worker_env = resolved["services"]["worker"]["environment"]
        assert worker_env["AGENT_RADAR_BROKER_URL"], worker_env
    lacking = tmp_path / "lacking.env"
    lacking.write_text(
        "".join(
            line + "\n"
            for line in example.read_text().splitlines()
            if not line.startswith("AGENT_RADAR_BROKER_URL=")
        )
    )
    done = config(lacking)
    assert done.returncode != 0 and "AGENT_RADAR_BROKER_URL" in done.stderr, done.stderr

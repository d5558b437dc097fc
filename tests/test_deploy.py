"""docker-compose.yml cannot run here (no Docker engine); check what can be checked: it
parses, has the services of the product card, and every command it runs is a real CLI
command with valid options."""

from pathlib import Path

import click
import yaml

from workflows.cli import cli

ROOT = Path(__file__).resolve().parents[1]


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
    assert set(services) == {"redis", "postgres", "runtime-sim", "worker", "beat", "flower"}


def test_every_service_of_ours_runs_a_real_cli_command():
    services = _compose()["services"]
    ours = {name: svc for name, svc in services.items() if "build" in svc}
    assert set(ours) == {"runtime-sim", "worker", "beat", "flower"}
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
    for package in ("models", "workflows", "tasks", "beat"):
        assert f"COPY {package} ./{package}" in dockerfile
    env_file = _compose()["services"]["worker"]["env_file"]
    assert (ROOT / env_file).exists()


def test_resolve_rejects_an_unknown_command():
    import pytest
    with pytest.raises(AssertionError):
        _resolve(["launch-rockets"])
    with pytest.raises(click.UsageError):
        _resolve(["worker", "--no-such-option"])

"""compose.yaml: every service runs a command that exists here, with its dependencies declared."""

from __future__ import annotations

import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from config.celery import CONTROL_QUEUES, INVOCATIONS, QUEUES, ROUTES
from config.settings import Settings
from corral.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "compose.yaml").read_text())
    assert isinstance(data, dict)
    return data


def _command(service: dict[str, Any]) -> list[str]:
    command = service.get("command", [])
    return shlex.split(command) if isinstance(command, str) else list(command)


def test_services_are_the_production_shape(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) >= {
        "redis",
        "postgres",
        "migrate",
        "worker",
        "beat",
        "flower",
        "registry",
        "agent",
        "gateway",
    }
    assert "--appendonly" in _command(services["redis"])  # a broker that survives restarts
    assert services["migrate"]["restart"] == "no"
    assert services["beat"]["deploy"]["replicas"] == 1
    worker = services["worker"]
    assert "container_name" not in worker and "ports" not in worker  # --scale worker=N works
    gateway = services["gateway"]
    assert "container_name" not in gateway  # --scale gateway=N works: a host port range
    assert gateway["ports"] == ["${CORRAL_GATEWAY_PORTS:-8080-8089}:8080"]
    assert gateway["environment"]["CORRAL_GATEWAY_TOKEN"].startswith(
        "${CORRAL_GATEWAY_TOKEN:?"
    )  # off loopback: never without a token
    for name in ("redis", "postgres", "worker", "flower", "registry", "agent", "gateway"):
        assert "healthcheck" in services[name], name
    assert "FLOWER_BASIC_AUTH" in services["flower"]["environment"]
    # the exporter listens off loopback in its container: only with a token
    assert "CORRAL_METRICS_TOKEN" in services["metrics"]["environment"]
    assert "healthcheck" in services["metrics"]


def test_every_dependency_is_a_declared_service(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, service in services.items():
        for dep, cond in (service.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            if cond.get("condition") == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits on {dep}'s health"
    assert services["worker"]["depends_on"]["migrate"]["condition"] == (
        "service_completed_successfully"
    )


def test_every_corral_command_parses(compose: dict[str, Any]) -> None:
    parser = build_parser()
    for name, service in compose["services"].items():
        argv = _command(service)
        if not argv or service.get("image", "").split(":")[0] in ("redis", "postgres"):
            continue
        if argv[0] == "corral":
            args = parser.parse_args(argv[1:])
            assert callable(args.handler), name
        else:
            assert argv[:3] == ["celery", "-A", "workers"], name
            assert argv[3] in ("worker", "beat", "flower"), name


def test_executables_and_packages_are_declared(compose: dict[str, Any]) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = " ".join(project["dependencies"]).lower()
    assert "corral" in project["scripts"]
    for needed in ("celery", "flower", "psycopg", "redis", "grpcio", "sqlalchemy", "alembic"):
        assert needed in deps, needed
    dockerfile = (ROOT / "Dockerfile").read_text()
    for package in project_packages():
        assert f"COPY {package} {package}" in dockerfile, package


def project_packages() -> list[str]:
    """Top-level packages the project installs."""
    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return [p.rstrip("*") for p in found["packages"]["find"]["include"]]


def test_environment_names_real_settings(compose: dict[str, Any]) -> None:
    known = {"CORRAL_" + f.upper() for f in Settings.model_fields}
    for name, service in compose["services"].items():
        env = service.get("environment") or {}
        for key in env:
            if key.startswith("CORRAL_"):
                assert key in known, f"{name}: {key} is not a corral setting"


def test_asynchronous_calls_have_a_queue_and_workers_of_their_own(
    compose: dict[str, Any],
) -> None:
    """A backlog of calls never delays a spawn, a delete or housekeeping."""
    services = compose["services"]

    def queues(name: str) -> set[str]:
        argv = _command(services[name])
        return set(argv[argv.index("-Q") + 1].split(","))

    assert queues("worker") == set(CONTROL_QUEUES)
    assert queues("invoker") == {INVOCATIONS}
    assert INVOCATIONS not in CONTROL_QUEUES and set(QUEUES) == {*CONTROL_QUEUES, INVOCATIONS}
    assert {task for task, route in ROUTES.items() if route["queue"] == INVOCATIONS} == {
        "corral.invoke",
        "corral.call_callback",
    }

"""docker-compose.yml and Dockerfile: the stack's shape, and env names that Settings really reads.

`docker compose config` runs where the compose plugin exists; otherwise YAML + required keys."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from compute.contract.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
# Environment names read by code outside Settings (each is documented where it is read).
NON_SETTINGS_ENV = {"HF_HOME"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_services_present(compose: dict) -> None:
    assert {"redis", "postgres", "app", "worker", "flower"} <= set(compose["services"])
    assert {"postgres-data", "fisherlens-data"} <= set(compose["volumes"])


def test_postgres_and_redis_have_healthchecks_and_volumes(compose: dict) -> None:
    for name in ("postgres", "redis"):
        svc = compose["services"][name]
        assert svc["healthcheck"]["test"], name
        assert svc["volumes"], name
    assert any(
        "pg_isready" in " ".join(t) if isinstance(t, list) else "pg_isready" in t
        for t in [compose["services"]["postgres"]["healthcheck"]["test"]]
    )


@pytest.mark.parametrize("name", ["app", "worker"])
def test_app_and_worker_wait_for_healthy_services_and_migrate(compose: dict, name: str) -> None:
    svc = compose["services"][name]
    deps = svc["depends_on"]
    assert deps["postgres"]["condition"] == "service_healthy"
    assert deps["redis"]["condition"] == "service_healthy"
    cmd = " ".join(svc["command"])
    assert "fisherlens db upgrade" in cmd
    env = svc["environment"]
    assert (
        env["DATABASE_URL"].startswith("postgresql+psycopg://")
        and "@postgres:5432/" in env["DATABASE_URL"]
    )
    assert env["REDIS_URL"] == "redis://redis:6379/0"


def test_worker_reserves_an_nvidia_gpu_and_runs_the_worker(compose: dict) -> None:
    svc = compose["services"]["worker"]
    (dev,) = svc["deploy"]["resources"]["reservations"]["devices"]
    assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"]
    assert "fisherlens worker" in " ".join(svc["command"])
    per_gpu = compose["services"]["worker-gpu1"]["deploy"]["resources"]["reservations"]["devices"][
        0
    ]
    assert per_gpu["device_ids"] == ["1"]


def test_flower_watches_the_same_broker(compose: dict) -> None:
    svc = compose["services"]["flower"]
    assert any("redis://redis:6379/0" in part for part in svc["command"])
    assert svc["depends_on"]["redis"]["condition"] == "service_healthy"


def test_environment_names_match_settings_fields(compose: dict) -> None:
    fields = {name.upper() for name in Settings.model_fields}
    for name, svc in compose["services"].items():
        env = svc.get("environment") or {}
        if name in ("postgres", "redis", "flower"):
            continue  # third-party images, their own variables
        unknown = set(env) - fields - NON_SETTINGS_ENV
        assert not unknown, f"{name}: environment names not in compute.contract.settings.Settings: {unknown}"
        # And Settings accepts the values as given.
        values = {k.lower(): v for k, v in env.items() if k in fields}
        values = {
            k: (v if "${" not in str(v) else "http://localhost:7860") for k, v in values.items()
        }
        Settings(**values)


def test_dockerfile_and_dockerignore() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert text.startswith("#") and "FROM python:" in text
    for part in ("COPY app app", "COPY compute compute", "COPY storage storage", "EXPOSE 7860"):
        assert part in text
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


@pytest.mark.skipif(shutil.which("docker") is None, reason="no docker client on this machine")
def test_docker_compose_config_when_the_plugin_exists() -> None:
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip("docker compose plugin not installed (checked YAML and keys above instead)")
    out = subprocess.run(
        ["docker", "compose", "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr

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
    assert {"redis", "postgres", "minio", "minio-init", "app", "worker", "flower"} <= set(
        compose["services"]
    )
    assert {"postgres-data", "minio-data"} <= set(compose["volumes"])


def _named_volumes(svc: dict) -> set[str]:
    """Named volumes a service mounts (anonymous `/path` volumes and host folders excluded)."""
    out = set()
    for v in svc.get("volumes") or []:
        source = v.split(":")[0] if isinstance(v, str) and ":" in v else None
        if source and not source.startswith((".", "/", "$", "~")):
            out.add(source)
    return out


def test_web_and_workers_share_no_artifact_volume(compose: dict) -> None:
    """Web and workers meet only in PostgreSQL, Redis and the object store: no named volume is
    mounted by two of them (each keeps its own home: cache, zoo)."""
    services = compose["services"]
    fl = [n for n, svc in services.items() if "fisherlens" in " ".join(svc.get("command") or [])]
    assert {"app", "worker", "worker-gpu1"} <= set(fl)
    seen: dict[str, str] = {}
    for name in fl:
        for vol in _named_volumes(services[name]):
            assert vol not in seen, f"{name} and {seen[vol]} share volume {vol}"
            seen[vol] = name
    for name in fl:
        assert any(str(v).split(":")[0] == "/data" or str(v).endswith(":/data")
                   for v in services[name]["volumes"]), f"{name}: no home at /data"


def test_minio_bucket_created_at_start_and_named_by_artifact_url(compose: dict) -> None:
    services = compose["services"]
    minio = services["minio"]
    assert minio["image"].startswith("minio/minio") and minio["healthcheck"]["test"]
    assert "minio-data:/data" in minio["volumes"]
    init = services["minio-init"]
    assert init["image"].startswith("minio/mc") and init["restart"] == "no"
    assert init["depends_on"]["minio"]["condition"] == "service_healthy"
    script = " ".join(init["entrypoint"])
    assert "mc alias set store http://minio:9000" in script
    for name in ("app", "worker"):
        svc = services[name]
        assert svc["depends_on"]["minio-init"]["condition"] == "service_completed_successfully"
        env = svc["environment"]
        settings = Settings(**{k.lower(): v for k, v in env.items() if k.lower() in Settings.model_fields
                               and "${" not in str(v)})
        bucket = settings.artifact_url.removeprefix("s3://").split("/")[0]
        assert f"mc mb --ignore-existing store/{bucket}" in script, (bucket, script)
        assert env["AWS_ENDPOINT_URL"] == "http://minio:9000"
        # the credentials are MinIO's root user, from the same .env variables
        assert env["AWS_ACCESS_KEY_ID"] == minio["environment"]["MINIO_ROOT_USER"]
        assert env["AWS_SECRET_ACCESS_KEY"] == minio["environment"]["MINIO_ROOT_PASSWORD"]


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
        if name in ("postgres", "redis", "flower", "minio", "minio-init"):
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

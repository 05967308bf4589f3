"""docker-compose.yml and the Dockerfile, validated by parsing (no Docker engine runs here): every server is
started from the one config file, which loads, names each service by its compose name and points at the
compose PostgreSQL; every port is published on 127.0.0.1 only; the package is installed when the image is
built, never by a container at start."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from apps import config as cfg

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def credentials_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """What compose hands each server (docker-compose.yml `environment`)."""
    monkeypatch.setenv("ROLLBOOK_CONTROL_TOKEN", "control-from-env")
    monkeypatch.setenv("ROLLBOOK_DATA_TOKEN", "data-from-env")


def test_compose_runs_postgres_and_the_four_servers_from_one_config() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"postgres", "migrate", *cfg.KINDS}
    config = cfg.load(ROOT / "deploy" / "rollbook.toml")
    pg = services["postgres"]["environment"]
    dsn = f"postgresql://{pg['POSTGRES_USER']}:{pg['POSTGRES_PASSWORD']}@postgres:5432/{pg['POSTGRES_DB']}"
    assert config.dsn is None and services["migrate"]["environment"]["ROLLBOOK_DSN"] == dsn
    assert services["migrate"]["command"] == ["rollbook", "db", "upgrade"]
    for kind in cfg.KINDS:
        service = services[kind]
        assert service["command"] == ["rollbook", "serve", kind, "--config", "/config/rollbook.toml"], kind
        assert service["volumes"] == ["./deploy:/config:ro"]  # the merged anchor reached every server
        assert service["environment"]["ROLLBOOK_DSN"] == dsn
        server = config.servers[kind]
        assert server.host == kind and server.bind == "0.0.0.0"
        assert service["ports"] == [f"127.0.0.1:{server.port}:{server.port}"]
        assert service["depends_on"]["migrate"]["condition"] == "service_completed_successfully"


def test_compose_publishes_every_port_on_localhost_only() -> None:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    published = [p for s in services.values() for p in s.get("ports", [])]
    assert published and all(str(p).startswith("127.0.0.1:") for p in published), published


def test_the_image_installs_the_package_at_build_time_and_no_container_installs_at_start() -> None:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    for name, service in services.items():
        if name == "postgres":
            continue
        assert service["build"] == "." and service["image"] == "rollbook:local", name
        assert "pip" not in " ".join(service["command"]), name
        assert not any(v.startswith(".:") for v in service.get("volumes", [])), name  # no source mount
    dockerfile = (ROOT / "Dockerfile").read_text().splitlines()
    copied = [line.split()[1] for line in dockerfile if line.startswith("COPY ")]
    assert all((ROOT / c).exists() for c in copied), copied
    assert {"engine", "participants", "adapters", "apps", "migrations", "pyproject.toml"} <= set(copied)
    assert any(line.startswith("RUN pip install") and " . " in line + " " for line in dockerfile)
    assert dockerfile[-1] == "USER rollbook"


def test_the_deploy_config_keeps_the_sandbox_off_and_every_secret_out_of_the_shared_files() -> None:
    config = cfg.load(ROOT / "deploy" / "rollbook.toml")
    assert config.sandbox is None and "sandbox" not in config.environments()
    # The config, read by the containers' user, holds no credential: they come from the environment,
    # which compose fills from the operator's shell and refuses to start without.
    assert (config.control_token, config.data_token) == ("control-from-env", "data-from-env")
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    pg_password = "${ROLLBOOK_PG_PASSWORD:?set ROLLBOOK_PG_PASSWORD}"
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD"] == pg_password
    for kind in cfg.KINDS:
        env = services[kind]["environment"]
        assert env["ROLLBOOK_CONTROL_TOKEN"] == "${ROLLBOOK_CONTROL_TOKEN:?set ROLLBOOK_CONTROL_TOKEN}"
        assert env["ROLLBOOK_DATA_TOKEN"] == "${ROLLBOOK_DATA_TOKEN:?set ROLLBOOK_DATA_TOKEN}"
        assert pg_password in env["ROLLBOOK_DSN"]

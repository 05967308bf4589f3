"""docker-compose.yml and the Dockerfile, validated by parsing (no Docker engine runs here): every server is
started from the one config file, which loads, names each service by its compose name and points at the
compose PostgreSQL; every port is published on 127.0.0.1 only; the package is installed when the image is
built, never by a container at start."""

from __future__ import annotations

from pathlib import Path

import yaml

from apps import config as cfg

ROOT = Path(__file__).resolve().parent.parent


def test_compose_runs_postgres_and_the_four_servers_from_one_config() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"postgres", "migrate", *cfg.KINDS}
    config = cfg.load(ROOT / "deploy" / "rollbook.toml")
    pg = services["postgres"]["environment"]
    assert config.dsn == f"postgresql://{pg['POSTGRES_USER']}:{pg['POSTGRES_PASSWORD']}@postgres:5432/{pg['POSTGRES_DB']}"
    assert services["migrate"]["environment"]["ROLLBOOK_DSN"] == config.dsn
    assert services["migrate"]["command"] == ["rollbook", "db", "upgrade"]
    for kind in cfg.KINDS:
        service = services[kind]
        assert service["command"] == ["rollbook", "serve", kind, "--config", "/config/rollbook.toml"], kind
        assert service["volumes"] == ["./deploy:/config:ro"]  # the merged anchor reached every server
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


def test_the_deploy_config_keeps_the_sandbox_off_and_the_two_credentials_apart() -> None:
    config = cfg.load(ROOT / "deploy" / "rollbook.toml")
    assert config.sandbox is None and "sandbox" not in config.environments()
    assert config.control_token != config.data_token

"""docker-compose.yml, validated by parsing (no Docker engine runs here): every server is started from
the one config file, which loads, names each service by its compose name and points at the compose
PostgreSQL; published ports match the config."""

from __future__ import annotations

import re
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
    for kind in cfg.KINDS:
        service = services[kind]
        command = " ".join(service["command"])
        assert re.search(rf"rollbook serve {kind} --config /config/rollbook.toml", command), kind
        assert "./deploy:/config:ro" in service["volumes"]  # the merged anchor reached every server
        server = config.servers[kind]
        assert server.host == kind and server.bind == "0.0.0.0"
        assert service["ports"] == [f"{server.port}:{server.port}"]
        assert service["depends_on"]["migrate"]["condition"] == "service_completed_successfully"

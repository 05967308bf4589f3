"""A `[nemo_gym.<name>]` table carries the server's own config fields and the relay's bounds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from apps import config as cfg
from engine.errors import ConfigError

SERVERS = {k: cfg.ServerConfig(port=9000 + i) for i, k in enumerate(cfg.KINDS)}


def test_the_servers_own_config_round_trips_and_reaches_the_launcher_as_json(tmp_path: Path) -> None:
    own = {"step": 3, "greeting": 'say "hi"', "enabled": True, "weights": [0.5, 1], "judge": {"name": "j", "n": 2}}
    written = cfg.Config(control_token="control-t0k", data_token="data-t0ken", servers=SERVERS, nemo_gym={
        "gym_calendar": cfg.NemoGymConfig(module="resources_servers.calendar.app", config=own,
                                          config_file="configs/calendar_v2.yaml", rebuild_attempts=2)})
    cfg.write(written, tmp_path / "rollbook.toml")
    loaded = cfg.load(tmp_path / "rollbook.toml")
    assert loaded.nemo_gym == written.nemo_gym
    (server,) = loaded.gym_servers(port=lambda: 9300)
    assert json.loads(server.overrides) == own
    assert (server.config_file, server.rebuild_attempts) == ("configs/calendar_v2.yaml", 2)


def test_a_table_as_a_person_writes_it_with_a_config_sub_table(tmp_path: Path) -> None:
    cfg.write(cfg.Config(control_token="control-t0k", data_token="data-t0ken", servers=SERVERS), tmp_path / "r.toml")
    path = tmp_path / "r.toml"
    path.write_text(path.read_text() + '\n[nemo_gym.g]\nmodule = "resources_servers.x.app"\n'
                    '[nemo_gym.g.config]\ntool_call_comparator_config = { mode = "exact" }\n')
    assert cfg.load(path).nemo_gym["g"].config == {"tool_call_comparator_config": {"mode": "exact"}}


def test_rebuild_attempts_must_be_at_least_one(tmp_path: Path) -> None:
    cfg.write(cfg.Config(control_token="control-t0k", data_token="data-t0ken", servers=SERVERS), tmp_path / "r.toml")
    path = tmp_path / "r.toml"
    path.write_text(path.read_text() + '\n[nemo_gym.g]\nmodule = "m"\nrebuild_attempts = 0\n')
    with pytest.raises(ConfigError, match="nemo_gym.g.rebuild_attempts"):
        cfg.load(path)

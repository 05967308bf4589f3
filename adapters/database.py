"""Which database, and whether its schema matches this code.

The DSN comes from `--dsn`, then ROLLBOOK_DSN, then the embedded default. An external database
is never migrated behind its owner's back: a server refuses to start on a schema that is behind
or ahead and names the command to run. The embedded default upgrades itself.
"""

from __future__ import annotations

import ast
import functools
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy.engine import make_url

from engine.errors import ConfigError, SchemaMismatch

if TYPE_CHECKING:
    from alembic.config import Config

MIGRATIONS = Path(__file__).resolve().parent.parent / "migrations"


DSN_FIX = ("write it as a URL, postgresql://user:password@host:5432/dbname, in --dsn, ROLLBOOK_DSN or the config's "
           "`dsn` (or give none of them, for the embedded server)")
CONNECT_FIX = ("check that PostgreSQL runs there and that the DSN's host, port, user, password and database are right "
               "(--dsn, ROLLBOOK_DSN or the config's `dsn`; give none of them for the embedded server)")


def resolve_dsn(dsn: str | None = None) -> tuple[str, bool]:
    """Return (libpq-style DSN, whether it is the embedded default)."""
    chosen = dsn or os.environ.get("ROLLBOOK_DSN")
    if chosen:
        check_dsn_form(chosen)
        return chosen, False
    from adapters import embedded

    return embedded.start(), True


def check_dsn_form(dsn: str) -> None:
    """Only the URL form is accepted: every layer (SQLAlchemy, Alembic, psycopg) reads it the same way."""
    scheme = dsn.split("://", 1)[0] if "://" in dsn else None
    if scheme is None:
        what = "a key=value DSN" if "=" in dsn else "not a URL"
        raise ConfigError(f"the database DSN {_redact(dsn)!r} is {what}", DSN_FIX)
    if not scheme.startswith(("postgresql", "postgres")):
        raise ConfigError(f"the database DSN names scheme {scheme!r}, not postgresql", DSN_FIX)


def _redact(dsn: str) -> str:
    import re

    return re.sub(r"(password\s*=\s*)\S+", r"\1***", re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", dsn))


def sqlalchemy_url(dsn: str) -> str:
    """psycopg 3 under SQLAlchemy, whatever spelling of postgres:// the user gave."""
    url = make_url(dsn)
    return url.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)


def libpq_dsn(dsn: str) -> str:
    url = make_url(dsn)
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


def _alembic_config(dsn: str) -> Config:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", sqlalchemy_url(dsn).replace("%", "%%"))
    return cfg


_REVISION_LINE = re.compile(r"^(revision|down_revision)\s*(?::[^=]*)?=\s*(.+)$", re.MULTILINE)


@functools.cache
def known_revisions() -> tuple[str, frozenset[str]]:
    """(the newest revision, every revision) of this code's migrations, read from the files' own
    `revision` and `down_revision` lines. Every server start and every status answer checks the
    schema; loading Alembic for that cost 0.4 s of CPU per process, and the suite starts hundreds.
    tests/adapters/test_database.py holds the answer equal to Alembic's."""
    revisions: set[str] = set()
    parents: set[str] = set()
    for path in (MIGRATIONS / "versions").glob("*.py"):
        lines = dict(_REVISION_LINE.findall(path.read_text()))
        revisions.add(ast.literal_eval(lines["revision"]))
        down = ast.literal_eval(lines["down_revision"])
        parents.update([down] if isinstance(down, str) else down or ())
    heads = revisions - parents
    if len(heads) != 1:
        raise RuntimeError(f"the migrations in {MIGRATIONS} have {len(heads)} heads ({sorted(heads)}), not one")
    return heads.pop(), frozenset(revisions)


def code_revision() -> str:
    return known_revisions()[0]


# A database the network cuts off drops packets silently, and the kernel's own retries would hold a
# new connection about two minutes and a query on an open one about fifteen (its retransmissions),
# with nothing said and past any patience of ours. So a connection gives up after CONNECT_TIMEOUT_S,
# and an open one whose sent data goes unacknowledged that long fails (libpq's tcp_user_timeout). A
# long query is not cut by it: the server acknowledges a request as it arrives. Over a Unix socket
# neither applies. A DSN's own setting of either wins.
CONNECT_TIMEOUT_S = 10


def connect_options(dsn: str) -> dict[str, int]:
    """The libpq parameters every connection of a process adds to its DSN (the ones it does not set)."""
    import psycopg

    given = psycopg.conninfo.conninfo_to_dict(libpq_dsn(dsn))
    ours = {"connect_timeout": CONNECT_TIMEOUT_S, "tcp_user_timeout": CONNECT_TIMEOUT_S * 1000}
    return {k: v for k, v in ours.items() if k not in given}


def database_revision(dsn: str) -> str | None:
    """The revision the database's schema is at (None: never migrated)."""
    import psycopg

    with psycopg.connect(libpq_dsn(dsn), autocommit=True, **connect_options(dsn)) as conn:
        try:
            rows = conn.execute("SELECT version_num FROM rollbook.alembic_version").fetchall()
        except psycopg.errors.UndefinedTable:
            return None
    if len(rows) > 1:
        at = ",".join(sorted(r[0] for r in rows))
        raise SchemaMismatch(f"the database schema is at {len(rows)} revisions at once ({at})", database=at,
                             code=code_revision())
    return rows[0][0] if rows else None


def upgrade(dsn: str) -> str:
    from alembic import command

    command.upgrade(_alembic_config(dsn), "head")
    return code_revision()


def check_schema(dsn: str) -> None:
    """Refuse to run against a schema this code does not match."""
    have = database_revision(dsn)
    want, known = known_revisions()
    if have == want:
        return
    if have is not None and have not in known:
        raise SchemaMismatch(
            f"the database schema is at revision {have}, ahead of this code ({want}); "
            "upgrade rollbook on this machine, or point it at another database",
            database=have,
            code=want,
        )
    raise SchemaMismatch(
        f"the database schema is at revision {have or 'none'}, behind this code ({want}); "
        f"run `rollbook db upgrade --dsn ...` (or set ROLLBOOK_DSN) first",
        database=have,
        code=want,
    )


def prepare_database(dsn: str | None = None) -> str:
    """Resolve the DSN and make sure its schema is usable; return the DSN."""
    chosen, is_embedded = resolve_dsn(dsn)
    if is_embedded and database_revision(chosen) != code_revision():
        upgrade(chosen)
    else:
        check_schema(chosen)
    return chosen


def sibling_url(dsn: str, dbname: str) -> str:
    """The URL of database `dbname` on the server `dsn` names (URL or key=value form): a
    postgresql:// URL, which both SQLAlchemy and psycopg read."""
    from urllib.parse import quote

    import psycopg

    info = psycopg.conninfo.conninfo_to_dict(psycopg.conninfo.make_conninfo(libpq_dsn(dsn) if "://" in dsn else dsn))
    host, user = info.get("host", ""), info.get("user", "postgres")
    pw = f":{info['password']}" if info.get("password") else ""
    port = f":{info['port']}" if info.get("port") else ""
    # The rest (the embedded server's passfile, sslmode, ...) applies to every database of the server.
    params = [f"{k}={quote(str(v), safe='/')}" for k, v in info.items()
              if k not in ("host", "user", "password", "port", "dbname") and v is not None]
    if host.startswith("/"):
        return f"postgresql://{user}{pw}@{port}/{dbname}?" + "&".join([f"host={host}", *params])
    return f"postgresql://{user}{pw}@{host}{port}/{dbname}" + ("?" + "&".join(params) if params else "")


def scratch_database(dsn: str, name: str, migrate: bool = True) -> str:
    """A new database beside the one `dsn` names, on the same server (migrated unless told not to)."""
    import psycopg

    with psycopg.connect(sibling_url(dsn, "postgres"), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    scratch = sibling_url(dsn, name)
    if migrate:
        upgrade(scratch)
    return scratch


def drop_database(dsn: str) -> None:
    import psycopg

    name = psycopg.conninfo.conninfo_to_dict(libpq_dsn(dsn))["dbname"]
    with psycopg.connect(sibling_url(dsn, "postgres"), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def like_prefix(prefix: str) -> str:
    """A LIKE pattern matching the strings that start with `prefix`, and only those: `_` and `%` in
    the prefix are literal (a run `a_b` must not take in run `a-b`'s rollouts). The backslash is
    PostgreSQL's default LIKE escape, so no ESCAPE clause is needed."""
    return prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"

"""A process's database connections: how many it may hold, and what it does when one is lost.

Bounds: each process holds at most `PoolLimits.size + overflow` connections, and an operation that
waits longer than `timeout_s` for one is treated as a database that does not answer (retried within
the patience, then `database_unavailable`, a 503), never a 500. `fit_pool` sizes a process's pool
so that every configured process together fits the server's `max_connections`.

Faults: an operation that loses its connection is retried with backoff for up to `patience_s` (a
restart of a few seconds is ridden out), then fails with `database_unavailable`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

import psycopg
import sqlalchemy.exc
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from adapters.database import connect_options, libpq_dsn, sqlalchemy_url
from engine.errors import ConfigError, DatabaseUnavailable
from engine.events import load_stored_json

log = logging.getLogger(__name__)

# How long an operation keeps retrying a database that does not answer before it reports
# `database_unavailable`: long enough for a restart of a few seconds.
DEFAULT_PATIENCE_S = float(os.environ.get("ROLLBOOK_DB_PATIENCE_S") or 20.0)
_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class PoolLimits:
    """One process's database connections ([limits] in the config; docs/operations.md, "Bounds, and sizing PostgreSQL").
    The defaults let four servers, two workers each, and a `rollbook run` (9 processes, 90
    connections at most) fit PostgreSQL's default max_connections = 100 with its reserved slots."""

    size: int = 5  # kept open
    overflow: int = 5  # opened under load, closed when returned
    timeout_s: float = 10.0  # waiting for a free connection; past it the wait counts as an outage

    @property
    def most(self) -> int:
        return self.size + self.overflow


def make_engine(dsn: str, pool: PoolLimits | None = None) -> AsyncEngine:
    """The one way a process opens its pool: bounded, and not pinged at checkout. A ping is a round
    trip (and a transaction to the server) per checkout, a third of what a model call cost; a
    connection the server dropped (a restart) is found where it fails instead: the operation raises a
    lost connection, the pool drops every connection opened before (SQLAlchemy does so on a disconnect;
    `drop_pool` where psycopg raised past it) and `with_retry` runs the operation again on a fresh one.
    Last in, first out: a connection prepares and plans each statement for itself, so a process that
    cycled through its whole pool planned each statement once per connection; the most recently used
    one is the one that has it planned (the cost run's plans per model call fell from 5.4 to 4.7)."""
    pool = pool or PoolLimits()
    # No hstore column exists: looking its type up cost each process five statements at its first connection.
    return create_async_engine(sqlalchemy_url(dsn), pool_size=pool.size, max_overflow=pool.overflow,
                               pool_timeout=pool.timeout_s, pool_pre_ping=False, pool_use_lifo=True, json_deserializer=load_stored_json,
                               use_native_hstore=False, connect_args=connect_options(dsn))


@contextlib.asynccontextmanager
async def reading(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """A pooled connection in autocommit, for reads: each statement alone, with no BEGIN before it and
    no ROLLBACK after (a read of one statement sees one snapshot anyway)."""
    async with engine.connect() as conn:
        yield await conn.execution_options(isolation_level="AUTOCOMMIT")


# Connections left free for a person's `psql` and maintenance commands, beyond the superuser slots.
ADMIN_SPARE = 5
# The smallest pool a process works with: one connection for an append in flight, one for a read.
MIN_POOL = 2


def server_connection_limit(dsn: str) -> tuple[int, int]:
    """The server's `max_connections` and the slots ordinary roles cannot take
    (`superuser_reserved_connections`, plus `reserved_connections` from PostgreSQL 16)."""
    with psycopg.connect(libpq_dsn(dsn), autocommit=True, **connect_options(dsn)) as conn:
        row = conn.execute("SELECT current_setting('max_connections')::int, "
                           "current_setting('superuser_reserved_connections')::int, "
                           "coalesce(current_setting('reserved_connections', true)::int, 0)").fetchone()
    assert row is not None
    return int(row[0]), int(row[1]) + int(row[2])


def fit_pool(pool: PoolLimits, processes: int, max_connections: int, reserved: int) -> PoolLimits:
    """The pool each of `processes` processes may hold so that all of them together, the reserved
    slots and ADMIN_SPARE sessions fit the server's `max_connections`: `pool` itself when it fits,
    else shrunk (overflow first). Raises ConfigError when not even MIN_POOL each would fit."""
    share = (max_connections - reserved - ADMIN_SPARE) // max(processes, 1)
    if share >= pool.most:
        return pool
    if share < MIN_POOL:
        need = processes * MIN_POOL + reserved + ADMIN_SPARE
        raise ConfigError(
            f"{processes} processes need at least {need} database connections (max_connections = {max_connections}, "
            f"{reserved} reserved, {ADMIN_SPARE} kept for admin sessions)",
            f"raise max_connections to {processes * pool.most + reserved + ADMIN_SPARE} or more, or lower [limits] processes")
    size = min(pool.size, share)
    return PoolLimits(size=size, overflow=share - size, timeout_s=pool.timeout_s)


async def drop_pool(engine: AsyncEngine) -> None:
    """Forget every pooled connection of `engine` (they are closed as they come back): after one was
    found dead, its siblings opened before the same restart are too, and a retry must not meet them."""
    await engine.dispose(close=False)


class StoreObserver(Protocol):
    """Told of appends and database faults (adapters.telemetry.Telemetry is one): plain calls, made on
    the event loop, that must not block or raise."""

    def appended(self, events: int, seconds: float) -> None: ...
    def append_failed(self, code: str) -> None: ...
    def replanned(self) -> None: ...
    def connection_lost(self, what: str) -> None: ...
    def database_unavailable(self, what: str) -> None: ...


def connection_lost(exc: BaseException) -> bool:
    """Whether `exc` says the database connection failed (retry), not that the statement was wrong."""
    if isinstance(exc, sqlalchemy.exc.TimeoutError):
        return True  # no pooled connection came free in time: nothing ran, so asking again is safe
    if isinstance(exc, sqlalchemy.exc.DBAPIError):
        return bool(exc.connection_invalidated) or isinstance(exc.orig, psycopg.OperationalError | psycopg.InterfaceError)
    return isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError | sqlalchemy.exc.InterfaceError
                      | ConnectionError | TimeoutError) or (isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError))


def retrying(what: str) -> Callable[[Callable[..., Awaitable[_T]]], Callable[..., Awaitable[_T]]]:
    """An operation that is safe to repeat (a read, an upsert), retried across a lost connection."""
    def wrap(fn: Callable[..., Awaitable[_T]]) -> Callable[..., Awaitable[_T]]:
        @functools.wraps(fn)
        async def retried(self: Any, *args: Any, **kw: Any) -> _T:
            return await with_retry(lambda: fn(self, *args, **kw), getattr(self, "patience_s", DEFAULT_PATIENCE_S), what,
                                    getattr(self, "observers", ()))
        return retried
    return wrap


async def with_retry(op: Callable[[], Awaitable[_T]], patience_s: float = DEFAULT_PATIENCE_S, what: str = "a query",
                     observers: Sequence[StoreObserver] = ()) -> _T:
    """Run `op`, again after a lost connection, with backoff, for up to `patience_s` seconds.
    `op` must be safe to repeat (a read, or an append with its idempotency key). `observers` hear of
    each lost connection and of giving up."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + patience_s
    delay = 0.05
    while True:
        try:
            return await op()
        except Exception as exc:
            if not connection_lost(exc):
                raise
            if loop.time() + delay > deadline:
                for o in observers:
                    o.database_unavailable(what)
                raise DatabaseUnavailable(f"the database did not answer {what} for {patience_s:g} s: "
                                          f"{str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}") from None
            for o in observers:
                o.connection_lost(what)
            log.warning("database connection lost during %s; retrying in %.2f s", what, delay)
            await asyncio.sleep(delay)
            delay = min(1.0, delay * 2)

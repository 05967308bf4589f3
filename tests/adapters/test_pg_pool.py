"""Database pools that fit: every configured process together within the server's max_connections."""

from __future__ import annotations

import psycopg
import pytest

from adapters.pg_pool import ADMIN_SPARE, PoolLimits, fit_pool, server_connection_limit
from apps.config import Config
from engine.errors import ConfigError


def config(**limits: object) -> Config:
    servers = {k: {"port": 9000 + i} for i, k in enumerate(("model", "resources", "agent", "environment"))}
    return Config.model_validate({"control_token": "c" * 16, "data_token": "d" * 16, "servers": servers, "limits": limits})


def test_a_pool_that_fits_is_kept_one_that_does_not_shrinks_overflow_first() -> None:
    pool = PoolLimits(size=5, overflow=5, timeout_s=3.0)
    assert fit_pool(pool, processes=9, max_connections=100, reserved=3) == pool  # 9 x 10 <= 92
    shrunk = fit_pool(pool, processes=20, max_connections=100, reserved=3)  # 92 // 20 = 4 each
    assert (shrunk.size, shrunk.overflow, shrunk.timeout_s) == (4, 0, 3.0)
    assert 20 * shrunk.most + 3 + ADMIN_SPARE <= 100
    assert fit_pool(pool, processes=12, max_connections=100, reserved=3) == PoolLimits(5, 2, 3.0)  # 92 // 12 = 7


def test_processes_that_cannot_each_get_two_connections_are_a_config_error_that_names_the_setting() -> None:
    with pytest.raises(ConfigError) as err:
        fit_pool(PoolLimits(), processes=60, max_connections=100, reserved=3)
    assert "max_connections" in err.value.fix and "608" in err.value.fix  # 60 x 10 + 3 + 5


def test_the_process_count_defaults_to_the_configured_servers_and_run_and_a_command() -> None:
    assert config().processes == 6
    assert config(processes=40).processes == 40


def test_a_process_sizes_its_pool_from_the_servers_own_max_connections(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        shown = int(conn.execute("SHOW max_connections").fetchone()[0])  # type: ignore[index]
        reserved = int(conn.execute("SHOW superuser_reserved_connections").fetchone()[0])  # type: ignore[index]
    assert server_connection_limit(dsn)[0] == shown and server_connection_limit(dsn)[1] >= reserved
    crowd = (shown - reserved) // 4  # a crowd of processes: about four connections each
    pool = config(processes=crowd).database_pool(dsn)
    assert pool.most < PoolLimits().most and crowd * pool.most <= shown - server_connection_limit(dsn)[1] - ADMIN_SPARE
    assert config().database_pool(dsn) == PoolLimits()  # six processes of ten fit the default server


async def test_a_pool_hands_out_its_most_recently_used_connection_so_its_statements_stay_planned(dsn: str) -> None:
    """Input: three connections held at once (the pool opens three), then given back, then ten reads
    one after another. A first-in-first-out pool cycles through all three, each planning every
    statement for itself; this one serves the ten on one backend."""
    import asyncio

    from sqlalchemy import text

    from adapters.pg_pool import make_engine

    engine = make_engine(dsn, PoolLimits(size=3, overflow=0))
    try:
        async def hold(release: asyncio.Event) -> int:
            async with engine.connect() as conn:
                pid = int((await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one())
                await release.wait()
                return pid

        release = asyncio.Event()
        held = [asyncio.create_task(hold(release)) for _ in range(3)]
        await asyncio.sleep(0.5)
        release.set()
        assert len(set(await asyncio.gather(*held))) == 3
        pids = []
        for _ in range(10):
            async with engine.connect() as conn:
                pids.append(int((await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()))
        assert len(set(pids)) == 1, pids
    finally:
        await engine.dispose()

from __future__ import annotations

import compileall
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from adapters.memory_store import MemoryEventStore
from adapters.postgres import PostgresEventStore
from adapters.token_store import MemoryTokenStore
from apps.processes import ServerProcesses, spawn_server
from apps.stack import MemoryBacking
from testkit import netns, pg
from testkit.pg import DemoRun
from testkit.zygote import Zygote

ROOT = Path(__file__).resolve().parent.parent
SERVERS = ["primary"] + (["pg15"] if pg.pg15_available() else [])
_started: dict[str, pg.Server] = {}


def _server(name: str) -> pg.Server:
    if name not in _started:
        _started[name] = pg.primary_server() if name == "primary" else pg.pg15_server()
    return _started[name]


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: one worker more than the cores, at most four (each starts its own PostgreSQL servers).
    The extra one runs while the others wait on tokens, processes starting and retries: on 2 cores the
    suite took 473-537 s on two workers (three runs) and 433 s on three."""
    return max(1, min(4, (os.cpu_count() or 1) + 1))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The end-to-end folder holds the longest files: handed out first, they do not end the run alone.
    # A stable sort keeps every other file, and each file's tests, in collection order.
    items.sort(key=lambda item: not item.nodeid.startswith("tests/e2e/"))


def pytest_sessionstart(session: pytest.Session) -> None:
    """Create the unprivileged user the embedded servers run as, once, before the workers start: on
    a fresh machine each worker's first server would run `useradd` at the same moment, and two of
    them both succeeded (uid 1002, then 1003), leaving one worker's data folder owned by a uid that
    no longer exists (initdb: "could not change permissions ... Operation not permitted").
    Then compile the project's modules once, before any server process starts. Where
    PYTHONDONTWRITEBYTECODE is set (this machine kind sets it), no process writes bytecode, so each of
    the hundreds of servers the suite starts would compile them again: 0.45 s of CPU apiece."""
    if hasattr(session.config, "workerinput"):
        return  # a parallel worker: the controller compiled them before it started the workers
    # Whether the partition tests can make hosts of their own; without, they skip with this reason.
    why = netns.unavailable()
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("hosts of their own (network namespaces): " + ("available" if why is None else f"unavailable, {why}"))
    pg.ensure_unprivileged_user()
    for package in ("engine", "participants", "adapters", "apps", "migrations", "testkit", "tests"):
        compileall.compile_dir(ROOT / package, quiet=2)


def pytest_sessionfinish(session: pytest.Session) -> None:
    for server in _started.values():
        server.close()


@pytest.fixture(scope="session", autouse=True)
def forked_servers() -> Iterator[None]:
    """Every set of servers a test starts is forked from this worker's zygote, which has imported
    rollbook once (testkit/zygote.py): each server's start cost its imports, 0.7 s of CPU."""
    zygote = Zygote()
    ServerProcesses.spawn = staticmethod(zygote.spawn)  # type: ignore[method-assign,assignment]
    yield
    ServerProcesses.spawn = staticmethod(spawn_server)  # type: ignore[method-assign,assignment]
    zygote.close()


@pytest.fixture
def dsn() -> str:
    """An isolated, migrated database on the primary server."""
    server = _server("primary")
    url = server.new_database()
    yield url
    server.drop_database(url)


@pytest.fixture(params=SERVERS)
def any_dsn(request: pytest.FixtureRequest) -> str:
    """An isolated, migrated database on every server the fixture can reach (conformance tests)."""
    server = _server(request.param)
    url = server.new_database()
    yield url
    server.drop_database(url)


@pytest.fixture(scope="session")
def demo_run() -> Iterator[DemoRun]:
    """The finished demo, shared: it takes a minute on a loaded machine, and the tests that use it only
    read it (`demo_db` gives a test a copy it may edit)."""
    server = _server("primary")
    url = server.new_database()
    out = subprocess.run([sys.executable, "-m", "apps.cli", "demo", "--dsn", url, "--rollouts", "12", "--json"],
                         capture_output=True, text=True, timeout=240)
    yield DemoRun(url, out.returncode, out.stdout, out.stderr)
    server.drop_database(url)


@pytest.fixture
def demo_db(demo_run: DemoRun) -> Iterator[str]:
    """A copy of the finished demo's database, this test's own to read and edit."""
    assert demo_run.returncode == 0, demo_run.stderr[-2000:]
    server = _server("primary")
    url = server.clone_database(demo_run.dsn)
    yield url
    server.drop_database(url)


@pytest.fixture
async def store(dsn: str) -> PostgresEventStore:
    s = PostgresEventStore.connect(dsn, writer="test")
    yield s
    await s.close()


@pytest.fixture
async def any_store(any_dsn: str) -> PostgresEventStore:
    s = PostgresEventStore.connect(any_dsn, writer="test")
    yield s
    await s.close()


@pytest.fixture
def memory_database() -> MemoryBacking:
    """A fresh log and token store in memory (adapters.memory_store): for tests of rules and servers that
    promise no durability. A module whose tests all qualify names it `database` and its store `store`
    (docs/testing.md lists them); apps.stack.start_stack takes it where it takes a DSN."""
    return MemoryBacking()


@pytest.fixture
def memory_store(memory_database: MemoryBacking) -> MemoryEventStore:
    return memory_database.log.store("test")


@pytest.fixture
def memory_tokens(memory_database: MemoryBacking) -> MemoryTokenStore:
    return memory_database.token_store


@pytest.fixture
def restart_only_live(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sandbox as an environment whose live process nothing keeps (`restart_only`, as a plugin
    may declare itself): the paths that restart such sessions, tested on a real live shell."""
    from participants.environments.sandbox import SandboxEnvironment

    monkeypatch.setattr(SandboxEnvironment, "state_mode", "restart_only")

"""The log contract (tests/log_contract.py) on the memory store, and what it shares with no database."""

from __future__ import annotations

import pytest

from adapters.memory_store import MemoryEventStore, MemoryLog
from engine.log import append_one
from tests.log_contract import LogContract, OpenStore, ev


class TestMemoryLog(LogContract):
    @pytest.fixture
    def open_store(self) -> OpenStore:
        log = MemoryLog()
        return log.store


async def test_stores_on_one_log_share_it_and_stores_on_two_do_not() -> None:
    log = MemoryLog()
    a, b, elsewhere = log.store("a"), log.store("b"), MemoryEventStore(writer="c")
    await append_one(a, ev("s", n=1))
    await append_one(b, ev("s", n=2))
    assert [(e.writer, e.stream_version) for e in await elsewhere.read_all()] == []
    assert [(e.writer, e.stream_version) for e in await a.read_all()] == [("a", 1), ("b", 2)]

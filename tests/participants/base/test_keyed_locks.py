"""participants/base/keyed_locks.py: one lock per key, kept only while someone holds or awaits it."""

from __future__ import annotations

import asyncio

from participants.base.keyed_locks import KeyedLocks


async def test_one_holder_per_key_at_a_time_and_the_entry_goes_with_its_last_user() -> None:
    locks: KeyedLocks[str] = KeyedLocks()
    order: list[str] = []
    release = asyncio.Event()

    async def hold(name: str, key: str, wait: bool) -> None:
        async with locks(key):
            order.append(f"{name} in")
            if wait:
                await release.wait()
            order.append(f"{name} out")

    first = asyncio.create_task(hold("a", "r1", True))
    await asyncio.sleep(0)
    second = asyncio.create_task(hold("b", "r1", False))
    other = asyncio.create_task(hold("c", "r2", False))
    await asyncio.sleep(0.01)
    assert order == ["a in", "c in", "c out"]  # b waits for a; another key does not
    assert "r1" in locks and "r2" not in locks
    release.set()
    await asyncio.gather(first, second, other)
    assert order[3:] == ["a out", "b in", "b out"]
    assert list(locks) == []  # nothing held, nothing awaited: nothing kept


async def test_a_holder_that_fails_or_is_cancelled_leaves_no_entry() -> None:
    locks: KeyedLocks[tuple[str, int]] = KeyedLocks()

    async def fails() -> None:
        async with locks(("r", 0)):
            raise ValueError("a decision that failed")

    try:
        await fails()
    except ValueError:
        pass
    waiting = asyncio.Event()

    async def waits() -> None:
        async with locks(("r", 1)):
            await waiting.wait()

    task = asyncio.create_task(waits())
    await asyncio.sleep(0)
    assert ("r", 1) in locks
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert list(locks) == []

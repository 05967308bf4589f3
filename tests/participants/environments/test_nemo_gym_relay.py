"""participants.environments.nemo_gym_relay's server process as a session's open and verify ask it: where
it is and whether it speaks gymnasium, answered at once while it runs and was asked before, and from a
thread (which starts it, or asks it) otherwise."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from participants.environments import nemo_gym_relay
from participants.environments.nemo_gym_relay import GymProcess, GymServer


@pytest.fixture
def threads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What the relay ran in a thread, by name: asyncio.to_thread, counted."""
    ran: list[str] = []
    real = asyncio.to_thread

    async def counted(fn: Callable[..., Any], *args: Any) -> Any:
        ran.append(getattr(fn, "__name__", repr(fn)))
        return await real(fn, *args)

    monkeypatch.setattr(nemo_gym_relay.asyncio, "to_thread", counted)
    return ran


@pytest.fixture
def running() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


async def test_a_running_server_asked_before_is_answered_without_a_thread(
        running: subprocess.Popen[bytes], threads: list[str]) -> None:
    """Input: the process rollbook started, running, whose served paths were read (a seedable server):
    answered where it listens, not gymnasium, with nothing run in a thread."""
    p = GymProcess(GymServer("gym_x", "resources_servers.x.app", port=4321))
    p.proc, p._paths = running, (running.pid, frozenset({"/seed_session", "/step"}))
    assert await p.served() == ("http://127.0.0.1:4321", False)
    p._paths = (running.pid, frozenset({"/step"}))  # a gymnasium server: steps, no session to seed
    assert await p.served() == ("http://127.0.0.1:4321", True)
    assert threads == []


async def test_a_server_that_exited_or_was_never_asked_is_asked_in_a_thread(
        running: subprocess.Popen[bytes], threads: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Input: the same process before its paths were read, then after it exited (paths still held for
    its pid): both go to the thread that starts it and asks it (base_url, gymnasium; stood in for here)."""
    p = GymProcess(GymServer("gym_x", "resources_servers.x.app", port=4321))
    monkeypatch.setattr(p, "base_url", lambda: "http://127.0.0.1:4321")
    monkeypatch.setattr(p, "gymnasium", lambda: False)
    p.proc = running
    assert await p.served() == ("http://127.0.0.1:4321", False)
    p._paths = (running.pid, frozenset({"/seed_session"}))
    running.kill()
    running.wait()
    assert await p.served() == ("http://127.0.0.1:4321", False)
    assert len(threads) == 2, threads


async def test_an_operators_server_asked_before_is_answered_without_a_thread(threads: list[str]) -> None:
    """Input: a server the operator runs (`url`), its paths read before: its own address, no thread."""
    p = GymProcess(GymServer("gym_x", "resources_servers.x.app", url="http://gym.example:9000/"))
    p._paths = (None, frozenset({"/seed_session"}))
    assert await p.served() == ("http://gym.example:9000", False)
    assert threads == []

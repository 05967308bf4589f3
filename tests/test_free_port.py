"""`free_port` never hands one port to two rollbook processes, whatever the kernel answers.

The kernel's bind(0) may return the same free port to two processes that ask before either binds it
(two demos on one machine, the suite's parallel workers); the stand-in socket below answers with a
chosen sequence of ports to play exactly that."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from apps import processes


class KernelAnswers:
    """socket.socket whose bind(0) gives the next port of a fixed sequence."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = iter(ports)

    def __call__(self) -> KernelAnswers:
        self.port = next(self.ports)
        return self

    def __enter__(self) -> KernelAnswers:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def bind(self, address: tuple[str, int]) -> None:
        assert address == ("127.0.0.1", 0)

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)


@pytest.fixture
def marks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(processes, "PORT_MARKS", tmp_path / "ports")
    return tmp_path / "ports"


def test_a_port_the_kernel_offers_twice_is_handed_out_once(marks: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(processes.socket, "socket", KernelAnswers([41001, 41001, 41003]))
    assert [processes.free_port(), processes.free_port()] == [41001, 41003]


def test_a_mark_older_than_the_holding_time_is_forgotten(marks: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(processes.socket, "socket", KernelAnswers([41005, 41005, 41007, 41005]))
    assert processes.free_port() == 41005
    old = (marks / "41005").stat().st_mtime - processes.PORT_HELD_S - 1
    os.utime(marks / "41005", (old, old))
    # 41005 is refused once (its stale mark is swept then), 41007 is handed out, then 41005 is free again
    assert [processes.free_port(), processes.free_port()] == [41007, 41005]

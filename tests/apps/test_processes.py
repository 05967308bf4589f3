"""`free_port` never hands one port to two rollbook processes, and never one a client may take.

Two processes may draw the same free port before either binds it (two demos on one machine, the
suite's parallel workers); the draws below are a chosen sequence of ports to play exactly that, and
the stand-in socket binds whatever it is asked (or refuses the ports something holds)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from apps import processes


class Sockets:
    """socket.socket whose bind succeeds unless the port is in `held` (something is bound there)."""

    def __init__(self, held: frozenset[int] = frozenset()) -> None:
        self.held = held

    def __call__(self) -> Sockets:
        return self

    def __enter__(self) -> Sockets:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def bind(self, address: tuple[str, int]) -> None:
        if address[1] in self.held:
            raise OSError(98, "Address already in use")


def draws(monkeypatch: pytest.MonkeyPatch, ports: list[int], held: frozenset[int] = frozenset()) -> None:
    sequence = iter(ports)
    monkeypatch.setattr(processes, "_candidate", lambda low, high: next(sequence))
    monkeypatch.setattr(processes.socket, "socket", Sockets(held))


@pytest.fixture
def marks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(processes, "PORT_MARKS", tmp_path / "ports")
    return tmp_path / "ports"


def test_a_port_the_kernel_offers_twice_is_handed_out_once(marks: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    draws(monkeypatch, [21001, 21001, 21003])
    assert [processes.free_port(), processes.free_port()] == [21001, 21003]


def test_a_mark_older_than_the_holding_time_is_forgotten(marks: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    draws(monkeypatch, [21005, 21005, 21007, 21005])
    assert processes.free_port() == 21005
    old = (marks / "21005").stat().st_mtime - processes.PORT_HELD_S - 1
    os.utime(marks / "21005", (old, old))
    # 21005 is refused once (its stale mark is swept then), 21007 is handed out, then 21005 is free again
    assert [processes.free_port(), processes.free_port()] == [21007, 21005]


def test_a_port_something_is_bound_to_is_passed_over(marks: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    draws(monkeypatch, [21009, 21011], held=frozenset({21009}))
    assert processes.free_port() == 21011


def test_ports_come_from_outside_the_kernels_ephemeral_range(marks: Path) -> None:
    """A client's source port comes from the ephemeral range: a port handed out there could be taken
    by some outgoing connection before the server binds it (a server then failed with "already in
    use" in the suite)."""
    first, last = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = [processes.free_port() for _ in range(20)]
    assert all(not first <= p <= last and p >= 1024 for p in ports), (first, last, ports)

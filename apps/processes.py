"""The four servers as real processes, each in its own process group, so a crash is a real SIGKILL."""

from __future__ import annotations

import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Protocol

from adapters.http_client import CONTROL
from apps.config import KINDS, Config


def instance_id(kind: str) -> str:
    # Unique across hosts and restarts: a pid is reused, the random part is not.
    return f"{kind}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"

PORT_MARKS = Path(tempfile.gettempdir()) / f"rollbook-ports-{os.getuid()}"
PORT_HELD_S = 600.0  # far longer than any server takes to bind the port it was handed


def free_port() -> int:
    """A port on 127.0.0.1 that nothing is bound to and that no rollbook process on this machine was
    handed in the last ten minutes, outside the kernel's ephemeral range.

    Outside that range because the kernel takes an outgoing connection's source port from it: a port
    found free there (bind(0) answers from it) could become some client's source port before the
    server binds it, and the server then failed with "already in use" (seen once in about a dozen
    runs of the suite). Two processes may still draw one free port before either binds it (two demos
    at once, the parallel test workers); a mark file, created exclusively, settles which one gets it."""
    PORT_MARKS.mkdir(exist_ok=True)
    low, high = listening_range()
    while True:
        port = _candidate(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # something holds it
        mark = PORT_MARKS / str(port)
        try:
            os.close(os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return port
        except FileExistsError:
            _forget_stale_marks()


def listening_range() -> tuple[int, int]:
    """[low, high) of ports to hand to servers: below the kernel's ephemeral range where there is room
    (Linux's default range is 32768-60999), else above it, else any unprivileged port."""
    try:
        first, last = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        first, last = 32768, 60999
    if first - 10_000 >= 2_000:
        return 10_000, first
    if 65_536 - (last + 1) >= 2_000:
        return last + 1, 65_536
    return 1_024, 65_536


def _candidate(low: int, high: int) -> int:
    return random.randrange(low, high)


def _forget_stale_marks() -> None:
    now = time.time()
    for mark in PORT_MARKS.iterdir():
        try:
            if now - mark.stat().st_mtime > PORT_HELD_S:
                mark.unlink()
        except FileNotFoundError:
            pass  # another process forgot it first


class Process(Protocol):
    """What a set of servers needs of a process it started (`subprocess.Popen` is one)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...


def spawn_server(argv: list[str], log: Path, env: dict[str, str]) -> Process:
    """A server process: its own session (so a SIGKILL of its group ends everything it started),
    stdout and stderr appended to `log`."""
    with open(log, "ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)


@dataclass
class ServerProcesses:
    config: Config
    config_path: Path
    log_dir: Path
    procs: dict[str, Process] = field(default_factory=dict)
    generation: int = 0
    name: str = ""  # prefixes its log files: several sets of servers may log into one folder
    launch: tuple[str, ...] = ()  # before each command: `ip netns exec NS` runs the set on a host of its own
    # How a server is started where no `launch` is given; the suite's harness forks them from a
    # process that has already imported rollbook (testkit/zygote.py).
    spawn: ClassVar[Callable[[list[str], Path, dict[str, str]], Process]] = staticmethod(spawn_server)

    def log(self, kind: str) -> Path:
        return self.log_dir / f"{self.name}{kind}-{self.generation}.log"

    def start(self, timeout: float = 60.0, kinds: tuple[str, ...] = KINDS) -> None:
        """Start fresh processes of the given kinds (default all four) and wait until each control plane answers."""
        self.generation += 1
        for kind in kinds:
            argv = [*self.launch, sys.executable, "-m", "apps.cli", "serve", kind, "--config", str(self.config_path)]
            self.log(kind).write_bytes(b"")
            self.procs[kind] = (self.spawn if not self.launch else spawn_server)(
                argv, self.log(kind), {**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.time() + timeout
        for kind in kinds:
            while not self._answers(kind):
                if self.procs[kind].poll() is not None:
                    tail = self.log(kind).read_text()[-2000:]
                    raise RuntimeError(f"the {kind} server exited with {self.procs[kind].returncode}:\n{tail}")
                if time.time() > deadline:
                    raise RuntimeError(f"the {kind} server did not answer within {timeout} s")
                time.sleep(0.1)

    def _answers(self, kind: str) -> bool:
        req = urllib.request.Request(self.config.url(kind) + f"{CONTROL}/status",  # type: ignore[arg-type]
                                     headers={"Authorization": f"Bearer {self.config.control_token}"})
        try:
            with urllib.request.urlopen(req, timeout=1) as resp:
                body = json.loads(resp.read())
                # Recorded in the log too: a checkpoint started from now on drives it (participants/base/instances.py).
                return bool(body["kind"] == kind and body.get("joined", True))
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def kill(self, kinds: tuple[str, ...] = KINDS) -> None:
        """SIGKILL each server's whole process group: no handler runs, nothing is flushed."""
        for kind in kinds:
            proc = self.procs.get(kind)
            if proc is None:
                continue
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    continue
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def worker_pids(front_pid: int) -> list[int]:
    """The worker processes a front started, oldest first (their parent is the front, and they were
    started as its workers: a server's other children, a sandbox's jail among them, are not)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == front_pid and b"--worker-of" in argv:
                out.append(int(entry.name))
    return sorted(out)


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, theirs, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "(comm)", which may hold spaces
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def reap_on_signal() -> None:
    """Make every process this one starts end with it on SIGTERM or SIGINT, however deep, even where
    it left its parent's process group (each server has a group of its own) or lost its parent: this
    process becomes their reaper (PR_SET_CHILD_SUBREAPER), and the signal SIGKILLs all it finds below."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER

    def end(signum: int, _frame: object) -> None:
        for pid in descendants(os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, end)
    signal.signal(signal.SIGINT, end)

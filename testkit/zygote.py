"""`python -m apps.cli ...` processes forked from one that has already imported rollbook.

The suite starts hundreds of rollbook servers, and each spent 0.7 to 1.0 s of CPU before it served
anything, most of it importing (SQLAlchemy, psycopg, aiohttp and rollbook itself): starting processes
was close to half of the suite's CPU (docs/testing.md). A zygote imports all of that once, per pytest worker,
and forks a child per request. The child is what `subprocess.Popen` would have made: a process of
its own, leader of a session of its own (so `os.killpg(pid, SIGKILL)` is a real crash of everything it
starts), stdout and stderr to its log, the caller's working directory and environment, `apps.cli`
run as `__main__`. Only its imports are shared, so a request is forked only when nothing an import
reads differs: the same interpreter, `-m apps.cli`, and the zygote's own environment (a test that sets
a variable gets a fresh interpreter, as before).

The zygote is the child's parent, so it reaps it; `Forked` asks it for the exit status, with
`Popen`'s meaning (negative: killed by that signal).
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import IO, Any

from apps.processes import Process, spawn_server

ROOT = Path(__file__).resolve().parent.parent
# What `rollbook serve` of each kind and `rollbook run` import, some only once they know their kind.
PRELOAD = ("apps.cli", "apps.serve", "apps.workers", "apps.run", "adapters.token_store", "participants.model.app",
           "participants.model.backends", "participants.resources.app", "participants.agent.app",
           "participants.environment.app")
# Set in a pytest worker while it runs: by pytest for each test, and by gymnasium's import (to quiet
# pygame, which no server imports). No module a server imports reads them while importing.
PER_TEST = frozenset({"PYTEST_CURRENT_TEST", "PYGAME_HIDE_SUPPORT_PROMPT"})
COMMAND = ("-m", "apps.cli")


# ---- the zygote ------------------------------------------------------------------------------------


def main() -> None:
    # Replies go on a copy of stdout; anything an import prints goes to stderr, not into a reply.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for name in PRELOAD:
        importlib.import_module(name)
    # Out of the collector's sight: a child's collections would otherwise walk (and so copy, page by
    # page) every object the zygote imported.
    gc.collect()
    gc.freeze()
    if threading.active_count() != 1:  # a thread does not survive a fork, and what it held stays held
        raise RuntimeError(f"the zygote runs {threading.active_count()} threads after importing")
    exited: dict[int, int] = {}

    def reap(*_: Any) -> None:
        # Reaped at once, so a killed child is not left a zombie that a liveness check takes for alive.
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            exited[pid] = os.waitstatus_to_exitcode(status)

    signal.signal(signal.SIGCHLD, reap)
    requests = sys.stdin
    replies.write("ready\n")
    replies.flush()
    for line in requests:
        req = json.loads(line)
        if req["op"] == "spawn":
            # SIGCHLD held until a reused pid's old status is forgotten, or the new child's could be.
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
            pid = _fork(req["argv"], req["log"], req["cwd"], req["env"])
            exited.pop(pid, None)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
            reply: dict[str, Any] = {"pid": pid}
        else:
            reap()
            reply = {"rc": exited.get(req["pid"])}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def _fork(argv: list[str], log: str, cwd: str, env: dict[str, str]) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.closerange(3, 1024)  # the zygote's replies pipe and anything else: a fresh process holds none
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115  (PYTHONUNBUFFERED: line by line)
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = [str(ROOT / "apps" / "cli.py"), *argv[3:]]
        # Run as `__main__` from its source, as `-m` does; the preloaded module only saved its imports.
        sys.modules.pop("apps.cli", None)
        try:
            runpy.run_module("apps.cli", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = _exit_code(exc.code)
        threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter does at exit: join its threads
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001  (a child must never return into the zygote's loop)
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
    raise AssertionError("unreachable")


def _exit_code(code: object) -> int:
    """What the interpreter makes of `sys.exit(code)`."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


# ---- the client, in a pytest worker ----------------------------------------------------------------


class Forked:
    """The part of `subprocess.Popen` the suite uses, for a child of the zygote."""

    def __init__(self, zygote: Zygote, pid: int, argv: list[str]) -> None:
        self.zygote, self.pid, self.args = zygote, pid, argv
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """One pytest worker's zygote, started at its first request; `spawn` falls back to `Popen`."""

    def __init__(self) -> None:
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.lock = threading.Lock()
        self.proc: subprocess.Popen[str] | None = None
        self.failed = False  # once the zygote failed, every later command is started afresh

    def spawn(self, argv: list[str], log: Path, env: dict[str, str]) -> Process:
        if (self.failed or tuple(argv[:3]) != (sys.executable, *COMMAND)
                or _without(env, PER_TEST) != _without(self.env, PER_TEST)):
            return spawn_server(argv, log, env)
        with self.lock:
            try:
                pid = int(self._ask({"op": "spawn", "argv": argv, "log": str(log), "cwd": os.getcwd(), "env": env})["pid"])
            except (OSError, ValueError, KeyError):  # the zygote died: the suite goes on without it
                self.failed = True
                self.close()
                return spawn_server(argv, log, env)
        return Forked(self, pid, argv)

    def exit_code(self, pid: int) -> int | None:
        with self.lock:
            if self.proc is None:  # its children went to init, which reaped them
                raise OSError(f"the zygote that forked process {pid} is gone, and its exit status with it")
            rc = self._ask({"op": "status", "pid": pid})["rc"]
        return None if rc is None else int(rc)

    def _ask(self, req: dict[str, Any]) -> dict[str, Any]:
        if self.proc is None:
            self.proc = subprocess.Popen([sys.executable, "-m", "testkit.zygote"], cwd=ROOT, env=self.env, text=True,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            if _line(self.proc.stdout) != "ready":
                raise OSError("the zygote did not start")
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        reply: dict[str, Any] = json.loads(_line(self.proc.stdout))
        return reply

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def _line(stream: IO[str] | None) -> str:
    assert stream is not None
    line = stream.readline()
    if not line:
        raise OSError("the zygote exited")
    return line.strip()


def _without(env: dict[str, str], keys: frozenset[str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in keys}


if __name__ == "__main__":
    main()

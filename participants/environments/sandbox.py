"""A live POSIX shell per session.

The shell's memory (variables, cwd, background jobs) lives in a process, not
in JSON, so this environment cannot be rebuilt from the event log: a crashed
session restarts from scratch. It says so through ``state_mode`` and by
refusing ``apply``; the engine talks to it through the ``*_live`` methods.

It runs whatever command a model (or whoever holds the data credential) sends, so it is off
unless the configuration gives it `SandboxLimits`, and then each shell starts through a small
jail (`_JAIL`, run by the server, which must be root for it): a new network namespace with no
interface but a down loopback (unshare(CLONE_NEWNET)), resource limits (RLIMIT_CPU, RLIMIT_AS,
RLIMIT_NPROC, RLIMIT_FSIZE, no core files), supplementary groups dropped, then the uid and gid of
an unprivileged user (default `nobody`), a private working directory and an environment of PATH,
HOME and LC_ALL only. The shell is exec'ed only after every step succeeded and said so; any
failure ends the session before a command runs. The server adds a wall-clock timeout per command
(the session ends when one passes it) and keeps at most `output_bytes` of each command's output.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import random
import re
import secrets
import select
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import ClassVar

from . import players
from .base import (
    JSON,
    Environment,
    StateMode,
    Task,
    ToolError,
    ToolOutcome,
    Trajectory,
    Verification,
    function_tool,
    read_args,
)
from .math_env import last_number

SHELL = "/bin/sh"
READY = b"rollbook-sandbox-ready\n"
FAILED = b"rollbook-sandbox-failed"
CLONE_NEWNET = 0x40000000
# Run by a fresh interpreter (-I -S: no site, no user paths) as root, it jails itself and becomes the shell.
_JAIL = """
import ctypes, json, os, resource, sys
a = json.loads(sys.argv[1])
try:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(a["clone_newnet"]) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET) failed")
    for name, soft, hard in a["limits"]:
        resource.setrlimit(getattr(resource, name), (soft, hard))
    os.setgroups([])
    os.setgid(a["gid"])
    os.setuid(a["uid"])
    if os.getuid() != a["uid"] or os.geteuid() != a["uid"] or os.getgid() != a["gid"]:
        raise OSError("the user did not change")
    os.chdir(a["cwd"])
except Exception as exc:
    sys.stdout.write("rollbook-sandbox-failed %s\\n" % (exc,))
    sys.stdout.flush()
    os._exit(126)
sys.stdout.write("rollbook-sandbox-ready\\n")
sys.stdout.flush()
os.execve(a["shell"], [a["shell"]], a["env"])
"""
WORDS = ["alpha", "bravo", "cedar", "delta", "ember", "fjord", "gamma", "harbor", "indigo", "juniper"]
_HEX64 = re.compile(r"\b[0-9a-f]{64}\b")


@dataclass(frozen=True)
class SandboxLimits:
    """What a sandbox shell may use; given by the configuration's [sandbox] table."""

    user: str = "nobody"
    cpu_s: int = 10  # CPU seconds per process (RLIMIT_CPU; SIGXCPU, then SIGKILL a second later)
    memory_mb: int = 512  # address space per process (RLIMIT_AS)
    max_processes: int = 64  # processes of the sandbox user (RLIMIT_NPROC)
    file_mb: int = 64  # largest file a command may write (RLIMIT_FSIZE)
    output_bytes: int = 8_000  # output kept per command; the rest is counted and dropped
    timeout_s: float = 10.0  # wall clock per command; past it the session ends

    def rlimits(self) -> list[tuple[str, int, int]]:
        mb = 1024 * 1024
        return [("RLIMIT_CPU", self.cpu_s, self.cpu_s + 1), ("RLIMIT_AS", self.memory_mb * mb, self.memory_mb * mb),
                ("RLIMIT_NPROC", self.max_processes, self.max_processes), ("RLIMIT_FSIZE", self.file_mb * mb, self.file_mb * mb),
                ("RLIMIT_CORE", 0, 0)]


@dataclass(frozen=True)
class LiveShell:
    process: subprocess.Popen
    workdir: str
    task_id: str


def make_task(seed: int) -> Task:
    rng = random.Random(f"sandbox:{seed}")
    text = " ".join(rng.sample(WORDS, rng.randint(1, 3)))
    kind = rng.choice(["sha256", "sha256", "bytes"])
    if kind == "sha256":
        prompt = (f"Using the shell, compute the SHA-256 hex digest of the string '{text}' "
                  "(no trailing newline) and report it.")
    else:
        prompt = f"Using the shell, count the bytes in the string '{text}' (no trailing newline) and report the number."
    return Task(env="sandbox", task_id="", prompt=prompt, params={"seed": seed, "kind": kind, "text": text})


class SandboxEnvironment(Environment):
    name: ClassVar[str] = "sandbox"
    make_task = staticmethod(make_task)
    scripted = players.SANDBOX
    state_mode: ClassVar[StateMode] = "restart_only"
    verification: ClassVar[Verification] = "wait"

    def __init__(self, limits: SandboxLimits | None = None) -> None:
        self.limits = limits  # None: off; a session cannot be opened
        self.timeout_s = limits.timeout_s if limits is not None else 10.0

    def tools(self) -> list[dict]:
        return [function_tool("run", "Run a command in a persistent POSIX shell; returns its output and exit code.",
                              {"command": {"type": "string"}}, ["command"])]

    def initial_state(self, task: Task) -> JSON:
        # Only a descriptor: the real state is the live process.
        return {"shell": SHELL, "task_id": task.task_id, "rebuildable": False}

    def call_tool(self, state: JSON, name: str, arguments: dict) -> ToolOutcome:
        self._check(name, arguments)
        raise ToolError("restart_only", "sandbox tools run against a live session; use call_live()")

    def apply(self, state: JSON, effect: JSON) -> JSON:
        raise ToolError("restart_only", "a live shell cannot be rebuilt from events; restart the session")

    def verify(self, task: Task, state: JSON, trajectory: Trajectory) -> float:
        final_answer = trajectory.final_answer
        text = task.params["text"]
        if task.params["kind"] == "sha256":
            found = _HEX64.findall((final_answer or "").lower())
            ok = bool(found) and found[-1] == hashlib.sha256(text.encode()).hexdigest()
        else:
            ok = last_number(final_answer) == float(len(text.encode()))
        return 1.0 if ok else 0.0

    # -- live session -------------------------------------------------------------

    def open_live(self, task: Task) -> LiveShell:
        limits = self.limits
        if limits is None:
            raise ToolError("sandbox_disabled", "the sandbox environment is off in this configuration")
        try:
            user = pwd.getpwnam(limits.user)
        except KeyError:
            raise ToolError("sandbox_unavailable", f"no user named {limits.user!r} for the sandbox") from None
        if user.pw_uid == 0:
            raise ToolError("sandbox_unavailable", "the sandbox user must not be root")
        if os.geteuid() != 0:
            raise ToolError("sandbox_unavailable", "the sandbox needs a server started as root, to drop to its user")
        workdir = tempfile.mkdtemp(prefix="rollbook-sandbox-")
        os.chown(workdir, user.pw_uid, user.pw_gid)
        args = {"clone_newnet": CLONE_NEWNET, "limits": limits.rlimits(), "uid": user.pw_uid, "gid": user.pw_gid,
                "cwd": workdir, "shell": SHELL,
                "env": {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": workdir, "LC_ALL": "C"}}
        process = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _JAIL, json.dumps(args)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, cwd="/", env={}, start_new_session=True,
        )
        handle = LiveShell(process=process, workdir=workdir, task_id=task.task_id)
        said = self._read_line(handle, deadline=time.monotonic() + 10.0)
        if said != READY:
            self.close_live(handle)
            why = said.removeprefix(FAILED).strip().decode(errors="replace") or "the jail exited"
            raise ToolError("sandbox_unavailable", f"the sandbox could not start: {why}")
        return handle

    @staticmethod
    def _read_line(handle: LiveShell, deadline: float) -> bytes:
        """The jail's one line, read byte by byte so nothing of the shell's later output is taken."""
        assert handle.process.stdout is not None
        fd, line = handle.process.stdout.fileno(), b""
        while not line.endswith(b"\n") and len(line) < 4096:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            byte = os.read(fd, 1)
            if not byte:
                break
            line += byte
        return line

    def call_live(self, handle: LiveShell, name: str, arguments: dict) -> ToolOutcome:
        command = self._check(name, arguments)
        if handle.process.poll() is not None:
            raise ToolError("session_lost", f"the shell exited with status {handle.process.returncode}")
        # A non-interactive sh exits on a syntax error, which would end the session; check first.
        check = subprocess.run([SHELL, "-n", "-c", command], capture_output=True, text=True, timeout=self.timeout_s)
        if check.returncode != 0:
            return self._outcome(command, (check.stdout + check.stderr).strip(), check.returncode)
        marker = f"__rollbook_{secrets.token_hex(8)}__"
        # stdin from /dev/null: otherwise a command like `cat` would swallow the marker line.
        script = f"{{ {command}\n}} </dev/null 2>&1\nprintf '\\n{marker} %s\\n' \"$?\"\n"
        assert handle.process.stdin is not None
        handle.process.stdin.write(script.encode())
        handle.process.stdin.flush()
        output, code, dropped = self._read_until(handle, marker)
        return self._outcome(command, output, code, dropped)

    def close_live(self, handle: LiveShell) -> None:
        process = handle.process
        if process.poll() is None:
            try:
                os.killpg(process.pid, 15)
            except ProcessLookupError:
                pass
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, 9)
                process.wait()
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                stream.close()
        shutil.rmtree(handle.workdir, ignore_errors=True)

    # -- helpers -----------------------------------------------------------------

    @staticmethod
    def _check(name: str, arguments: dict) -> str:
        if name != "run":
            raise ToolError("unknown_tool", f"no tool named {name!r}")
        command = read_args(arguments, {"command": ("str", True)})["command"]
        if not command.strip():
            raise ToolError("bad_arguments", "command must not be empty")
        return command

    def _read_until(self, handle: LiveShell, marker: str) -> tuple[str, int, int]:
        """The command's output (at most `output_bytes` of it), its exit code and how many bytes were dropped.

        Memory stays bounded however much a command prints: past the cap only a short tail is kept,
        long enough to find the end marker in."""
        assert handle.process.stdout is not None
        fd = handle.process.stdout.fileno()
        needle = f"\n{marker} ".encode()
        cap = self.limits.output_bytes if self.limits is not None else 8_000
        kept, dropped, buf = bytearray(), 0, b""
        window = len(needle) + 32
        deadline = time.monotonic() + self.timeout_s
        while True:
            at = buf.find(needle)
            if at >= 0 and buf.find(b"\n", at + len(needle)) >= 0:
                code = int(buf[at + len(needle):].split(b"\n", 1)[0])
                room = max(0, cap - len(kept))
                kept += buf[:at][:room]
                dropped += max(0, at - room)
                return kept.decode(errors="replace"), code, dropped
            if at < 0 and len(buf) > window:
                flush, buf = buf[:-window], buf[-window:]
                room = max(0, cap - len(kept))
                kept += flush[:room]
                dropped += max(0, len(flush) - room)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                # The shell is stuck mid-command; its state is unknown, so the session ends here.
                self.close_live(handle)
                raise ToolError("timeout", f"command did not finish within {self.timeout_s}s; session closed")
            ready, _, _ = select.select([fd], [], [], remaining)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise ToolError("session_lost", "the shell exited")
                buf += chunk

    @staticmethod
    def _outcome(command: str, output: str, code: int, dropped: int = 0) -> ToolOutcome:
        if dropped:
            output += f"\n[output truncated: {dropped} more bytes]"
        # Not read-only: the live shell changed. The effect is a record for the log; apply() refuses it.
        return ToolOutcome(output={"output": output, "exit_code": code},
                           effect={"command": command, "exit_code": code})

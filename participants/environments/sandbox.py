"""A live POSIX shell per session.

The shell's memory (variables, cwd, background jobs) lives in a process, not
in JSON, so this environment cannot be rebuilt from the event log: a crashed
session restarts from scratch. It says so through ``state_mode`` and by
refusing ``apply``; the engine talks to it through the ``*_live`` methods.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import secrets
import select
import shutil
import subprocess
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
MAX_OUTPUT = 8_000
WORDS = ["alpha", "bravo", "cedar", "delta", "ember", "fjord", "gamma", "harbor", "indigo", "juniper"]
_HEX64 = re.compile(r"\b[0-9a-f]{64}\b")


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

    def __init__(self, timeout_s: float = 10.0) -> None:
        self.timeout_s = timeout_s

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
        workdir = tempfile.mkdtemp(prefix="rollbook-sandbox-")
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": workdir, "LC_ALL": "C"}
        process = subprocess.Popen(
            [SHELL], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            cwd=workdir, env=env, start_new_session=True,
        )
        return LiveShell(process=process, workdir=workdir, task_id=task.task_id)

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
        output, code = self._read_until(handle, marker)
        return self._outcome(command, output, code)

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

    def _read_until(self, handle: LiveShell, marker: str) -> tuple[str, int]:
        assert handle.process.stdout is not None
        fd = handle.process.stdout.fileno()
        needle = f"\n{marker} ".encode()
        buf = b""
        deadline = time.monotonic() + self.timeout_s
        while True:
            at = buf.find(needle)
            if at >= 0 and buf.find(b"\n", at + len(needle)) >= 0:
                code = int(buf[at + len(needle):].split(b"\n", 1)[0])
                return buf[:at].decode(errors="replace"), code
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
    def _outcome(command: str, output: str, code: int) -> ToolOutcome:
        if len(output) > MAX_OUTPUT:
            output = output[:MAX_OUTPUT] + "\n[output truncated]"
        # Not read-only: the live shell changed. The effect is a record for the log; apply() refuses it.
        return ToolOutcome(output={"output": output, "exit_code": code},
                           effect={"command": command, "exit_code": code})

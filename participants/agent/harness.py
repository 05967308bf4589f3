"""A third-party agent harness, unchanged, run inside a sandbox session (`[harness.<name>]`).

Each activation of a task that names the harness gets a jail of its own
(participants/environments/sandbox.py: its own uid, namespaces, root, cgroups and limits), with the
harness's install bound read-only into it. Its command runs there, with the task's prompt, told one
model address: `http://127.0.0.1:<port>/v1` on the jail's own loopback, where the egress relay
(participants/agent/egress.py) takes it to this activation's model route and nowhere else. The
harness's own commands and code run in the jail with it. Its output's last match of `answer` (else
its last line) is the activation's final answer; the jail ends with the activation.

It says nothing to rollbook and keeps no state outside its jail, so it continues as NeMo Gym's
agents do (participants/agent/external.py): declared `replay`, a harness cut off by a crash runs
again from its start under a new attempt, its model calls answered from the log while they match.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import aiohttp

from adapters.http_client import PeerTimeouts
from engine.errors import ParticipantUnavailable
from engine.identity import Key
from participants.agent.egress import Relay
from participants.agent.external import DriveFailed
from participants.agent.session import RunRequest
from participants.base.participant import Participant
from participants.base.wire import capture_id
from participants.environments.base import Task, ToolError
from participants.environments.sandbox import HOME, SandboxEnvironment, SandboxLimits

LOG = ".harness.log"  # in the session's home: the whole output, of which the tail comes back
TAIL_BYTES = 16_000
SHOWN = 1000


@dataclass(frozen=True)
class Harness:
    """One `[harness.<name>]` table. In `command` and `env`, `{prompt}` is the task's prompt,
    `{base_url}` the relay's OpenAI base URL, `{model}` the model name and `{python}` the interpreter
    the `requirements` were installed for (this server's own, bound into the jail)."""

    command: tuple[str, ...]
    limits: SandboxLimits
    continuation: Literal["replay", "restart_only"] = "restart_only"
    requirements: tuple[str, ...] = ()
    paths: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    answer: str | None = None  # a regex; its last match's first group (or whole match) is the answer
    install_root: str = str(Path.home() / ".cache" / "rollbook")


def interpreter() -> tuple[str, str]:
    """This server's Python outside any virtual environment, and the folder it lives in."""
    exe = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    return str(exe), sys.base_prefix


def install(requirements: tuple[str, ...], root: str, say: Callable[[str], None] | None = None) -> str:
    """The folder holding `requirements`, installed for this server's Python once (pip --target)."""
    digest = hashlib.sha256("\n".join([sys.version, *requirements]).encode()).hexdigest()[:12]
    folder = Path(root) / f"harness-{digest}"
    if (folder / ".installed").exists():
        return str(folder)
    if say is not None:
        say(f"installing {' '.join(requirements)} into {folder} (once)")
    staging = folder.with_name(folder.name + f".{os.getpid()}")
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                           "--target", str(staging), *requirements], capture_output=True, text=True)
    if done.returncode != 0:
        raise ParticipantUnavailable(f"pip could not install {' '.join(requirements)}: {done.stderr.strip()[-SHOWN:]}")
    (staging / ".installed").write_text("\n".join(requirements) + "\n")
    try:
        staging.rename(folder)
    except OSError:  # another process installed it first
        shutil.rmtree(staging, ignore_errors=True)
    os.chmod(folder, 0o755)
    return str(folder)


class HarnessDriver:
    """Runs one configured harness per activation, in a jail of its own."""

    table = "harness"

    def __init__(self, name: str, harness: Harness, timeouts: PeerTimeouts | None = None) -> None:
        self.name, self.harness, self.continuation = name, harness, harness.continuation
        self.timeouts = timeouts or PeerTimeouts()
        self.sandbox = SandboxEnvironment(harness.limits)
        self._installed: str | None = None
        self._install_lock = threading.Lock()
        self.runs = 0  # activations started here (the tests count them)

    def installed(self, say: Callable[[str], None] | None = None) -> str | None:
        if not self.harness.requirements:
            return None
        with self._install_lock:
            if self._installed is None:
                self._installed = install(self.harness.requirements, self.harness.install_root, say)
            return self._installed

    def start(self, say: Callable[[str], None]) -> None:
        def start() -> None:
            try:
                self.installed(lambda line: say(f"{self.table}.{self.name}: {line}"))
            except ParticipantUnavailable as exc:
                say(f"{self.table}.{self.name}: {exc.detail}")
        threading.Thread(target=start, name=f"install-{self.name}", daemon=True).start()

    def stop(self) -> None:
        pass  # every jail ends with its activation

    def script(self, prompt: str, base_url: str, model: str, folder: str | None, task_id: str = "") -> str:
        python, _ = interpreter()
        values = {"{prompt}": prompt, "{base_url}": base_url, "{model}": model, "{python}": python}

        def fill(text: str) -> str:
            return re.sub("|".join(re.escape(k) for k in values), lambda m: values[m.group()], text)

        # Python orders a set of strings by a hash it seeds at random per process: a harness that lists
        # one in a prompt (smolagents's authorized imports) asks something else each run. Fixed per
        # task, the run after a crash asks what the first asked, as does any run of the same task.
        hash_seed = int.from_bytes(hashlib.sha256(task_id.encode()).digest()[:4], "big")
        env = {"HOME": HOME, "PYTHONHASHSEED": str(hash_seed), **({"PYTHONPATH": folder} if folder else {}),
               **{k: fill(v) for k, v in self.harness.env.items()}}
        exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())
        command = " ".join(shlex.quote(fill(arg)) for arg in self.harness.command)
        # The whole output goes to a file in the jail; its tail comes back, and the exit code after it.
        return (f"{exports}cd {HOME} && {{ {command}\n}} >{LOG} 2>&1 </dev/null; rc=$?; "
                f"tail -c {TAIL_BYTES} {LOG}; (exit $rc)\n")

    def answer(self, output: str) -> str:
        if self.harness.answer is not None:
            found = list(re.finditer(self.harness.answer, output, re.MULTILINE))
            if found:
                last = found[-1]
                return (last.group(1) if last.groups() else last.group()).strip()
        lines = [line for line in output.splitlines() if line.strip()]
        return lines[-1].strip() if lines else ""

    async def drive(self, p: Participant, key: Key, index: int, opening: list[dict[str, Any]],
                    tools: list[dict[str, Any]], req: RunRequest) -> dict[str, Any]:
        prompt = next((str(m["content"]) for m in reversed(opening) if m["role"] == "user"), "")
        folder = await asyncio.to_thread(self.installed)
        _, base_prefix = interpreter()
        paths = tuple(dict.fromkeys((base_prefix, *([folder] if folder else []), *self.harness.paths)))
        task = Task(env=req.task.env, task_id=req.task.task_id, prompt=req.task.prompt)
        peers = getattr(p, "model_peers", None)
        if peers is None:
            raise ParticipantUnavailable(f"{self.table}.{self.name}: this server has no model server to relay to")
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeouts.connect_s, sock_read=self.timeouts.work_s)
        relay = Relay(lambda: peers.url(key[0], key[1]), capture_id(key[0], key[1], index), getattr(p, "secret", None), timeout)
        self.runs += 1
        try:
            jail = await asyncio.to_thread(self.sandbox.open_live, task, None, None, paths)
        except ToolError as exc:
            raise DriveFailed(f"its sandbox could not start: {exc}") from exc
        try:
            await relay.start(jail.init)
            script = self.script(prompt, f"http://127.0.0.1:{relay.port}/v1", req.model, folder, req.task.task_id)
            output, code, _ = await asyncio.to_thread(self.sandbox.run_script, jail, script)
        except ToolError as exc:
            raise DriveFailed(f"its run ended: {exc}") from exc
        finally:
            await relay.stop()
            await asyncio.to_thread(self.sandbox.close_live, jail)
        if code != 0:
            raise DriveFailed(f"it exited {code}: {output[-SHOWN:]}")
        text = self.answer(output)
        return {"output": [{"type": "message", "role": "assistant",
                            "content": [{"type": "output_text", "text": text}]}]}


__all__ = ["Harness", "HarnessDriver", "install", "interpreter"]

"""A live POSIX shell per session, snapshotted after every command.

The shell lives in a process, so the log alone cannot rebuild it: after each command its files,
working directory and exported environment are stored as content-addressed blobs
(participants/environments/sandbox_snapshot.py), and the session's state is the name of that
snapshot (``state_mode`` "snapshot"). Restore and recovery start a fresh jail from the snapshot of
the boundary they continue from; a command that left a process running in the background leaves
no snapshot, and its rollout restarts from its input if it must move (`unrestorable`). The engine
talks to the shell through the ``*_live`` methods.

It runs whatever command a model (or whoever holds the data credential) sends, and the model is
trained to find whatever raises its reward, so the shell is treated as hostile. The environment is
off unless the configuration gives it `SandboxLimits`; then every session gets a jail of its own
(`sandbox_jail.JAIL`, run by the server, which must be root for it; docs/sandbox.md says what a session can
and cannot do):

- its own uid and gid, claimed from the range `uid_base` .. `uid_base + uids - 1` for as long as the
  session lives, so the per-user process limit (`max_processes`) counts this session alone and no
  other session's processes can be signalled or their files read;
- new PID, mount, network, IPC, UTS and cgroup namespaces. The jail's init is PID 1 of its PID
  namespace, root-owned, and the shell is its child: `kill -9 -1` reaches only the session's own
  processes, and when init dies the kernel kills every process left in the namespace;
- a root of its own: one size-limited tmpfs (`disk_mb`, shared by the working directory, /tmp,
  /var/tmp and /dev/shm) with the host's /usr, /etc and the /bin, /lib, /sbin links bound read-only,
  a few device nodes and a /proc that lists only the session's processes. Nothing else of the host
  (its disk, /tmp, /run and the sockets in it, the server's files) is there;
- no network interface but a down loopback (up in a harness's session, with the agent server's egress
  relay as its one listener: participants/agent/egress.py); rlimits per process (CPU, address space, file size, no
  core files); no supplementary groups; `PR_SET_NO_NEW_PRIVS`, so no setuid binary raises it; a
  seccomp filter refusing new user namespaces; keyrings of its own;
- cgroups of its own (memory, pids, cpu), so the kernel bounds the session's totals: all the memory
  it can pin (tmpfs files, System V segments, memfds, processes) to `memory_mb`, its processes and
  its CPU. A machine where a bound cannot be set refuses sessions (`sandbox_unsupported`).

The session is ready only when the shell itself has printed the ready line, as its first command:
a jail or shell that fails to start is a start failure, never a session. Closing a session (or the
server dying) kills the namespace's init, and with it every process the session left, however it
detached or whatever signals it ignores; what is left in its cgroups is killed before its uid is free. The server adds a wall-clock timeout per command (the
session ends when one passes it), keeps at most `output_bytes` of each command's output, refuses
commands over `command_bytes`, and ends a shell no command has used for `idle_s`.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import secrets
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import ClassVar

from engine.errors import InvalidCheckpointState

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
from .sandbox_host import claim_uid, make_cgroups, remove_cgroups
from .sandbox_jail import JAIL
from .sandbox_snapshot import (
    SHELL_STATE_BYTES,
    SHELL_STATE_COMMAND,
    Known,
    Load,
    Unrestorable,
    load_manifest,
    manifest_of,
    parse_shell_state,
    read_tree,
    restore_script,
    write_tree,
)

SHELL = "/bin/sh"
READY = b"rollbook-sandbox-ready\n"
FAILED = b"rollbook-sandbox-failed"
HOME = "/home/sandbox"  # the session's working directory, inside its own root
PATH = "/usr/local/bin:/usr/bin:/bin"  # inside the jail: the server's own PATH may name folders the jail lacks
# Bound read-only into each session's root; a path that is a symbolic link on the host (merged /usr)
# is recreated as the same link.
SYSTEM_PATHS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
DEVICES = ("null", "zero", "full", "random", "urandom")
# The shell's first command: the session is ready once the shell itself has run it.
_READY_COMMAND = b"printf '%s\\n' rollbook-sandbox-ready\n"

WORDS = ["alpha", "bravo", "cedar", "delta", "ember", "fjord", "gamma", "harbor", "indigo", "juniper"]
_HEX64 = re.compile(r"\b[0-9a-f]{64}\b")


@dataclass(frozen=True)
class SandboxLimits:
    """What a sandbox session may use; given by the configuration's [sandbox] table."""

    user: str = "nobody"  # no longer used: each session runs as a uid of its own (uid_base, uids)
    cpu_s: int = 10  # CPU seconds per process (RLIMIT_CPU; SIGXCPU, then SIGKILL a second later)
    # All the memory one session holds: its processes, its tmpfs (disk_mb is part of it), System V
    # shared memory and memfds (its memory cgroup); also the address space of each process (RLIMIT_AS).
    memory_mb: int = 512
    max_processes: int = 64  # processes of one session (RLIMIT_NPROC per uid, and pids.max of its cgroup)
    cpus: float = 1.0  # CPU cores one session may keep busy at once (its cgroup's CFS quota)
    file_mb: int = 64  # largest file a command may write (RLIMIT_FSIZE)
    output_bytes: int = 8_000  # output kept per command; the rest is counted and dropped
    timeout_s: float = 10.0  # wall clock per command; past it the session ends
    uid_base: int = 200_000  # sessions run as uid = gid = uid_base + n, n < uids; no account may own these
    uids: int = 1_000  # at most this many sessions at once on this machine (all servers together)
    disk_mb: int = 128  # all a session may write: its working dir, /tmp, /var/tmp and /dev/shm together (tmpfs: RAM)
    command_bytes: int = 65_536  # the longest command accepted
    idle_s: float = 1_800.0  # a shell no command has used for this long is ended
    cgroup_root: str = "/sys/fs/cgroup"  # where the memory, pids and cpu hierarchies (cgroup v1) are mounted
    state_dir: str = "/run/rollbook"  # the uid claims; root's alone (0700), never a folder others can make first

    def rlimits(self) -> list[tuple[str, int, int]]:
        mb = 1024 * 1024
        return [("RLIMIT_CPU", self.cpu_s, self.cpu_s + 1), ("RLIMIT_AS", self.memory_mb * mb, self.memory_mb * mb),
                ("RLIMIT_NPROC", self.max_processes, self.max_processes), ("RLIMIT_FSIZE", self.file_mb * mb, self.file_mb * mb),
                ("RLIMIT_CORE", 0, 0)]


@dataclass(eq=False)
class LiveShell:
    """One session's jail: `process` is the jail's outer process; the shell runs inside it as `uid`."""

    process: subprocess.Popen
    uid: int
    uid_lock: int  # an fd holding the lock on `uid` while the session lives
    task_id: str
    cgroups: list[str] = field(default_factory=list)  # its group in each controller; emptied at its end
    init: int = 0  # the jail's init, as the host numbers it: its /proc/<init>/root is the session's tree
    known: Known = field(default_factory=Known)  # what was stored of its tree: snapshots read what changed
    closed: bool = False
    busy: bool = False  # a command is running: the idle watch leaves the session alone
    last_used: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    ended: threading.Event = field(default_factory=threading.Event, repr=False)


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
    state_mode: ClassVar[StateMode] = "snapshot"
    conformance_seed: ClassVar[int] = 1  # an episode with no background watcher: every boundary continues
    verification: ClassVar[Verification] = "wait"

    def __init__(self, limits: SandboxLimits | None = None) -> None:
        self.limits = limits  # None: off; a session cannot be opened
        self.timeout_s = limits.timeout_s if limits is not None else 10.0

    def tools(self) -> list[dict]:
        return [function_tool("run", "Run a command in a persistent POSIX shell; returns its output and exit code.",
                              {"command": {"type": "string"}}, ["command"])]

    def initial_state(self, task: Task) -> JSON:
        # The live process holds the state; this names the snapshot a fresh jail is rebuilt from (None: empty).
        return {"shell": SHELL, "task_id": task.task_id, "snapshot": None}

    def call_tool(self, state: JSON, name: str, arguments: dict) -> ToolOutcome:
        self._check(name, arguments)
        raise ToolError("live_only", "sandbox tools run against a live session; use call_live()")

    def apply(self, state: JSON, effect: JSON) -> JSON:
        why = effect.get("unrestorable")
        return {"shell": state["shell"], "task_id": state["task_id"], "snapshot": effect.get("snapshot"),
                **({"unrestorable": why} if why else {})}

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

    def open_live(self, task: Task, state: JSON = None, load: Load | None = None, paths: tuple[str, ...] = ()) -> LiveShell:
        """A jail for the session; with `state`, its tree, directory and environment rebuilt from the
        snapshot the state names (ToolError `snapshot_unusable` when that cannot be done, with why).
        `paths` are host folders bound read-only at the same place besides the system's (a harness's install)."""
        if state is not None and state.get("unrestorable"):
            raise ToolError("snapshot_unusable", state["unrestorable"])
        limits = self.limits
        if limits is None:
            raise ToolError("sandbox_disabled", "the sandbox environment is off in this configuration")
        if os.geteuid() != 0:
            raise ToolError("sandbox_unavailable", "the sandbox needs a server started as root, to build its jails")
        uid, uid_lock = claim_uid(limits.state_dir, limits.uid_base, limits.uids)
        try:
            cgroups = make_cgroups(limits.cgroup_root, uid, limits.memory_mb, limits.max_processes, limits.cpus)
        except BaseException:
            os.close(uid_lock)
            raise
        args = {"cgroups": cgroups, "server": os.getpid(), "uid": uid, "gid": uid, "limits": limits.rlimits(), "shell": SHELL,
                "home": HOME, "system": SYSTEM_PATHS + tuple(p for p in paths if not p.startswith(tuple(f"{s}/" for s in SYSTEM_PATHS))), "devices": DEVICES, "disk_kb": limits.disk_mb * 1024,
                "inodes": max(1024, limits.disk_mb * 256), "env": {"PATH": PATH, "HOME": HOME, "LC_ALL": "C"}}
        try:
            process = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", JAIL, json.dumps(args)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, cwd="/", env={}, start_new_session=True,
            )
        except BaseException:
            remove_cgroups(cgroups)
            os.close(uid_lock)
            raise
        handle = LiveShell(process=process, uid=uid, uid_lock=uid_lock, task_id=task.task_id, cgroups=cgroups)
        assert process.stdin is not None
        try:
            process.stdin.write(_READY_COMMAND)
            process.stdin.flush()
        except BrokenPipeError:
            pass  # the jail is gone already; what it said is on stdout
        said = self._read_line(handle, deadline=time.monotonic() + 10.0)
        if said != READY:
            self.close_live(handle)
            why = said.removeprefix(FAILED).strip().decode(errors="replace") or "the shell exited before it was ready"
            raise ToolError("sandbox_unavailable", f"the sandbox could not start: {why}")
        with open(f"/proc/{process.pid}/task/{process.pid}/children") as f:
            handle.init = int(f.read().split()[0])
        if state is not None and state.get("snapshot"):
            try:
                self._restore(handle, state["snapshot"], load)
            except (Unrestorable, InvalidCheckpointState, OSError, ValueError, KeyError) as exc:
                self.close_live(handle)
                detail = exc.detail if isinstance(exc, InvalidCheckpointState) else str(exc)
                raise ToolError("snapshot_unusable", f"snapshot {state['snapshot'][:12]}: {detail}") from None
        threading.Thread(target=self._watch_idle, args=(handle,), name=f"sandbox-idle-{uid}", daemon=True).start()
        return handle

    def _restore(self, handle: LiveShell, digest: str, load: Load | None) -> None:
        if load is None:
            raise Unrestorable("no blob store to read it from")
        stored = load_manifest(digest, load)
        write_tree(f"/proc/{handle.init}/root", stored, handle.uid, handle.known)
        _, now = parse_shell_state(self._send(handle, SHELL_STATE_COMMAND, SHELL_STATE_BYTES)[0])
        self._send(handle, restore_script(stored.cwd, stored.env, now))
        cwd, env = self._shell_state(handle)
        if (cwd, env) != (stored.cwd, stored.env):
            changed = sorted(k for k in set(env) | set(stored.env) if env.get(k) != stored.env.get(k))
            raise Unrestorable(f"the fresh shell's directory or environment differs from the snapshot's "
                               f"({cwd!r} for {stored.cwd!r}; variables {changed[:5]})")

    def _shell_state(self, handle: LiveShell) -> tuple[str, dict[str, str]]:
        output, _, dropped = self._send(handle, SHELL_STATE_COMMAND, SHELL_STATE_BYTES)
        if dropped:
            raise Unrestorable(f"its working directory and environment are over {SHELL_STATE_BYTES} bytes")
        return parse_shell_state(output)

    def _snapshot(self, handle: LiveShell, outcome: ToolOutcome) -> ToolOutcome:
        """The outcome with the session's snapshot after it, or why there is none."""
        assert outcome.effect is not None
        try:
            running = self._processes(handle) - 3  # the jail's root, init and the shell
            if running > 0:
                raise Unrestorable(f"{running} process{'es' if running > 1 else ''} still running in the background")
            cwd, env = self._shell_state(handle)
            files, new = read_tree(f"/proc/{handle.init}/root", handle.known)
        except Unrestorable as exc:
            return ToolOutcome(outcome.output, {**outcome.effect, "snapshot": None, "unrestorable": str(exc)},
                               outcome.done, unrestorable=str(exc))
        snap = manifest_of(files, cwd, env, handle.known, new)
        return ToolOutcome(outcome.output, {**outcome.effect, "snapshot": snap.digest}, outcome.done, snap.blobs)

    @staticmethod
    def _processes(handle: LiveShell) -> int:
        pids = next(g for g in handle.cgroups if "/pids/" in g)
        with open(f"{pids}/cgroup.procs") as f:
            return len(f.read().split())

    @staticmethod
    def _read_line(handle: LiveShell, deadline: float) -> bytes:
        """The first line, read byte by byte so nothing of the shell's later output is taken."""
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
        cap = self.limits.command_bytes if self.limits is not None else SandboxLimits.command_bytes
        size = len(command.encode())
        if size > cap:
            raise ToolError("command_too_long", f"the command is {size} bytes; the sandbox takes at most {cap}")
        with handle.lock:
            if handle.closed or handle.process.poll() is not None:
                raise ToolError("session_lost", "the session's shell has ended")
            handle.busy = True
        try:
            # A non-interactive sh exits on a syntax error, which would end the session: the command is
            # parsed first by `sh -n` inside the jail, reading it from a here-document (never argv,
            # which caps one argument at 128 KiB). The random delimiter cannot occur in the command.
            end = f"__rollbook_{secrets.token_hex(8)}__"
            check = f"sh -n 2>&1 <<'{end}'\n{command}\n{end}\n"
            output, code, dropped = self._send(handle, check)
            if code == 0:
                # stdin from /dev/null: otherwise a command like `cat` would swallow the marker line.
                output, code, dropped = self._send(handle, f"{{ {command}\n}} </dev/null 2>&1\n")
            return self._snapshot(handle, self._outcome(command, output, code, dropped))
        finally:
            handle.busy, handle.last_used = False, time.monotonic()

    def run_script(self, handle: LiveShell, script: str) -> tuple[str, int, int]:
        """A shell script run in the session, as the jail's user: its output (at most `output_bytes`),
        exit code and the bytes dropped; past `timeout_s` the session ends (ToolError `timeout`)."""
        with handle.lock:
            if handle.closed or handle.process.poll() is not None:
                raise ToolError("session_lost", "the session's shell has ended")
            handle.busy = True
        try:
            return self._send(handle, script)
        finally:
            handle.busy, handle.last_used = False, time.monotonic()

    def _send(self, handle: LiveShell, script: str, cap: int | None = None) -> tuple[str, int, int]:
        marker = f"__rollbook_{secrets.token_hex(8)}__"
        assert handle.process.stdin is not None
        try:
            handle.process.stdin.write(f"{script}printf '\\n{marker} %s\\n' \"$?\"\n".encode())
            handle.process.stdin.flush()
        except (BrokenPipeError, ValueError):
            self.close_live(handle)
            raise ToolError("session_lost", "the shell exited") from None
        return self._read_until(handle, marker, cap)

    def close_live(self, handle: LiveShell) -> None:
        with handle.lock:
            if handle.closed:
                return
            handle.closed = True
        self._end(handle)

    def _end(self, handle: LiveShell) -> None:
        """Ends the session: every process in its PID namespace is gone when this returns."""
        process = handle.process
        if process.poll() is None:
            # The jail's outer process SIGKILLs init and waits for it; the kernel has killed the rest by then.
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()  # init dies of its parent-death signal, and the namespace with it
                process.wait()
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                try:
                    stream.close()
                except BrokenPipeError:
                    pass
        # The PID namespace has ended every process by now; the group is the check, and is gone before
        # the uid is free for another session.
        remove_cgroups(handle.cgroups)
        os.close(handle.uid_lock)
        handle.ended.set()

    def _watch_idle(self, handle: LiveShell) -> None:
        """Ends a shell no command has used for `idle_s`: a rollout that failed, or whose caller went
        away without closing its session, does not keep its jail for good."""
        idle_s = self.limits.idle_s if self.limits is not None else SandboxLimits.idle_s
        while True:
            with handle.lock:
                if handle.closed:
                    return
                left = idle_s - (time.monotonic() - handle.last_used)
                if not handle.busy and left <= 0:
                    handle.closed = True
                    break
            handle.ended.wait(max(left, 1.0))
        self._end(handle)

    # -- helpers -----------------------------------------------------------------

    @staticmethod
    def _check(name: str, arguments: dict) -> str:
        if name != "run":
            raise ToolError("unknown_tool", f"no tool named {name!r}")
        command = read_args(arguments, {"command": ("str", True)})["command"]
        if not command.strip():
            raise ToolError("bad_arguments", "command must not be empty")
        # A shell reads bytes, and a lone surrogate (the JSON escape "\ud800", which the log stores and
        # gives back exactly) has no UTF-8 spelling: the command is refused as its arguments, here, for
        # every way a command reaches a shell.
        bad = next((i for i, ch in enumerate(command) if "\ud800" <= ch <= "\udfff"), None)
        if bad is not None:
            raise ToolError("bad_arguments", f"command holds a lone surrogate (U+{ord(command[bad]):04X}) at "
                                             f"character {bad}: a shell takes UTF-8 text")
        return command

    def _read_until(self, handle: LiveShell, marker: str, cap: int | None = None) -> tuple[str, int, int]:
        """The command's output (at most `output_bytes` of it), its exit code and how many bytes were dropped.

        Memory stays bounded however much a command prints: past the cap only a short tail is kept,
        long enough to find the end marker in."""
        assert handle.process.stdout is not None
        fd = handle.process.stdout.fileno()
        needle = f"\n{marker} ".encode()
        if cap is None:
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
                    self.close_live(handle)
                    raise ToolError("session_lost", "the shell exited")
                buf += chunk

    @staticmethod
    def _outcome(command: str, output: str, code: int, dropped: int = 0) -> ToolOutcome:
        if dropped:
            output += f"\n[output truncated: {dropped} more bytes]"
        # Not read-only: the live shell changed. The effect is a record for the log; apply() refuses it.
        return ToolOutcome(output={"output": output, "exit_code": code},
                           effect={"command": command, "exit_code": code})

"""NeMo Gym resources servers, unchanged, as rollbook environments: every call relayed and recorded.

A configured server (`[nemo_gym.<name>]`, apps/config.py) becomes the environment `<name>`: its tasks are
NeMo Gym's own data rows (`params.row`), its tools the row's, and its session a live session on the NeMo Gym
server (`/seed_session`, one `POST /<tool>` per call, `/verify`, `/close_session`, the session in NeMo Gym's
cookie, kept per rollbook session). rollbook starts the server as a process of its own with NeMo Gym's
Python (`participants/environments/nemo_gym_launcher.py`), or relays to one the operator runs (`url`).

Its state in rollbook is the record of the calls it relayed (engine.tool_replay): each call is one
`mutation_applied` whose effect is `{tool, arguments, digest}` of the reply. A live session that is gone (a
server restart, a resources-server restart, a restore) is rebuilt, for a server declared `replay`, by
seeding a fresh one and sending the record again; a reply that differs ends the attempt
(`replay_divergence`). A `restart_only` server's lost session restarts the rollout.

What a server answers is taken for what it is. A tool reply that is not JSON, a 4xx, or a 5xx from a process
that is still running is the tool's error: the model sees it, nothing is rebuilt. Only a server that cannot
be reached, or whose process has exited, is taken for gone; its session is rebuilt at most
`rebuild_attempts` times without a call succeeding in between, then the rollout ends with
`gym_server_failed`, as it does at once when the server cannot start (its import or its config failed: the
one line the launcher wrote says why), or when its seed or verify is refused (the server's status and body
in the error).

The live half is async (participants/environments/gym_http.py: one pooled client per server, on the
resources server's event loop); only starting a server, or waiting for one, runs in a thread.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import aiohttp

from adapters.openai_wire import responses_object
from engine import tool_replay
from engine.catalog import SESSION_REPLAY_FAILED, SESSION_REPLAYED
from engine.errors import (
    AttemptLost,
    GymServerFailed,
    InvalidRequest,
    ParticipantUnavailable,
    ReplayDivergence,
)
from engine.events import dumps, loads
from participants.environments import (
    ENVIRONMENTS,
    Environment,
    Task,
    ToolError,
    ToolOutcome,
    Trajectory,
    gymnasium,
)
from participants.environments.base import JSON
from participants.environments.gym_http import Cookies, connections
from participants.environments.nemo_gym_row import chat_tools, row_messages, row_sampling
from participants.environments.players import GYM_PLAYER, SCHEMA

LAUNCHER = Path(__file__).with_name("nemo_gym_launcher.py")
# A NeMo Gym resources server's own routes (its RESERVED_MCP_TOOL_NAMES, and more): never a tool call.
SERVER_ENDPOINTS = frozenset({"seed_session", "close_session", "verify", "aggregate_metrics", "mcp", "reverify_mode",
                              "health", "healthz", "livez", "readyz", "docs", "openapi"})
# Of those, the ones an agent that drives its server itself calls (toolsandbox_agent's seed and verify).
AGENT_ROUTES = frozenset({"seed_session", "verify", "close_session"})
# The resources server's append of one event to a session's stream (under the session's lock).
Appender = Callable[[Any, str, dict[str, Any]], Awaitable[Any]]


@dataclass(frozen=True)
class GymServer:
    """One configured NeMo Gym resources server (the config's `[nemo_gym.<name>]`)."""

    name: str  # the rollbook environment it becomes
    module: str  # e.g. resources_servers.workplace_assistant.app
    state: tool_replay.Declaration = tool_replay.UNDECLARED
    url: str | None = None  # an operator-run server; None: rollbook starts one
    python: str | None = None  # NeMo Gym's interpreter, when rollbook starts it
    paths: tuple[str, ...] = ()  # folders put in front of its sys.path (a NeMo Gym checkout)
    port: int | None = None  # where a server rollbook starts listens
    start_timeout_s: float = 180.0
    call_timeout_s: float = 120.0
    overrides: str = "{}"  # the table's `config`, as JSON: merged over the server's own configs/*.yaml entry
    config_file: str | None = None  # which of its configs/*.yaml (default: the one named as its folder)
    rebuild_attempts: int = 3  # rebuilds of a session without a call succeeding in between, then it fails
    servers: str = "{}"  # the servers it calls by name (an agent's model and resources servers), as JSON
    table: str = "nemo_gym"  # the config table that names it, in what it says: nemo_gym or nemo_gym_agent
    driven_by: tuple[str, ...] = ()  # agents (drive = "run") that seed, step and verify it themselves


class LiveGone(Exception):
    """The live session is not there any more (its server restarted or cannot be reached)."""


class GymReplyError(Exception):
    """The server answered, but not with JSON, or with an error status: its own answer, not its death."""

    def __init__(self, path: str, status: int, body: str) -> None:
        super().__init__(f"{path}: {status} {body}")
        self.path, self.status, self.body = path, status, body


BODY_SHOWN = 500  # how much of a server's reply an error carries


class GymProcess:
    """The server rollbook runs for one configuration, in this resources server's process group (a
    SIGKILL of the group takes it along), started on first use and again when it died."""

    def __init__(self, server: GymServer) -> None:
        self.server = server
        self.proc: subprocess.Popen[bytes] | None = None
        self.lock = threading.Lock()
        self.starts = 0
        # Why it cannot start as configured (the launcher's line): every session asking is told, not restarted.
        self.failed: str | None = None
        self._paths: tuple[int | None, frozenset[str]] | None = None  # (the process's pid, what it serves)
        self.closes = True  # False once its /close_session refused a row-seeded session's close (422)

    def base_url(self) -> str:
        if self.server.url is None:
            with self.lock:
                if self.failed is not None:
                    raise self.failure()
                if self.proc is None or self.proc.poll() is not None:
                    self._start()
        return self._address()

    def _address(self) -> str:  # where it listens, started or not
        return self.server.url.rstrip("/") if self.server.url is not None else f"http://127.0.0.1:{self.server.port}"

    def gymnasium(self) -> bool:
        """Whether the server speaks NeMo Gym's gymnasium protocol (participants.environments.gymnasium),
        read from the running server once per process."""
        base = self.base_url()
        pid = None if self.proc is None else self.proc.pid
        if self._paths is None or self._paths[0] != pid:
            self._paths = (pid, gymnasium.served_paths(base, self.server.call_timeout_s))
        return gymnasium.speaks(self._paths[1])

    async def served(self) -> tuple[str, bool]:
        """`base_url()` and `gymnasium()`: at once where neither would wait (it runs, or is the operator's, and
        was asked what it serves), else from a thread that starts it and waits: a hop cost more than the question."""
        proc, paths = self.proc, self._paths
        running = self.server.url is not None or (proc is not None and self.failed is None and proc.poll() is None)
        if running and paths is not None and paths[0] == (None if proc is None else proc.pid):
            return self._address(), gymnasium.speaks(paths[1])
        return await asyncio.to_thread(lambda: (self.base_url(), self.gymnasium()))

    def failure(self) -> GymServerFailed:
        return GymServerFailed(f"{self.server.table}.{self.server.name}: {self.server.module} cannot start: {self.failed}",
                               server=self.server.name, stage="start")

    def check(self) -> str | None:
        """Start it now (`rollbook serve` does, so that a server that cannot import says so there and
        then); the line that says why it cannot start, or None."""
        try:
            self.base_url()
        except GymServerFailed:
            return self.failed
        except LiveGone as exc:
            return str(exc)
        return None

    def _start(self) -> None:
        s = self.server
        if s.python is None or s.port is None:
            raise LiveGone(f"{s.name}: no NeMo Gym python or port configured to start {s.module}")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update({"PYTHONUNBUFFERED": "1", "RAY_USAGE_STATS_ENABLED": "0"})
        reason = Path(tempfile.mkdtemp(prefix="rollbook-gym-")) / "failure"
        env.update({"ROLLBOOK_GYM_OVERRIDES": s.overrides, "ROLLBOOK_GYM_SERVERS": s.servers,
                    "ROLLBOOK_GYM_FAILURE": str(reason)})
        if s.config_file:
            env["ROLLBOOK_GYM_CONFIG_FILE"] = s.config_file
        log = open(os.environ.get("ROLLBOOK_GYM_LOG", os.devnull), "ab")  # noqa: SIM115 - the child holds it
        self.proc = subprocess.Popen([s.python, str(LAUNCHER), s.module, s.name, str(s.port), *s.paths],
                                     stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        self.starts += 1
        deadline = time.monotonic() + s.start_timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{s.port}/health", timeout=2):
                    shutil.rmtree(reason.parent, ignore_errors=True)
                    return
            except OSError:
                if self.proc.poll() is not None:
                    said = reason.read_text().strip() if reason.exists() else ""
                    shutil.rmtree(reason.parent, ignore_errors=True)
                    if said:
                        self.failed = said
                        raise self.failure() from None
                    raise LiveGone(f"{s.name}: {s.module} exited with {self.proc.returncode}") from None
                if time.monotonic() > deadline:
                    raise LiveGone(f"{s.name}: {s.module} did not answer in {s.start_timeout_s} s") from None
                time.sleep(0.2)

    def settle(self, timeout_s: float = 10.0) -> None:
        """Wait until the process rollbook runs either answers or has exited: one that is dying (it
        exited mid-call, its socket already closed) is then started afresh instead of being asked again."""
        deadline = time.monotonic() + timeout_s
        while self.server.url is None and self.proc is not None and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.server.port}/health", timeout=2):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.1)

    def stop(self) -> None:
        with self.lock:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            self.proc = None


@dataclass
class Live:
    """One live NeMo Gym session: its cookie, and which server process it lives in."""

    base_url: str
    proc: subprocess.Popen[bytes] | None
    timeout_s: float
    live_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    cookies: Cookies = field(default_factory=Cookies)
    driven: bool = False  # by its task's own agent (GymServer.driven_by), which calls the server's own routes

    def gone(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    async def post(self, path: str, body: dict[str, Any]) -> Any:
        """The reply's JSON. LiveGone when the session's server is not the one that seeded it any more
        (it exited, or cannot be reached); GymReplyError when it answered with an error status or
        with something that is not JSON: its answer, which a rebuild would only ask for again."""
        if self.gone():
            raise LiveGone(f"the server of live session {self.live_id} exited")
        pool = connections(self.base_url, None if self.proc is None else self.proc.pid, self.timeout_s)
        try:
            status, raw = await pool.post(path, dumps(body).encode(), self.cookies)
        except (OSError, aiohttp.ClientError) as exc:
            # ClientError: killed between its headers and its body (ClientPayloadError), it is as gone.
            raise LiveGone(f"{path}: {exc!r}") from None
        if status >= 400:
            text = raw.decode(errors="replace")[:BODY_SHOWN]
            if status >= 500 and self.gone():  # it died answering: the process, not the call, failed
                raise LiveGone(f"{path}: {status} {text}")
            raise GymReplyError(path, status, text)
        try:
            return loads(raw or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise GymReplyError(path, status, raw.decode(errors="replace")[:BODY_SHOWN]) from None


def row_of(task: Task) -> dict[str, Any]:
    row = task.params.get("row")
    if not isinstance(row, dict) or not isinstance(row.get("responses_create_params"), dict):
        raise ToolError("bad_task", "a NeMo Gym task's params.row must be a data row with responses_create_params")
    return row


class NemoGymEnvironment(Environment):
    """The base of every configured server's environment class (`register` makes one per server)."""

    server: ClassVar[GymServer]
    process: ClassVar[GymProcess]
    relayed: ClassVar[bool] = True

    def tools(self) -> list[dict]:
        return []  # the row's: task_tools

    def task_tools(self, task: Task) -> list[dict[str, Any]]:
        return chat_tools(row_of(task))

    def task_messages(self, task: Task) -> list[dict[str, Any]]:
        row = row_of(task)
        if self.driven(task) and not row["responses_create_params"].get("input"):
            return []  # its agent writes the prompt from the row's other fields (toolsandbox_agent, scicode_agent)
        return row_messages(row)

    def driven(self, task: Task) -> bool:
        """Whether the task's own agent drives the server (GymServer.driven_by)."""
        return task.agent is not None and task.agent in self.server.driven_by

    def task_sampling(self, task: Task) -> dict[str, Any]:
        return {**row_sampling(row_of(task)), **task.sampling}  # the task's own, where it names one, win

    def initial_state(self, task: Task) -> JSON:
        row_of(task)
        return []  # the record of relayed calls (engine.tool_replay)

    def call_tool(self, state: JSON, name: str, arguments: dict) -> ToolOutcome:
        raise ToolError("relayed", f"{self.name} is relayed to NeMo Gym: its calls go through a live session")

    def apply(self, state: JSON, effect: JSON) -> JSON:
        return tool_replay.record(state, effect)

    def verify(self, task: Task, state: JSON, trajectory: Trajectory) -> float:
        raise ToolError("relayed", f"{self.name} is verified by its NeMo Gym server, in a live session")

    # ---- the live half ---------------------------------------------------------------------

    async def open_live(self, task: Task) -> Live:
        """A live session seeded with the task's row, as NeMo Gym's simple_agent seeds one (it posts the
        whole run request: the row, `responses_create_params` and the server's own fields, such as
        `initial_count`); a seed the server refuses fails the rollout with its status and body."""
        base, gym = await self.process.served()  # started, and asked what it serves, on first use
        live = Live(base, self.process.proc if self.server.url is None else None, self.server.call_timeout_s,
                    driven=self.driven(task))
        if gym or live.driven:
            row_of(task)
            return live  # its agent's /reset or /seed_session is the seed, and the first call of the record
        try:
            await live.post("/seed_session", row_of(task))
        except GymReplyError as exc:
            raise self.refused("seed", exc) from None
        return live

    def refused(self, stage: str, exc: GymReplyError) -> GymServerFailed:
        return GymServerFailed(f"nemo_gym.{self.name}: {self.server.module} answered {exc.path} with {exc.status}: "
                               f"{exc.body}", server=self.name, stage=stage, status=exc.status, body=exc.body)

    async def revive(self, task: Task, calls: list[dict[str, Any]]) -> Live:
        """A fresh live session with the record sent again (replay), or none sent (stateless).
        Raises ReplayDivergence when a reply is not the recorded one."""
        if not tool_replay.continues(self.server.state):
            raise ReplayDivergence(f"{self.name} is restart_only: its lost session cannot be rebuilt")
        for tries in range(2):  # the server may die again mid-replay: once more from a fresh process
            await asyncio.to_thread(self.process.settle)
            live = await self.open_live(task)
            try:
                if self.server.state == "replay":  # a stateless server has nothing to rebuild
                    await tool_replay.replay(calls, lambda tool, args, live=live: self._replayed(live, tool, args))
                return live
            except LiveGone:
                if tries:
                    raise
        raise AssertionError("unreachable")

    async def _replayed(self, live: Live, name: str, arguments: dict[str, Any]) -> Any:
        try:
            return await self._send(live, name, arguments)
        except GymReplyError as exc:  # a recorded call it answered before and refuses now: not the same server state
            raise ReplayDivergence(f"{name} was answered before and now gets {exc.status} {exc.body}"[:400]) from None

    def as_recorded(self, name: str, arguments: Any) -> Any:
        return gymnasium.step_as_recorded(arguments) if name == gymnasium.STEP and self.process.gymnasium() else arguments

    async def call_live(self, live: Live, name: str, arguments: dict[str, Any], tool_call: str | None = None,
                        capture: str | None = None) -> ToolOutcome:
        # An agent-driven server's calls go under the activation's path, which NeMo Gym carries to the
        # model calls the server makes from there (toolsandbox's simulated user): calls of the rollout.
        under = f"/ng-rollout/{capture}" if capture is not None and live.driven else ""
        try:
            reply = await self._send(live, name, arguments, under)
        except GymReplyError as exc:
            # The server's own answer: the call's error to the model, and no mutation rollbook could replay.
            code = "gym_not_json" if exc.status < 400 else "gym_refused"
            raise ToolError(code, f"{name}: {exc.status} {exc.body}") from None
        scored = name == "verify" and live.driven or name == gymnasium.STEP and self.process.gymnasium()
        reward = gymnasium.step_reward(reply, name) if scored else None
        return ToolOutcome(reply, tool_replay.entry(name, arguments, reply, tool_call, reward))

    @staticmethod
    async def _send(live: Live, name: str, arguments: dict[str, Any], under: str = "") -> Any:
        # A URL path: one plain segment, no endpoint of the server's own but those its agent drives it by.
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,128}", name) or \
                name in SERVER_ENDPOINTS and not (live.driven and name in AGENT_ROUTES):
            raise ToolError("unknown_tool", f"{name[:80]!r} is not a tool of this server")
        return await live.post(f"{under}/{name}", arguments)

    async def verify_live(self, live: Live, task: Task, trajectory: Trajectory, capture: str) -> float:
        """The row's own fields, with the Responses-API `response` NeMo Gym's verify reads. Asked under the
        activation's `/ng-rollout/<capture>/` path, which NeMo Gym carries to the calls the server makes
        from there: a judge's model calls reach rollbook's model server as calls of the rollout."""
        row = row_of(task)
        response = responses_object(task.task_id, trajectory.messages, {}, time.time())
        del response["usage"]  # optional in NeMo Gym's response, and its token counts are the model server's
        try:
            reply = await live.post(f"/ng-rollout/{capture}/verify", {**row, "response": response})
        except GymReplyError as exc:
            raise self.refused("verify", exc) from None
        if not isinstance(reply, dict) or not isinstance(reply.get("reward"), int | float) or reply.get("mask_sample"):
            # A masked sample (NeMo Gym's judge_failsafe: its judge failed) carries a 0 that is no reward.
            raise self.refused("verify", GymReplyError("/verify", 200, json.dumps(_why(reply))[:BODY_SHOWN]))
        return float(reply["reward"])

    async def close_live(self, live: Live) -> None:
        # NeMo Gym's close of a row-seeded session: its cookie, an empty body. A 422 (its base close,
        # keeping nothing) will not change, and each cost the server a tool call's CPU: not asked again.
        if self.process.closes:
            try:
                await live.post("/close_session", {})
            except GymReplyError as exc:
                self.process.closes = exc.status != 422
            except (LiveGone, ToolError):
                pass  # gone: nothing left to release


MODEL_URL = re.compile(r"^http://((?:[^\s/?#@]+@)?[^\s/?#@:]+):([0-9]{1,5})/?$")


def given(models: dict[str, str]) -> dict[str, Any]:
    """Model servers at URLs the operator gave, as entries of a NeMo Gym config (its host and port)."""
    out: dict[str, Any] = {}
    for name, url in models.items():
        m = MODEL_URL.fullmatch(url)
        assert m is not None  # validated with the table
        # The host keeps a credential the URL carries: NeMo Gym's client sends it as basic auth.
        out[name] = {"responses_api_models": {"given": {"entrypoint": "given", "host": m.group(1), "port": int(m.group(2))}}}
    return out


def register(servers: list[GymServer]) -> None:
    """Make each configured server an environment of this process (idempotent per configuration)."""
    for s in servers:
        existing = ENVIRONMENTS.get(s.name)
        if existing is not None and not issubclass(existing, NemoGymEnvironment):
            raise InvalidRequest(f"nemo_gym.{s.name}: an environment named {s.name!r} is registered already")
        if existing is not None and existing.server == s:
            continue
        mode = {"replay": "replay", "stateless": "stateless", "restart_only": "restart_only"}[s.state]
        cls = type(f"NemoGym_{s.name}", (NemoGymEnvironment,), {
            "name": s.name, "state_mode": mode, "verification": "replay" if tool_replay.continues(s.state) else "wait",
            "server": s, "process": GymProcess(s), "scripted": (GYM_PLAYER, SCHEMA)})
        ENVIRONMENTS[s.name] = cls


def start_all(say: Callable[[str], None]) -> list[threading.Thread]:
    """Start every registered server rollbook runs, each in a thread of its own (the resources server
    does at `rollbook serve`), so that one that cannot start says why there, in one line (`say`), and
    not only when a rollout first asks for it."""
    threads = []
    for cls in list(ENVIRONMENTS.values()):
        if isinstance(cls, type) and issubclass(cls, NemoGymEnvironment) and hasattr(cls, "process") \
                and cls.server.url is None and cls.server.port is not None:
            def start(process: GymProcess = cls.process) -> None:
                why = process.check()
                if why is not None:
                    s = process.server
                    say(f"nemo_gym.{s.name}: {s.module} cannot start: {why} (its log: ROLLBOOK_GYM_LOG; "
                        "install what it imports into NeMo Gym's Python, or fix the table)")
            t = threading.Thread(target=start, name=f"nemo-gym-{cls.server.name}", daemon=True)
            t.start()
            threads.append(t)
    return threads


def relayed(env: Environment) -> bool:
    return isinstance(env, NemoGymEnvironment)


def live_id(s: Any) -> dict[str, str]:
    """The live NeMo Gym session an event of a relayed session was applied in (none for the others)."""
    return {"live": s.live.live_id} if isinstance(s.live, Live) else {}


async def ensure_live(s: Any, append: Appender) -> Live:
    """The session's live NeMo Gym session, or a fresh one rebuilt from its record (one
    `session_replayed`). A restart-only server's lost session ends the attempt (`lost: session`), a
    replay that does not give back the recorded replies ends it as `replay_divergence`."""
    if s.live is not None:
        return s.live  # type: ignore[no-any-return]
    where = f"rollout {s.rollout_id} attempt {s.attempt}"
    if s.opened and not tool_replay.continues(s.env.server.state):
        raise AttemptLost(f"{where}: its restart-only NeMo Gym session is gone", rollout_id=s.rollout_id,
                          attempt=s.attempt, lost="session")
    key = (s.rollout_id, s.attempt)
    server = s.env.server
    if _rebuilds.get(key, 0) >= server.rebuild_attempts:
        # Rebuilt that many times and not one call got through: a server that dies on this session's
        # calls (or keeps dying) would otherwise be re-seeded and replayed for as long as callers ask.
        _rebuilds.pop(key, None)
        raise GymServerFailed(f"nemo_gym.{s.env.name}: {where}: its session was rebuilt {server.rebuild_attempts} "
                              "times and its server went away again each time", server=s.env.name, stage="rebuild",
                              rebuilds=server.rebuild_attempts)
    _rebuilds[key] = _rebuilds.get(key, 0) + 1
    t0 = time.perf_counter()
    try:
        live = await s.env.revive(s.task, list(s.state))
    except ReplayDivergence as exc:
        # In the log, for whoever called: NeMo Gym's own agent sees only its call refused.
        await append(s, SESSION_REPLAY_FAILED, {"reason": tool_replay.DIVERGENCE_REASON, "detail": exc.detail[:400]})
        raise AttemptLost(f"{where}: {exc.detail}", rollout_id=s.rollout_id, attempt=s.attempt,
                          lost="divergence", reason=tool_replay.DIVERGENCE_REASON) from exc
    except LiveGone as exc:
        raise ParticipantUnavailable(f"{s.env.name}: its NeMo Gym server cannot be reached: {exc}") from exc
    # What was sent again, exactly: a stateless server is seeded afresh and gets none of the record.
    sent = [c.get("tool_call") for c in s.state] if server.state == "replay" else []
    await append(s, SESSION_REPLAYED, {"live": live.live_id, "revision": s.revision, "seconds": time.perf_counter() - t0,
                                       "tool_calls": sent})
    s.live = live
    return live


# Per (rollout, attempt): rebuilds of its live session since a call last got through (ensure_live bounds them).
_rebuilds: dict[tuple[str, int], int] = {}


def _through(s: Any) -> None:
    _rebuilds.pop((s.rollout_id, s.attempt), None)


async def relay(s: Any, append: Appender, call: Callable[[Live], Awaitable[Any]]) -> Any:
    """`call(live)` on the session's live session; once more on a rebuilt one when the live session
    turns out to be gone (its server restarted)."""
    for tries in range(2):
        live = await ensure_live(s, append)
        try:
            out = await call(live)
        except LiveGone as exc:
            s.live = None
            if tries:
                raise ParticipantUnavailable(f"{s.env.name}: its NeMo Gym server cannot be reached: {exc}") from exc
        except ToolError:
            _through(s)  # the server answered: it is alive
            raise
        else:
            _through(s)
            return out
    raise AssertionError("unreachable")


async def relayed_verify(s: Any, append: Appender, trajectory: Trajectory, capture: str) -> float:
    """NeMo Gym's verify of the session. Only a rebuild of its live session takes the session's lock:
    a verify may be slow (a judge) and, being asked again after a restore, holds no checkpoint. A
    gymnasium server is not asked: its reward is the sum its recorded steps gave; nor is one its task's
    agent drives: its reward is what that agent's recorded verify gave."""
    if (await s.env.process.served())[1]:
        reward = tool_replay.rewards(s.state)
        if reward is None:
            raise GymServerFailed(f"nemo_gym.{s.env.name}: {s.env.server.module} speaks NeMo Gym's gymnasium protocol and "
                                  "was never stepped: its tasks need an agent that drives /reset and /step (NeMo Gym's "
                                  "gymnasium_agent, a [nemo_gym_agent] table)", server=s.env.name, stage="verify")
        return reward
    if s.env.driven(s.task):  # its agent's last verify: one asked again answers for the session as it is then
        verified = [c["reward"] for c in s.state if c.get("tool") == "verify" and c.get("reward") is not None]
        if not verified:
            raise GymServerFailed(f"nemo_gym.{s.env.name}: its agent {s.task.agent} drives {s.env.server.module} and never "
                                  "verified the session", server=s.env.name, stage="verify")
        return float(verified[-1])
    for tries in range(2):
        async with s.lock:
            live = await ensure_live(s, append)
        try:
            reward = float(await s.env.verify_live(live, s.task, trajectory, capture))
            _through(s)
            return reward
        except LiveGone as exc:
            if s.live is live:
                s.live = None
            if tries:
                raise ParticipantUnavailable(f"{s.env.name}: its NeMo Gym server cannot be reached: {exc}") from exc
    raise AssertionError("unreachable")


def stop_all() -> None:
    for cls in ENVIRONMENTS.values():
        if isinstance(cls, type) and issubclass(cls, NemoGymEnvironment) and hasattr(cls, "process"):
            cls.process.stop()


def _why(reply: Any) -> Any:
    """A verify reply as its refusal shows it: a masked one's failure first, not the echoed row."""
    if isinstance(reply, dict) and reply.get("mask_sample"):
        return {k: reply.get(k) for k in ("failure_kind", "failure_reason", "mask_sample")}
    return reply


def task_from_row(env: str, row: dict[str, Any], index: int) -> Task:
    """A NeMo Gym data row as a rollbook task bound to the configured environment `env`."""
    params = row.get("responses_create_params")
    if not isinstance(params, dict):
        raise InvalidRequest("a NeMo Gym data row needs responses_create_params")
    raw = params.get("input")
    if isinstance(raw, str):
        prompt = raw
    else:
        parts = [m.get("content") for m in raw or [] if isinstance(m, dict) and m.get("role") in ("system", "user")]
        prompt = "\n\n".join(p if isinstance(p, str) else json.dumps(p) for p in parts)
    task_id = str(row.get("id", index))
    return Task(env, task_id, prompt, {"row": row})

"""The one config file of rollbook (TOML): the database, the credentials, the four servers and a run.

    dsn = "postgresql://user:pw@host/db"    # optional: else ROLLBOOK_DSN, else the embedded server
    control_token = "..."                     # opens /rollbook/v1/control/* (framework, coordinator);
                                              # absent: ROLLBOOK_CONTROL_TOKEN
    data_token = "..."                        # opens every other route (servers, framework dispatch);
                                              # absent: ROLLBOOK_DATA_TOKEN

    [servers.model]                           # host defaults to 127.0.0.1
    port = 8101
    workers = 1                               # processes behind this address (any kind; apps/workers.py)
    backend = "scripted"                      # a registered generation backend (entry point group
                                              # rollbook.generation_backends): "scripted", or
                                              # "openai_compatible" with url, model, api_key
    policy_version = "step-0"                 # the version every call is stamped with until the framework
                                              # sets another (POST /rollbook/v1/control/policy_version)
    token_latency_s = 0.0
    token_store = "postgres"                  # or "filesystem" with token_store_root
    progress_s = 1.0                          # tokens in flight saved this often: the most a paused cut loses

    [servers.resources]
    port = 8102
    [servers.agent]
    port = 8103
    [servers.environment]
    port = 8104

    [sandbox]                                 # only with this table is the sandbox environment served;
                                              # the server must run as root to build its jails (docs/sandbox.md)
    cpu_s = 10                                # per process
    memory_mb = 512                           # address space per process
    max_processes = 64                        # per session
    disk_mb = 128                             # all a session writes, together (tmpfs: memory)
    uid_base = 200000                         # sessions run as uids uid_base .. uid_base + uids - 1
    uids = 1000
    output_bytes = 8000
    command_bytes = 65536
    timeout_s = 10.0                          # per command; past it the session ends
    idle_s = 1800.0                           # a shell unused this long is ended

    [limits]                                  # optional; every key has the default shown (docs/operations.md: "Bounds")
    connect_s = 10.0                          # calling another server or the upstream model: to connect
    reply_s = 900.0                           # ... the longest silence while its reply is awaited (a
                                              # generation, a tool call: keep it above sandbox timeout_s)
    work_s = 86400.0                          # ... the same for replies sent when an activation or an
                                              # episode ends (POST .../run, /run, /episodes)
    head_s = 15.0                             # serving: a request's head must arrive within this
    body_s = 60.0                             # ... and its body within this of its head
    max_connections = 512                     # ... open connections per server; past it 503, ask again
    pool_size = 5                             # database connections a process keeps open
    max_overflow = 5                          # ... and may open beyond them under load
    pool_timeout_s = 10.0                     # waiting for a free one; past it, database_unavailable (503)
    processes = 6                             # rollbook processes sharing the database (every worker and
                                              # instance of every server, `rollbook run`, commands); default:
                                              # one per configured server + 2. Each pool shrinks to fit
                                              # max_connections of the server between them all
    append_key_retention_s = 86400.0          # `rollbook db prune-keys` drops append keys older than this;
                                              # `rollbook db retain` drops only what is older than this
    retention_keep_checkpoints = 3            # `rollbook db retain` keeps the newest 3 published checkpoints
                                              # restorable (docs/operations.md#retention)

    [nemo_gym.gym_workplace]                  # a NeMo Gym resources server, unchanged, as the environment
                                              # `gym_workplace` (docs/nemo-gym.md)
    module = "resources_servers.workplace_assistant.app"
    state = "replay"                          # replay | stateless | restart_only; absent: restart_only
    python = "/path/to/Gym/.venv/bin/python"  # NeMo Gym's Python; absent: `rollbook nemo-gym install`'s
    paths = ["/path/to/Gym"]                  # put in front of its sys.path (your checkout)
    # url = "http://127.0.0.1:9000"           # or relay to a server you run yourself
    # port = 9001                             # where one rollbook starts listens; absent: a free port

    [nemo_gym_agent.simple]                   # a NeMo Gym agent, unchanged, for tasks that name it
                                              # (a task's "agent"; docs/agents.md)
    module = "responses_api_agents.simple_agent.app"
    continuation = "replay"                   # replay | restart_only; absent: restart_only
    # python, paths, url, port, config, config_file, start_timeout_s: as for [nemo_gym.NAME]

    [harness.smol]                            # a third-party harness, unchanged, in a sandbox session
                                              # for tasks that name it (needs [sandbox]; docs/agents.md)
    command = ["{python}", "-m", "smolagents.cli", "{prompt}", "--model-type", "OpenAIModel",
               "--model-id", "{model}", "--api-base", "{base_url}", "--api-key", "none"]
    requirements = ["smolagents[openai]==1.26.0"]   # installed once for the server's Python, bound read-only
    answer = "^Final answer: (.*)$"           # its output's last match is the answer; absent: the last line
    continuation = "replay"                   # replay | restart_only; absent: restart_only
    # env = {HF_HUB_OFFLINE = "1"}; paths = [...] bound read-only; timeout_s, cpu_s, memory_mb override [sandbox]

    [telemetry]                               # optional; GET /metrics is always served (control credential)
    otlp_endpoint = "http://127.0.0.1:4318/v1/traces"   # spans go here (OTLP over HTTP); absent: no spans

    [run]
    run_id = "eval-1"
    tasks = "tasks.jsonl"                     # one task per line: {"env", "task_id", "prompt", "params"}
    checkpoint_every_s = 60
    checkpoint_mode = "online"                # or "paused": docs/protocol.md, "Online or paused"
    concurrency = 16
    max_steps = 12

A file that holds a credential (either token, a DSN with a password, a model `api_key`) must be
open to its owner alone (`chmod 600`): `load` refuses it otherwise, and `write` creates it so.
docs/secrets.md says where every credential lives.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from adapters.http_client import PeerTimeouts
from adapters.http_server import ServerLimits
from adapters.pg_pool import fit_pool, server_connection_limit
from adapters.postgres import DEFAULT_KEY_RETENTION_S, MIN_KEY_RETENTION_S, PoolLimits
from adapters.retention import DEFAULT_KEEP_CHECKPOINTS
from adapters.secret_files import check_private, write_private
from engine.errors import ConfigError
from engine.membership import DEFAULT_LEASE_S
from engine.tool_replay import declared
from participants.agent.external import MODEL_SERVER, RESOURCES_SERVER, GymAgent
from participants.agent.harness import Harness
from participants.base.guard import Credentials
from participants.environments import enabled_environments, registered_environments
from participants.environments.gymnasium import GYMNASIUM_AGENT
from participants.environments.nemo_gym_relay import MODEL_URL, GymServer, given
from participants.environments.sandbox import SandboxLimits
from participants.model.backends import backend_names
from participants.model.progress import PROGRESS_S

Kind = Literal["environment", "model", "agent", "resources"]
KINDS: tuple[Kind, ...] = ("environment", "model", "agent", "resources")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServerConfig(Strict):
    host: str = "127.0.0.1"  # how the others reach this server
    bind: str | None = None  # the address it listens on when not `host` (e.g. 0.0.0.0 in a container)
    port: int = Field(ge=0, le=65535)
    # Processes behind this one address: a front at `port` routes each request to the worker that holds
    # its session (apps/workers.py; docs/operations.md, "Workers").
    workers: int = Field(default=1, ge=1, le=64)
    # model server only
    backend: str = "scripted"  # checked against the registry below, so a plugin's backend needs no edit here
    url: str | None = None
    model: str | None = None
    api_key: str | None = None
    policy_version: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:+-]*$", max_length=128)
    latency_s: float = 0.0
    token_latency_s: float = 0.0
    token_store: Literal["postgres", "filesystem"] = "postgres"
    token_store_root: str | None = None
    # How often the tokens of the generations in flight are saved (participants/model/progress.py): a
    # paused checkpoint cuts a generation at its last save, so this is the most generation a cut sends
    # back to be made again; shorter costs the model server more CPU (never over a fifth of it).
    progress_s: float = Field(default=PROGRESS_S, gt=0, le=60)

    @field_validator("backend")
    @classmethod
    def _registered_backend(cls, name: str) -> str:
        names = backend_names()
        if name not in names:
            raise ValueError(f"{name!r} is not a registered generation backend (one of {', '.join(names)})")
        return name

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


class RunConfig(Strict):
    run_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=64)
    tasks: str
    checkpoint_every_s: float = 60.0
    # online: the cut comes from the log and no server pauses (this run's own state is the log);
    # paused: every server parks at a boundary first (docs/protocol.md says when to choose which)
    checkpoint_mode: Literal["online", "paused"] = "online"
    concurrency: int = 16
    max_steps: int = 12
    seed: int = 0


class SandboxConfig(Strict):
    user: str = "nobody"  # accepted from older files; sessions now run as uids of their own
    cpu_s: int = Field(default=10, ge=1, le=3600)
    memory_mb: int = Field(default=512, ge=16, le=1 << 20)
    max_processes: int = Field(default=64, ge=1, le=1 << 16)
    file_mb: int = Field(default=64, ge=1, le=1 << 20)
    output_bytes: int = Field(default=8000, ge=256, le=1 << 20)
    timeout_s: float = Field(default=10.0, gt=0, le=3600)
    # Below 1000 are the system's own accounts; a uid of the range that an account owns is skipped.
    uid_base: int = Field(default=200_000, ge=1000, le=(1 << 32) - 2)
    uids: int = Field(default=1000, ge=1, le=1 << 20)
    disk_mb: int = Field(default=128, ge=1, le=1 << 20)
    command_bytes: int = Field(default=65_536, ge=256, le=1 << 24)
    idle_s: float = Field(default=1800.0, gt=0, le=7 * 86400)
    cpus: float = Field(default=1.0, gt=0, le=1024)
    # Where the memory, pids and cpu cgroup v1 hierarchies are mounted; a session never runs unbounded.
    cgroup_root: str = "/sys/fs/cgroup"
    state_dir: str = "/run/rollbook"  # uid claims: root's alone, 0700

    @model_validator(mode="after")
    def _uids_fit(self) -> SandboxConfig:
        if self.uid_base + self.uids > (1 << 32) - 1:  # (uid_t)-1 means "no change" to setuid
            raise ValueError("uid_base + uids must stay below 4294967295")
        return self

    def limits(self) -> SandboxLimits:
        return SandboxLimits(**self.model_dump())


class NemoGymConfig(Strict):
    """One NeMo Gym resources server (a `[nemo_gym.<name>]` table): the environment `<name>`."""

    module: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$", max_length=300)
    state: Literal["replay", "stateless", "restart_only"] | None = None  # none declared: restart_only
    url: str | None = Field(default=None, pattern=r"^https?://[^\s/?#]+/?$", max_length=2000)
    python: str | None = None
    paths: list[str] = Field(default_factory=list)
    port: int | None = Field(default=None, ge=1, le=65535)
    start_timeout_s: float = Field(default=180.0, gt=0, le=3600)
    call_timeout_s: float = Field(default=120.0, gt=0, le=3600)
    # The server's own config fields over its configs/*.yaml entry (validated by its config class when it starts).
    config: dict[str, Any] = Field(default_factory=dict)
    config_file: str | None = Field(default=None, max_length=1000)  # which configs/*.yaml, relative to its folder
    rebuild_attempts: int = Field(default=3, ge=1, le=100)
    # Model servers its config names, at URLs you give (a judge elsewhere: genrm_compare's GenRM model):
    # the name its config refers to -> http://host:port. Their calls are not rollbook's to record.
    models: dict[str, str] = Field(default_factory=dict)

    @field_validator("models")
    @classmethod
    def _model_urls(cls, models: dict[str, str]) -> dict[str, str]:
        for name, url in models.items():
            if not re.fullmatch(r"[A-Za-z0-9_.-]{1,128}", name) or not MODEL_URL.fullmatch(url):
                raise ValueError(f"{name[:80]!r} = {url[:80]!r}: a model server's name and its http://host:port "
                                 "(NeMo Gym calls a named server at a host and port, over plain HTTP)")
        return models


class NemoGymAgentConfig(Strict):
    """One NeMo Gym agent (a `[nemo_gym_agent.<name>]` table), run by the agent server for the tasks
    that name it. Its model and resources servers are rollbook's (per attempt, by its capture path)."""

    module: str = Field(default="responses_api_agents.simple_agent.app",
                        pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$", max_length=300)
    # replay: after a crash or at a restore it runs again from its episode's start, answered from the
    # log (engine.agent_replay); restart_only: its rollout starts over from its input.
    continuation: Literal["replay", "restart_only"] = "restart_only"
    # responses: rollbook sends the activation to its `/v1/responses` and seeds and verifies the session
    # itself (simple_agent); run: it sends the row to its `/run`, where the agent drives its resources
    # server itself (gymnasium_agent's /reset and /step). Absent: run for NeMo Gym's gymnasium_agent.
    drive: Literal["responses", "run"] | None = None
    url: str | None = Field(default=None, pattern=r"^https?://[^\s/?#]+/?$", max_length=2000)
    python: str | None = None
    paths: list[str] = Field(default_factory=list)
    port: int | None = Field(default=None, ge=1, le=65535)
    start_timeout_s: float = Field(default=180.0, gt=0, le=3600)
    config: dict[str, Any] = Field(default_factory=dict)
    config_file: str | None = Field(default=None, max_length=1000)

    @property
    def drives(self) -> Literal["responses", "run"]:
        if self.drive is not None:
            return self.drive
        return "run" if self.module == GYMNASIUM_AGENT else "responses"


class HarnessConfig(Strict):
    """One third-party harness (a `[harness.<name>]` table), run unchanged in a sandbox session of
    its own for each activation of a task that names it (participants/agent/harness.py)."""

    command: list[str] = Field(min_length=1)
    requirements: list[str] = Field(default_factory=list)
    paths: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    answer: str | None = Field(default=None, max_length=1000)
    continuation: Literal["replay", "restart_only"] = "restart_only"
    # Over the [sandbox] table's: a harness's run is one command, and longer than a tool call.
    timeout_s: float = Field(default=600.0, gt=0, le=86400)
    cpu_s: int = Field(default=600, ge=1, le=86400)
    memory_mb: int = Field(default=1024, ge=64, le=1 << 20)

    @field_validator("answer")
    @classmethod
    def _regex(cls, answer: str | None) -> str | None:
        import re

        if answer is not None:
            try:
                re.compile(answer)
            except re.error as exc:
                raise ValueError(f"answer is no regular expression: {exc}") from None
        return answer

    @field_validator("paths")
    @classmethod
    def _absolute(cls, paths: list[str]) -> list[str]:
        for path in paths:
            if not path.startswith("/") or ".." in path.split("/"):
                raise ValueError(f"{path!r}: a path bound into the jail must be absolute, without ..")
        return paths


class LimitsConfig(Strict):
    """Every bound of a process on what it waits for and what it holds (the [limits] table)."""

    connect_s: float = Field(default=10.0, gt=0, le=3600)
    reply_s: float = Field(default=900.0, gt=0, le=7 * 86400)
    work_s: float = Field(default=86400.0, gt=0, le=30 * 86400)
    head_s: float = Field(default=15.0, gt=0, le=3600)
    body_s: float = Field(default=60.0, gt=0, le=3600)
    max_connections: int = Field(default=512, ge=8, le=1 << 20)
    pool_size: int = Field(default=5, ge=1, le=1000)
    max_overflow: int = Field(default=5, ge=0, le=1000)
    pool_timeout_s: float = Field(default=10.0, gt=0, le=3600)
    processes: int | None = Field(default=None, ge=1, le=100_000)
    append_key_retention_s: float = Field(default=DEFAULT_KEY_RETENTION_S, ge=MIN_KEY_RETENTION_S)
    retention_keep_checkpoints: int = Field(default=DEFAULT_KEEP_CHECKPOINTS, ge=1, le=1_000_000)
    # How long a server instance stays a member without renewing (engine/membership.py): a SIGKILLed
    # instance holds up checkpoints and keeps its work this long, unless one restarts at its address.
    instance_lease_s: float = Field(default=DEFAULT_LEASE_S, ge=0.5, le=3600)

    def peer_timeouts(self) -> PeerTimeouts:
        return PeerTimeouts(connect_s=self.connect_s, reply_s=self.reply_s, work_s=self.work_s)

    def server_limits(self) -> ServerLimits:
        return ServerLimits(head_s=self.head_s, body_s=self.body_s, max_connections=self.max_connections)

    def pool(self) -> PoolLimits:
        return PoolLimits(size=self.pool_size, overflow=self.max_overflow, timeout_s=self.pool_timeout_s)


class TelemetryConfig(Strict):
    # The only address spans are sent to: from this file, never from a request.
    otlp_endpoint: str | None = Field(default=None, pattern=r"^https?://[^\s/?#]+(/[^\s]*)?$", max_length=2000)


class Config(Strict):
    dsn: str | None = None
    # Never in a repr or a log line: pydantic leaves repr=False fields out.
    control_token: str = Field(min_length=8, repr=False)
    data_token: str = Field(min_length=8, repr=False)
    servers: dict[Kind, ServerConfig]
    sandbox: SandboxConfig | None = None  # absent: the sandbox environment is off
    telemetry: TelemetryConfig | None = None  # absent: metrics only, no spans exported
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    run: RunConfig | None = None
    nemo_gym: dict[str, NemoGymConfig] = Field(default_factory=dict)
    nemo_gym_agent: dict[str, NemoGymAgentConfig] = Field(default_factory=dict)
    harness: dict[str, HarnessConfig] = Field(default_factory=dict)

    @field_validator("nemo_gym_agent")
    @classmethod
    def _agent_names(cls, agents: dict[str, NemoGymAgentConfig]) -> dict[str, NemoGymAgentConfig]:
        import re

        for name in agents:
            if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]{0,63}", name):
                raise ValueError(f"nemo_gym_agent.{name}: the name must be letters, digits, _ and -, starting with a letter")
        return agents

    @field_validator("nemo_gym")
    @classmethod
    def _gym_names(cls, servers: dict[str, NemoGymConfig]) -> dict[str, NemoGymConfig]:
        import re

        for name in servers:
            if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]{0,63}", name) or name in registered_environments():
                raise ValueError(f"nemo_gym.{name}: the name must be a new environment name (letters, digits, _ -)")
        return servers

    @model_validator(mode="after")
    def _distinct_tokens(self) -> Config:
        if self.control_token == self.data_token:
            raise ValueError("control_token and data_token must differ: each opens one plane")
        if self.sandbox is not None and self.limits.reply_s <= self.sandbox.timeout_s:
            # The agent would give up on a tool call the sandbox is still allowed to run.
            raise ValueError(f"limits.reply_s ({self.limits.reply_s:g}) must exceed sandbox.timeout_s "
                             f"({self.sandbox.timeout_s:g})")
        if self.harness and self.sandbox is None:
            raise ValueError(f"harness.{next(iter(self.harness))}: a harness runs in a sandbox session; add a [sandbox] table")
        for name in self.harness:
            if name in self.nemo_gym_agent or not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]{0,63}", name):
                raise ValueError(f"harness.{name}: the name must be letters, digits, _ and -, and no other agent's")
        return self

    def url(self, kind: Kind) -> str:
        return self.servers[kind].base_url

    @property
    def credentials(self) -> Credentials:
        return Credentials(self.control_token, self.data_token)

    def gym_servers(self, port: Callable[[], int] | None = None) -> list[GymServer]:
        """The configured NeMo Gym servers; `port` hands a free one to each that rollbook starts
        without a port of its own (the resources server does; the others never start one). Each is
        told rollbook's model server, which a model server its config names and nothing defines (a
        judge) resolves to, with NeMo Gym's observability on so that its calls name their rollout."""
        from apps.nemo_gym_install import installed_python

        peers = {**self._gym_peers(), "observability_enabled": True}
        driven_by = tuple(sorted(name for name, a in self.nemo_gym_agent.items() if a.drives == "run"))
        out = []
        for name, g in self.nemo_gym.items():
            python = g.python or (None if g.url else str(installed_python()))
            chosen = g.port or (port() if port is not None and g.url is None else None)
            out.append(GymServer(name, g.module, declared(g.state), g.url, python, tuple(g.paths), chosen,
                                 g.start_timeout_s, g.call_timeout_s, json.dumps(g.config, sort_keys=True),
                                 g.config_file, g.rebuild_attempts, json.dumps({**peers, **given(g.models)}, sort_keys=True),
                                 driven_by=driven_by))
        return out

    def _gym_peers(self) -> dict[str, Any]:
        """rollbook's model and resources servers as entries of a NeMo Gym config (addresses carrying the
        data credential: NeMo Gym's client sends no header)."""
        host = f"rollbook:{self.data_token}@{{}}"
        peers = {}
        if (model := self.servers.get("model")) is not None:  # a file may configure some kinds only
            peers[MODEL_SERVER] = {"responses_api_models": {"rollbook": {
                "entrypoint": "rollbook", "host": host.format(model.host), "port": model.port}}}
        if (resources := self.servers.get("resources")) is not None:
            peers[RESOURCES_SERVER] = {"resources_servers": {"rollbook": {
                "entrypoint": "rollbook", "domain": "other", "host": host.format(resources.host), "port": resources.port}}}
        return peers

    def gym_agents(self, port: Callable[[], int] | None = None) -> dict[str, GymAgent]:
        """The configured NeMo Gym agents, each told that its model and resources servers are rollbook's."""
        from apps.nemo_gym_install import installed_python

        servers = self._gym_peers()
        refs = {"model_server": {"type": "responses_api_models", "name": MODEL_SERVER},
                "resources_server": {"type": "resources_servers", "name": RESOURCES_SERVER}}
        out = {}
        for name, a in self.nemo_gym_agent.items():
            python = a.python or (None if a.url else str(installed_python()))
            chosen = a.port or (port() if port is not None and a.url is None else None)
            # An agent driven through its `/run` names its rollout in its calls' paths only where NeMo
            # Gym's observability is on (its ServerClient then prefixes /ng-rollout/<capture>).
            named = {**servers, "observability_enabled": True} if a.drives == "run" else servers
            server = GymServer(name, a.module, url=a.url, python=python, paths=tuple(a.paths), port=chosen,
                               start_timeout_s=a.start_timeout_s, overrides=json.dumps({**refs, **a.config}, sort_keys=True),
                               config_file=a.config_file, servers=json.dumps(named, sort_keys=True), table="nemo_gym_agent")
            out[name] = GymAgent(server, a.continuation, a.drives)
        return out

    def harnesses(self) -> dict[str, Harness]:
        assert self.sandbox is not None or not self.harness
        out = {}
        for name, h in self.harness.items():
            base = self.sandbox.model_dump() if self.sandbox is not None else {}
            limits = SandboxLimits(**{**base, "timeout_s": h.timeout_s, "cpu_s": h.cpu_s, "memory_mb": h.memory_mb})
            out[name] = Harness(tuple(h.command), limits, h.continuation, tuple(h.requirements), tuple(h.paths),
                                dict(h.env), h.answer)
        return out

    def environments(self) -> frozenset[str]:
        return enabled_environments(sandbox=self.sandbox is not None) | frozenset(self.nemo_gym)

    @property
    def processes(self) -> int:
        """How many rollbook processes share the database: [limits] processes, else one per configured
        server process (each worker, and the front of a server with workers), `rollbook run` and one command."""
        return self.limits.processes or sum(s.workers + (s.workers > 1) for s in self.servers.values()) + 2

    def database_pool(self, dsn: str) -> PoolLimits:
        """This process's pool: [limits] pool_size + max_overflow, shrunk so that `processes` of them
        fit the server's max_connections (read from the server)."""
        return fit_pool(self.limits.pool(), self.processes, *server_connection_limit(dsn))


def load(path: str | Path) -> Config:
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found", "pass --config the path of your rollbook.toml") from None
    except IsADirectoryError:
        raise ConfigError(f"config path {path} is a directory", "pass --config the path of your rollbook.toml") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML ({exc})", "fix the syntax at that line") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text ({exc.reason})", "save it as UTF-8 TOML") from None
    if _holds_a_secret(raw):
        check_private(path, "config file")
    for key, env in (("control_token", "ROLLBOOK_CONTROL_TOKEN"), ("data_token", "ROLLBOOK_DATA_TOKEN")):
        # A file with no credential in it may be shared (a container's mounted config); the process's
        # environment, which only its own user can read, then holds them.
        if key not in raw and os.environ.get(env):
            raw[key] = os.environ[env]
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        raise config_problem(exc, path) from None


def _holds_a_secret(raw: dict[str, object]) -> bool:
    if "control_token" in raw or "data_token" in raw:
        return True
    dsn = raw.get("dsn")
    if isinstance(dsn, str) and _dsn_has_password(dsn):
        return True
    servers = raw.get("servers")
    return isinstance(servers, dict) and any(isinstance(s, dict) and s.get("api_key") for s in servers.values())


def _dsn_has_password(dsn: str) -> bool:
    from urllib.parse import urlsplit

    if "password" in dsn.lower():  # ?password=... or a key=value DSN's password=...
        return True
    try:
        return bool(urlsplit(dsn).password)
    except ValueError:
        return True  # unreadable: assume the worst


def config_problem(exc: ValidationError, path: str | Path) -> ConfigError:
    """The first problem pydantic found, said the way a person fixes it."""
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "(top level)"
    if err["type"] == "extra_forbidden":
        return ConfigError(f"unknown key {where!r} in {path}",
                           "remove it or fix its spelling (apps/config.py lists every key)")
    if err["type"] == "missing":
        return ConfigError(f"missing key {where!r} in {path}", "add it (apps/config.py lists every key)")
    return ConfigError(f"bad value for {where!r} in {path}: {err['msg']}",
                       "fix it (apps/config.py documents every key)")


def write(config: Config, path: str | Path) -> None:
    """Write a config back as TOML (the demo writes one for the servers it starts), owner-only (0600)
    from its first byte: it holds both credentials."""
    lines = []
    if config.dsn:
        lines.append(f"dsn = {_q(config.dsn)}")
    lines.append(f"control_token = {_q(config.control_token)}")
    lines.append(f"data_token = {_q(config.data_token)}")
    for kind, s in config.servers.items():
        lines.append(f"\n[servers.{kind}]")
        for key, value in s.model_dump(exclude_defaults=True).items():
            lines.append(f"{key} = {_q(value) if isinstance(value, str) else value}")
    if config.sandbox:
        lines.append("\n[sandbox]")
        for key, value in config.sandbox.model_dump().items():
            lines.append(f"{key} = {_q(value) if isinstance(value, str) else value}")
    limits = config.limits.model_dump(exclude_defaults=True)
    if limits:
        lines.append("\n[limits]")
        lines.extend(f"{key} = {value}" for key, value in limits.items())
    if config.telemetry and config.telemetry.otlp_endpoint:
        lines.append(f"\n[telemetry]\notlp_endpoint = {_q(config.telemetry.otlp_endpoint)}")
    for name, g in config.nemo_gym.items():
        lines.append(f"\n[nemo_gym.{name}]")
        for key, value in g.model_dump(exclude_defaults=True).items():
            lines.append(f"{key} = {_toml(value)}")
    for name, a in config.nemo_gym_agent.items():
        lines.append(f"\n[nemo_gym_agent.{name}]")
        for key, value in a.model_dump(exclude_defaults=True).items():
            lines.append(f"{key} = {_toml(value)}")
    for name, h in config.harness.items():
        lines.append(f"\n[harness.{name}]")
        for key, value in h.model_dump(exclude_defaults=True).items():
            lines.append(f"{key} = {_toml(value)}")
    if config.run:
        lines.append("\n[run]")
        for key, value in config.run.model_dump().items():
            lines.append(f"{key} = {_q(value) if isinstance(value, str) else value}")
    write_private(path, "\n".join(lines) + "\n")


def _toml(value: Any) -> str:
    """A value as TOML (inline tables for a server's own config); JSON's strings are TOML's basic strings."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return _q(value)
    if isinstance(value, int | float):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_q(str(k))} = {_toml(v)}" for k, v in value.items()) + "}"
    raise ConfigError(f"{value!r} has no TOML form", "leave it out of the table (TOML has no null)")


def _q(s: str) -> str:
    # A JSON string is a TOML basic string, once DEL (which JSON leaves raw and TOML does not) is escaped.
    return json.dumps(s, ensure_ascii=False).replace("\x7f", "\\u007f")

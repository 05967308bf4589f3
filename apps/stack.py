"""The four servers of one process generation, in process, sharing one database.

Model, resources, agent and environment each run as a real aiohttp server on 127.0.0.1 with its
own event-store connection; the only stand-in is the model itself (a scripted backend, which a
test may subclass to hold a call). A test that "crashes" closes a stack without any handover and
starts a fresh one on the same database.

The database is PostgreSQL (a DSN) or a log in memory (`MemoryBacking`: adapters.memory_store and
a MemoryTokenStore), which outlives the stacks started on it as a database would. The tests, the
environment conformance suite (apps.conformance) and the benchmarks all start their servers here.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
from aiohttp.test_utils import TestServer

from adapters.http_client import JsonClient
from adapters.memory_store import MemoryLog
from adapters.participant_client import HttpParticipant
from adapters.postgres import PostgresEventStore
from adapters.token_store import MemoryTokenStore, PostgresTokenStore
from engine.checkpoint import ParticipantStore
from engine.coordinator import CheckpointStore, Coordinator
from engine.events import RecordedEvent
from engine.log import EventStore
from participants.agent.app import build_agent_app
from participants.agent.server import AgentParticipant
from participants.base.app import PARTICIPANT
from participants.base.guard import Credentials
from participants.base.participant import Participant
from participants.environment.app import build_environment_app
from participants.environments import enabled_environments
from participants.environments.base import Task
from participants.environments.sandbox import SandboxLimits
from participants.model.app import build_model_app
from participants.model.backends.scripted import ScriptedBackend
from participants.model.calls import TokenStore
from participants.resources.app import build_resources_app

CREDS = Credentials(control="stack-control-secret", data="stack-data-secret")
TOKEN = CREDS.control  # the coordinator's
SEED = 7  # the scripted policy's seed: the same replies every run


class Store(ParticipantStore, CheckpointStore, Protocol):
    """What a server and a coordinator need of storage: both stores implement it."""

    async def close(self) -> None: ...


class Tokens(TokenStore, Protocol):
    async def snapshot(self, checkpoint_id: str, blob_ids: list[str], parent: dict[str, Any] | None = None) -> dict[str, Any]: ...

    async def validate(self, ref: dict[str, Any], checkpoint_id: str, deep: bool = False) -> None: ...

    async def close(self) -> None: ...


@dataclass
class MemoryBacking:
    """The database of stacks that need no PostgreSQL: one log and one token store in memory."""

    log: MemoryLog = field(default_factory=MemoryLog)
    token_store: MemoryTokenStore = field(default_factory=MemoryTokenStore)

    def store(self, writer: str) -> Store:
        return self.log.store(writer)

    def tokens(self) -> Tokens:
        return self.token_store

    def model_tokens(self, model_store: Store) -> Tokens:
        return self.token_store


@dataclass(frozen=True)
class PostgresBacking:
    dsn: str

    def store(self, writer: str) -> Store:
        return PostgresEventStore.connect(self.dsn, writer=writer)

    def tokens(self) -> Tokens:
        return PostgresTokenStore(self.dsn)

    def model_tokens(self, model_store: Store) -> Tokens:
        # As `rollbook serve model` builds it: the blobs of a call ride in the append of its outcome.
        return PostgresTokenStore(model_store)  # type: ignore[arg-type]


Backing = MemoryBacking | PostgresBacking


def backing_of(database: str | Backing) -> Backing:
    return PostgresBacking(database) if isinstance(database, str) else database


@dataclass
class Stack:
    servers: dict[str, TestServer]
    stores: list[Store]
    tokens: Tokens
    backend: ScriptedBackend
    session: aiohttp.ClientSession
    client: JsonClient = field(default_factory=lambda: JsonClient(CREDS.data))  # the framework's dispatch
    control_client: JsonClient = field(default_factory=lambda: JsonClient(CREDS.control))

    def url(self, kind: str) -> str:
        return str(self.servers[kind].make_url("")).rstrip("/")

    def participant(self, kind: str) -> Participant:
        return self.servers[kind].app[PARTICIPANT]

    def coordinator(self, store: CheckpointStore) -> Coordinator:
        return Coordinator(store, [HttpParticipant(k, k, self.url(k), TOKEN, self.session) for k in self.servers])

    async def episode(self, task: Task, rollout_id: str, seed: int = SEED) -> dict[str, Any]:
        return await self.client.post(f"{self.url('environment')}/episodes",
                                      {"rollout_id": rollout_id, "task": task.to_json(), "seed": seed})

    async def wait_finished(self, rollout_id: str, timeout: float = 30.0) -> dict[str, Any]:
        stop = time.monotonic() + timeout
        while time.monotonic() < stop:
            status = await self.client.get(f"{self.url('environment')}/episodes/{rollout_id}")
            if status["status"] in ("finished", "failed"):
                return status
            await asyncio.sleep(0.05)
        raise AssertionError(f"episode {rollout_id} did not finish: {status}")

    async def close(self) -> None:
        # Callers first, as a crash takes them: nothing they hold may land afterwards.
        for kind in ("environment", "agent", "model", "resources"):
            await self.servers[kind].close()
        for s in self.stores:
            await s.close()
        await self.tokens.close()
        if hasattr(self.backend, "close"):  # an upstream backend holds an HTTP session
            await self.backend.close()
        await self.client.close()
        await self.control_client.close()
        await self.session.close()


async def start_stack(
    database: str | Backing, tag: str, backend: ScriptedBackend, agent_cls: type[AgentParticipant] = AgentParticipant
) -> Stack:
    """The four servers on `database` (a PostgreSQL DSN, or a MemoryBacking)."""
    backing = backing_of(database)
    stores: list[Store] = []

    def store(kind: str) -> Store:
        stores.append(backing.store(f"{kind}-{tag}"))
        return stores[-1]

    tokens = backing.tokens()
    servers: dict[str, TestServer] = {}

    async def serve(kind: str, app: Any) -> str:
        srv = TestServer(app, host="127.0.0.1")
        await srv.start_server(shutdown_timeout=1.0)
        servers[kind] = srv
        return str(srv.make_url("")).rstrip("/")

    model_store = store("model")
    model = await serve("model", build_model_app(model_store, backend, backing.model_tokens(model_store), CREDS,
                                                 f"model-{tag}"))
    resources = await serve("resources", build_resources_app(store("resources"), CREDS, f"resources-{tag}",
                                                             sandbox=SandboxLimits()))
    agent = await serve("agent", build_agent_app(store("agent"), CREDS, model, resources, f"agent-{tag}", agent_cls))
    await serve("environment", build_environment_app(store("environment"), CREDS, agent, resources, f"environment-{tag}",
                                                     environments=enabled_environments(sandbox=True)))
    return Stack(servers, stores, tokens, backend, aiohttp.ClientSession())


# ---- reading the log --------------------------------------------------------------------------


async def all_events(store: EventStore) -> list[RecordedEvent]:
    """The whole log, in pages."""
    out: list[RecordedEvent] = []
    while batch := await store.read_all(out[-1].position if out else 0, 1000):
        out += batch
    return out


def of(events: list[RecordedEvent], kind: str, attempt: int | None = None) -> list[RecordedEvent]:
    return [e for e in events if e.kind == kind and (attempt is None or e.attempt == attempt)]


def turn_of(call_id: str) -> int:
    return int(call_id.rsplit(".t", 1)[1])

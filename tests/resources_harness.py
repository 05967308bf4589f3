"""One resources server over real HTTP and the requests tests send it: what the resources tests share."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer

from adapters.memory_store import MemoryEventStore
from apps.stack import Backing, backing_of
from engine.attempts import ATTEMPT_STARTED
from engine.checkpoint import Cut, committed_event, make_cut
from engine.events import AppendRequest, NewEvent
from engine.identity import agent_stream, rollout_stream, session_stream
from engine.phases import checkpoint_started
from participants.base.app import PARTICIPANT
from participants.base.guard import Credentials
from participants.base.wire import CONTROL
from participants.environments.sandbox import SandboxLimits
from participants.environments.tasks import make_task
from participants.resources.app import build_resources_app
from participants.resources.server import ResourcesParticipant

CREDS = Credentials(control="res-control-token", data="res-data-token")
AUTH = {"Authorization": f"Bearer {CREDS.control}"}
DATA = {"Authorization": f"Bearer {CREDS.data}"}
Served = tuple[aiohttp.ClientSession, ResourcesParticipant]


@asynccontextmanager
async def serving(database: str | Backing, writer: str) -> AsyncIterator[Served]:
    """One resources server process: its own store (connections) and its own memory."""
    store = backing_of(database).store(writer)
    app = build_resources_app(store, CREDS, sandbox=SandboxLimits())
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    http = aiohttp.ClientSession(base_url=str(server.make_url("")))
    try:
        yield http, app[PARTICIPANT]
    finally:
        await http.close()
        await server.close()
        await store.close()


def prefix(rid: str, attempt: int) -> str:
    return f"/rollouts/{rid}/attempts/{attempt}"


async def call(http: aiohttp.ClientSession, method: str, path: str, body: Any = None,
               headers: dict[str, str] | None = None) -> tuple[int, Any]:
    # The data credential unless the headers name another Authorization (the control plane's, or none: "").
    sent = {k: v for k, v in {**DATA, **(headers or {})}.items() if v != ""}
    async with http.request(method, path, json=body, headers=sent) as resp:
        return resp.status, await resp.json()


async def control(http: aiohttp.ClientSession, op: str, ck: str = "ck1", **extra: Any) -> tuple[int, Any]:
    return await call(http, "POST", f"{CONTROL}/{op}", {"checkpoint_id": ck, "deadline": time.time() + 30, **extra}, AUTH)


async def start(store: MemoryEventStore, rid: str, attempt: int = 0) -> None:
    await store.append(AppendRequest((NewEvent(rollout_stream(rid), ATTEMPT_STARTED, {"parent_attempt": None}, rid, attempt),)))


async def open_session(http: aiohttp.ClientSession, rid: str, env: str, seed: int, attempt: int = 0) -> dict[str, Any]:
    task = make_task(env, seed)
    status, reply = await call(http, "POST", f"{prefix(rid, attempt)}/session", {"env": env, "task": task.to_json()})
    assert status == 200, reply
    return reply


async def tool(http: aiohttp.ClientSession, rid: str, name: str, arguments: dict[str, Any] | None = None,
               attempt: int = 0) -> tuple[int, Any]:
    return await call(http, "POST", f"{prefix(rid, attempt)}/tools/{name}", {"arguments": arguments or {}})


async def state(http: aiohttp.ClientSession, rid: str, attempt: int = 0) -> tuple[int, Any]:
    return await call(http, "GET", f"{prefix(rid, attempt)}/state")


async def kinds(store: MemoryEventStore, stream: str) -> list[str]:
    return [e.kind for e in await store.read_stream(stream)]


def email_seed() -> int:
    """A workplace task whose goal is one sent email, so a test can pass it in one call."""
    return next(s for s in range(100) if make_task("workplace", s).params["kind"] in ("email_manager", "email_contact"))


async def checkpoint(store: MemoryEventStore, ck: str, revisions: dict[str, int], attempt: int = 0) -> Cut:
    """An agent boundary per rollout (with the session revision it saw), then a committed cut."""
    for rid, rev in revisions.items():
        await store.append(AppendRequest((NewEvent(agent_stream(rid, attempt), "agent_boundary",
                                                   {"revisions": {session_stream(rid, attempt): rev}}, rid, attempt),)))
    await store.append(AppendRequest((checkpoint_started(ck),)))
    cut = await make_cut(store, ck, scope=[(rid, attempt) for rid in revisions], restarts=[])
    await store.append(AppendRequest((committed_event(cut),)))
    return cut

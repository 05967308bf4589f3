"""How far a newcomer walks to follow one request: the files a server's code runs through, counted.

Two walks, both on the four servers in one process (apps.stack, a log in memory, the scripted model):

- NeMo Gym's `POST /run` on the environment server, from the request until its reply (its reward
  recorded), counting only the environment server's own work;
- one model call (`/v1/chat/completions` on an attempt's route) on the model server, the first the
  agent makes in that episode.

Every function call the server's code makes into a file of the runtime packages (engine/, participants/,
adapters/) is one step; a step into another file than the one before is a move. A coroutine resumed
after an await is not a new step. Reported twice: the whole walk, and the walk outside the log's
drivers (`STORE`: what runs inside an append or a read is the store's, the same for every server). The server a call belongs to is a context variable each app's
middleware sets, which the tasks a handler spawns inherit. Nothing is timed.

    .venv/bin/python -m benchmarks.walks
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import FrameType
from typing import Any

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = tuple(str(ROOT / p) + "/" for p in ("engine", "participants", "adapters"))
# The log's drivers: behind the engine's store protocol, where a reader of a server stops (an append is
# one call to them, whichever driver serves it). Counted apart, so the walk is the same on either store.
STORE = tuple(str(ROOT / "adapters" / f) for f in ("memory_store.py", "postgres.py", "pg_projections.py",
                                                   "pg_reads.py", "pg_snapshots.py", "token_store.py"))
SERVER: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar("server", default=None)
_GENERATORS = inspect.CO_COROUTINE | inspect.CO_GENERATOR | inspect.CO_ASYNC_GENERATOR


class Trace:
    def __init__(self) -> None:
        self.steps: dict[tuple[str, int], list[str]] = {}
        self.outside_store: dict[tuple[str, int], list[str]] = {}
        self.seen: dict[int, FrameType] = {}  # generator frames already entered (held, so ids are not reused)
        self.requests = 0

    def profile(self, frame: FrameType, event: str, _arg: Any) -> None:
        if event != "call":
            return
        where = SERVER.get()
        if where is None:
            return
        path = frame.f_code.co_filename
        if not path.startswith(RUNTIME):
            return
        if frame.f_code.co_flags & _GENERATORS:
            if id(frame) in self.seen:
                return  # resumed, not called
            self.seen[id(frame)] = frame
        name = str(Path(path).relative_to(ROOT))
        self.steps.setdefault(where, []).append(name)
        if not _in_store(frame.f_back) and not path.startswith(STORE):
            self.outside_store.setdefault(where, []).append(name)

    def middleware(self, kind: str) -> Callable[..., Awaitable[web.StreamResponse]]:
        @web.middleware
        async def mark(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                       ) -> web.StreamResponse:
            self.requests += 1
            token = SERVER.set((kind, self.requests))
            try:
                return await handler(request)
            finally:
                SERVER.reset(token)
        return mark


def _in_store(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith(STORE):
            return True
        frame = frame.f_back
    return False


def summary(steps: list[str]) -> dict[str, Any]:
    moves = sum(1 for a, b in zip(steps, steps[1:], strict=False) if a != b)
    entries: dict[str, int] = {}
    for i, f in enumerate(steps):
        if i == 0 or steps[i - 1] != f:
            entries[f] = entries.get(f, 0) + 1
    return {"files": len(entries), "moves": moves,
            "entries": dict(sorted(entries.items(), key=lambda kv: (-kv[1], kv[0])))}


async def main() -> dict[str, Any]:
    import apps.stack as stack_module
    from participants.environments import enabled_environments

    trace = Trace()
    real_test_server = stack_module.TestServer
    kinds = iter(("model", "resources", "agent", "environment"))  # start_stack's order

    def marked_server(app: web.Application, **kw: Any) -> Any:
        app.middlewares.insert(0, trace.middleware(next(kinds)))
        return real_test_server(app, **kw)

    stack_module.TestServer = marked_server  # type: ignore[misc]
    try:
        s = await stack_module.start_stack(stack_module.MemoryBacking(), "walks", _scripted())
    finally:
        stack_module.TestServer = real_test_server  # type: ignore[misc]
    del enabled_environments
    body = {"episode_id": {"rollout_id": "0-0", "attempt": 0},
            "task": {"task_id": {"taskset": "blackjack:train", "task_id": "t0"},
                     "task_input": {"env": "blackjack", "generate": 6, "seed": 7}}}
    auth = aiohttp.BasicAuth("rollbook", stack_module.CREDS.data)
    sys.setprofile(trace.profile)
    try:
        async with aiohttp.ClientSession() as http, http.post(f"{s.url('environment')}/run", json=body,
                                                             auth=auth) as resp:
            reply = await resp.json()
            assert resp.status == 200 and "result" in reply, reply
    finally:
        sys.setprofile(None)
        await s.close()
    out: dict[str, Any] = {}
    for label, traced in (("whole", trace.steps), ("outside_the_store", trace.outside_store)):
        env = [steps for (kind, _), steps in traced.items() if kind == "environment"]
        model = [steps for (kind, _), steps in sorted(traced.items()) if kind == "model"]
        out[label] = {"nemo_gym_run_environment_server": summary([f for steps in env for f in steps]),
                      "one_model_call_model_server": summary(model[0])}
    return out


def _scripted() -> Any:
    from apps.stack import ScriptedBackend  # wherever the scripted model lives, the stack knows it
    return ScriptedBackend()


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main()), indent=1))

"""Token progress of every generation in flight, made durable in the background.

A checkpoint's prepare must leave every call it cuts durable. Writing each cut's tokens at prepare
time put 160 blobs in the prepare's path for 80 calls in flight; instead, a model server writes the
tokens each generation has so far every PROGRESS_S, all calls in one token-store transaction, off
any request's path, and remembers each call's longest durable prefix (`LiveCall.durable`). Prepare
then cuts each call at that prefix and writes nothing: the coordinator appends the cuts
(participants.model.server, engine.prepare_records).

What it costs: the tokens a generation made since its last save are generated again after a cut
(PROGRESS_S of generation, more when saves are slow: see SHARE), and each save rewrites the whole
prefix of each call that grew
(blobs are content-addressed: an intermediate prefix nobody names is left to `rollbook db retain`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from engine.errors import RollbookError
from engine.tokens import Receipt
from participants.model.calls import LiveCall, Progress, TokenStore

log = logging.getLogger(__name__)

# How often the tokens of the generations in flight are made durable, at most. Measured on a shared
# 2-core machine (benchmarks/README.md), 0.1 s saves starved a loaded model server; 1 s did not.
PROGRESS_S = 1.0
# A save costs CPU in this process (each prefix checked, float32-rounded and hashed whole: about 0.4 ms
# per 100 tokens on a loaded 2-core machine, so 35 ms for 80 calls): the saver waits at least 1/SHARE - 1
# times its last save's duration, so it never takes more than SHARE of the process's time.
SHARE = 0.2


class ProgressSaver:
    """Saves the progress of `calls()` every `interval_s` while any is in flight."""

    def __init__(self, token_store: TokenStore, calls: Callable[[], Iterable[LiveCall]], interval_s: float = PROGRESS_S) -> None:
        self.token_store = token_store
        self.calls = calls
        self.interval_s = interval_s
        self._prompts: dict[str, tuple[tuple[int, ...], Receipt]] = {}  # call id -> its prompt, saved once
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Run the saver if it is not running (called when a call is accepted)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        took = 0.0
        while any(not c.done.is_set() for c in self.calls()):
            await asyncio.sleep(max(self.interval_s, took * (1 / SHARE - 1)))
            started = time.perf_counter()
            try:
                await self.save()
            except RollbookError as exc:  # a database away: the next save tries again; prepare stages what it must
                log.warning("could not save the progress of the generations in flight: %s", exc.detail)
            took = time.perf_counter() - started

    async def save(self) -> int:
        """Every call's tokens so far, in one token-store transaction; how many calls were saved."""
        pending = [p for c in list(self.calls()) if (p := c.progress()) is not None]
        if pending:
            await asyncio.gather(*(self._save(p) for p in pending))  # concurrent puts share one transaction
        live = {c.call_id for c in self.calls()}
        for gone in [k for k in self._prompts if k not in live]:
            del self._prompts[gone]
        return len(pending)

    async def _save(self, p: Progress) -> None:
        known = self._prompts.get(p.call.call_id)
        if known is not None and known[0] == p.prompt_ids:
            generated, prompt = await self.token_store.put(p.ids, p.logprobs), known[1]
        else:
            generated, prompt = await asyncio.gather(self.token_store.put(p.ids, p.logprobs),
                                                     self.token_store.put(list(p.prompt_ids)))
            self._prompts[p.call.call_id] = (p.prompt_ids, prompt)
        p.call.saved(p, generated, prompt)


__all__ = ["PROGRESS_S", "SHARE", "ProgressSaver"]

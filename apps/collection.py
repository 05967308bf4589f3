"""A rollout collection as a training framework drives it: dispatch, checkpoint, restore, finish.

Dispatch is one `POST /episodes` per rollout to the environment server, which answers when the
episode is done. The same request is the way back after a crash: for a rollout whose attempt was
continued it joins the running episode, for a fresh dispatch it starts from input, and for a
finished one it returns the recorded result, never a second run. So after any restore the
framework just dispatches every unfinished rollout again.

A dispatch refused because admission is closed (a checkpoint is in progress) or because the
database is briefly unavailable is not an answer: it waits and asks again until the checkpoint
ends, so no rollout is dropped across a checkpoint. Each wait is an engine.patience.Patience: it
says in the log when it has gone on too long, and a database that stays away past PEER_PATIENCE_S
ends that rollout's dispatch with `refused[rollout] = "database_unavailable"`.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from adapters.collection_store import CollectionStore
from adapters.participant_client import HttpParticipant
from adapters.postgres import PostgresEventStore
from adapters.token_store import PostgresTokenStore
from apps.config import KINDS, Config
from apps.participant_set import LoggedParticipants
from engine.checkpoint import Cut
from engine.coordinator import Coordinator, Refs, abort_expired
from engine.patience import PEER_PATIENCE_S, Patience
from participants.environments.base import Task

# Refusals that mean "not now": a checkpoint holds admission closed, or the database is restarting.
RETRY_CODES = frozenset({"admission_closed", "database_unavailable"})


class NotNow(Exception):
    def __init__(self, detail: str, code: str) -> None:
        super().__init__(detail)
        self.code = code


async def _error(resp: aiohttp.ClientResponse) -> tuple[str | None, str | None]:
    """The error's code and detail, from a rollbook error body."""
    try:
        body = await resp.json(content_type=None)
    except (ValueError, aiohttp.ClientError):
        return None, None
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return None, None
    detail = error.get("detail")
    return error.get("code"), detail[:600] if isinstance(detail, str) else None


@dataclass
class Collection:
    config: Config
    store: PostgresEventStore
    run_id: str
    tasks: list[Task]
    seed: int = 0
    max_steps: int = 12
    concurrency: int = 64
    on_finish: Callable[[str], None] = lambda rid: None
    # Called with (rollout id, code) when a dispatch of that rollout is first told "not now": a run
    # that waits out a checkpoint says so instead of looking hung.
    on_wait: Callable[[str, str], None] = lambda rid, code: None
    finished: set[str] = field(default_factory=set)
    refused: dict[str, str] = field(default_factory=dict)  # rollout id -> the error code that ended its dispatch
    reasons: dict[str, str] = field(default_factory=dict)  # rollout id -> that error's detail (what to act on)
    retries: int = 0  # dispatches asked again after admission_closed / database_unavailable

    def rollout_id(self, i: int) -> str:
        """`<run>-<i>`: its checkpoints name the run, whose rollouts these are (engine.identity.run_of)."""
        return f"{self.run_id}-{i:04d}"

    def coordinator(self, session: aiohttp.ClientSession) -> Coordinator:
        clients = [HttpParticipant(k, k, self.config.url(k), self.config.control_token, session) for k in KINDS]
        # Prepare and restore drive every live instance the log records, these addresses included.
        members = LoggedParticipants(self.store, [(k, self.config.url(k)) for k in KINDS], self.config.control_token, session)
        return Coordinator(self.store, clients, members)

    def episodes_url(self, i: int) -> str:
        """Where rollout i is dispatched: the configured environment server. A framework that spreads
        its rollouts over several environment instances answers one of theirs, the same one every time."""
        return self.config.url("environment") + "/episodes"

    async def unfinished(self) -> list[int]:
        done = await CollectionStore(self.store).finished_rollouts(f"{self.run_id}-")
        self.finished |= done
        return [i for i in range(len(self.tasks)) if self.rollout_id(i) not in done]

    async def dispatch(self, session: aiohttp.ClientSession) -> dict[str, Any]:
        """Run every unfinished rollout to its end; a rollout cut off by a crash just returns None."""
        gate = asyncio.Semaphore(self.concurrency)
        headers = {"Authorization": f"Bearer {self.config.data_token}"}  # dispatch is data-plane work

        async def one(i: int) -> dict[str, Any] | None:
            rid = self.rollout_id(i)
            url = self.episodes_url(i)
            # An episode's reply comes when it ends: bounded by the config's work_s of silence, not by its length.
            timeout = self.config.limits.peer_timeouts().for_url(url)
            body = {"rollout_id": rid, "task": self.tasks[i].to_json(), "seed": self.seed * 100_000 + i,
                    "max_steps": self.max_steps}
            async with gate:
                waits = {code: Patience(f"dispatch of {rid}", limit_s=None if code == "admission_closed" else PEER_PATIENCE_S)
                         for code in RETRY_CODES}
                while True:
                    try:
                        async with session.post(url, json=body, headers=headers, timeout=timeout) as resp:
                            if resp.status == 200:
                                result = dict(await resp.json())
                                break
                            code, detail = await _error(resp)
                            if code not in RETRY_CODES:
                                self.refused[rid] = code or f"http_{resp.status}"
                                if detail:
                                    self.reasons[rid] = detail
                                return None
                    except (aiohttp.ClientError, OSError):
                        return None  # the server died under us; the log knows where this rollout stands
                    wait = waits[str(code)]
                    if wait.tries == 0:
                        self.on_wait(rid, str(code))
                    try:
                        delay = wait.next_delay(NotNow(f"the environment server answers {code}", code=str(code)))
                    except NotNow:  # the database stayed away past its patience: this dispatch says so and ends
                        self.refused[rid] = str(code)
                        return None
                    self.retries += 1
                    await asyncio.sleep(delay * (0.5 + random.random()))  # jittered: a resume must not meet a stampede
            if rid not in self.finished:
                self.finished.add(rid)
                self.on_finish(rid)
            return result

        results = await asyncio.gather(*(one(i) for i in await self.unfinished()))
        return {r["rollout_id"]: r for r in results if r}

    async def checkpoint(self, session: aiohttp.ClientSession, checkpoint_id: str, deadline_s: float = 30.0,
                         resume: bool = True) -> dict[str, Any]:
        """Prepare, commit, publish (framework state + token snapshot under the same id), then resume."""
        coordinator = self.coordinator(session)
        await abort_expired(self.store)  # a checkpoint a killed coordinator left open must not stay open
        deadline = time.time() + deadline_s
        prepared = await coordinator.prepare(checkpoint_id, deadline)
        if not prepared["ready"]:
            return {"checkpoint_id": checkpoint_id, "published": False, "prepare": prepared}
        # It continues every rollout of its run in flight at P, less those prepare reported restart-only.
        cut = await coordinator.commit(checkpoint_id, deadline, None, run=self.run_id)
        await self._publish(coordinator, cut)
        if resume:
            await coordinator.resume(checkpoint_id)
        return self._report(coordinator, cut)

    async def checkpoint_online(self, session: aiohttp.ClientSession, checkpoint_id: str,
                                deadline_s: float = 30.0) -> dict[str, Any]:
        """A checkpoint that pauses no one (engine.checkpoint.make_online_cut), then published like
        any other. This framework's state is the log itself, so "as of P" needs no pause here."""
        coordinator = self.coordinator(session)
        started = time.perf_counter()
        await abort_expired(self.store)
        coordinator.timing.record("online:abort_expired", started)
        cut = await coordinator.checkpoint_online(checkpoint_id, self.run_id, time.time() + deadline_s,
                                                  refs=self._refs)
        return self._report(coordinator, cut)

    @staticmethod
    def _report(coordinator: Coordinator, cut: Cut) -> dict[str, Any]:
        return {"checkpoint_id": cut.checkpoint_id, "published": True, "position": cut.position,
                "continued": len(cut.scope), "fresh_dispatch": len(cut.fresh),
                "timings_ms": dict(coordinator.timing.ms)}

    async def _publish(self, coordinator: Coordinator, cut: Cut) -> None:
        started = time.perf_counter()
        await coordinator.publish(cut.checkpoint_id, *await self._refs(cut))
        coordinator.timing.record("publish", started)  # the snapshot, its validation and the append

    async def _refs(self, cut: Cut) -> Refs:
        """The framework's state and the token snapshot, both under the checkpoint's id."""
        tokens = PostgresTokenStore(self.store.engine)
        parent_ref, since = await self._last_snapshot(cut.position)
        # Only the calls written since the last published checkpoint of this run: its snapshot is the parent
        # of this one, so publish costs what this cut added, not the length of the run.
        blobs = await CollectionStore(self.store).call_blobs(f"{self.run_id}-", since, cut.position)
        token_ref = await tokens.snapshot(cut.checkpoint_id, blobs, parent=parent_ref)
        framework_ref = {"checkpoint_id": cut.checkpoint_id, "run_id": self.run_id, "tasks": len(self.tasks),
                         "position": cut.position}
        return framework_ref, token_ref, tokens

    async def restore(self, session: aiohttp.ClientSession, checkpoint_id: str, deadline_s: float = 60.0) -> dict[str, Any]:
        coordinator = self.coordinator(session)
        result = await coordinator.restore(checkpoint_id, time.time() + deadline_s)
        await coordinator.resume(checkpoint_id)
        return {**result, "timings_ms": dict(coordinator.timing.ms)}

    async def _last_snapshot(self, before: int) -> tuple[dict[str, Any] | None, int]:
        """The token snapshot of this run's latest published checkpoint cut below `before`, and its cut
        position (0 and None when there is none: the snapshot then lists every blob from the start)."""
        return await CollectionStore(self.store).last_snapshot(f"{self.run_id}-ck", before)

    async def latest_published(self) -> str | None:
        return await CollectionStore(self.store).latest_published(f"{self.run_id}-ck")

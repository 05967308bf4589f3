"""The checkpoint rules both stateful machines share: dispatch, prepare, commit, publish, resume, and an
online checkpoint (the same cut from the log alone, with every server running).

testkit/stateful_control.py (in-process servers) and testkit/stateful_processes.py (server processes,
SIGKILL and database restarts) drive the same coordinator the same way; only their faults differ.
A machine mixes this in before RuleBasedStateMachine and provides `run`, `coordinator`, `_rows`,
`coll`, `session`, the state below, `CHECKPOINT_TAG` (the id's infix) and `tally` (its module's
TALLY of the operations that took effect, which benchmarks/soak.py prints).

`MODES` says which checkpoints a machine takes: both by default (paused and online drawn in one
sequence), or one of them, so that a run of each mode covers its own commit, publish and restore
(tests/e2e/test_random_faults.py). The rules of a mode not in MODES are never drawn.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from hypothesis.stateful import precondition, rule

from adapters.token_store import PostgresTokenStore
from engine.errors import RollbookError

DEADLINE_S = 20.0
PAUSED, ONLINE = "paused", "online"


def paused(machine: CheckpointRules) -> bool:
    return PAUSED in machine.MODES


def online(machine: CheckpointRules) -> bool:
    return ONLINE in machine.MODES


class CheckpointRules:
    MODES: tuple[str, ...] = (PAUSED, ONLINE)
    CHECKPOINT_TAG = "ck"
    START_TIMEOUT_S = 30.0
    tally: dict[str, int]
    # provided by the machine
    run_id: str
    coll: Any
    session: Any
    dispatching: asyncio.Task[Any] | None
    active: str | None
    phase: str
    restorable: list[str]
    steps: list[str]
    counter: Any
    loop: asyncio.AbstractEventLoop

    def run(self, coro: Any) -> Any:
        raise NotImplementedError

    def coordinator(self) -> Any:
        raise NotImplementedError

    async def _rows(self, sql: str) -> list[Any]:
        raise NotImplementedError

    def _count(self, op: str) -> None:
        self.tally[op] = self.tally.get(op, 0) + 1

    async def _wait_started(self, rollouts: int) -> None:
        deadline = time.monotonic() + self.START_TIMEOUT_S
        while len(await self._rows("SELECT 1 FROM rollbook.attempts WHERE rollout_id LIKE :p")) < rollouts:
            assert time.monotonic() < deadline, f"the rollouts never started: {self.steps}"
            await asyncio.sleep(0.02)

    @rule()
    def dispatch(self) -> None:
        if self.dispatching is None or self.dispatching.done():
            assert self.coll is not None and self.session is not None
            self.dispatching = self.loop.create_task(self.coll.dispatch(self.session))
        self.run(asyncio.sleep(0.05))  # let some work happen
        self.steps.append("dispatch")
        self._count("dispatch")

    @precondition(paused)
    @rule()
    def prepare(self) -> None:
        if self.active is not None:
            return
        ck = f"{self.run_id}-{self.CHECKPOINT_TAG}{next(self.counter)}"
        reply = self.run(self.coordinator().prepare(ck, time.time() + DEADLINE_S))
        self.steps.append(f"prepare {ck} ready={reply['ready']}")
        self._count("prepare" if reply["ready"] else "prepare_not_ready")
        if reply["ready"]:
            self.active, self.phase = ck, "prepared"

    @precondition(paused)
    @rule()
    def commit(self) -> None:
        if self.active is None or self.phase != "prepared":
            return
        assert self.coll is not None
        try:
            self.run(self.coordinator().commit(self.active, time.time() + DEADLINE_S, None, run=self.coll.run_id))
            self.phase = "committed"
            self.restorable.append(self.active)
        except RollbookError:  # refused (e.g. a participant was killed since prepare): aborted and resumed
            self.active, self.phase = None, "idle"
        self.steps.append(f"commit -> {self.phase}")
        self._count("commit" if self.phase == "committed" else "commit_aborted")

    @precondition(paused)
    @rule()
    def publish(self) -> None:
        if self.active is None or self.phase != "committed":
            return
        self._publish(self.active)
        self.phase = "published"

    def _publish(self, ck: str) -> None:
        tokens = PostgresTokenStore(self.store.engine)  # type: ignore[attr-defined]
        ref = self.run(tokens.snapshot(ck, []))
        self.run(self.coordinator().publish(ck, {"checkpoint_id": ck}, ref, tokens))
        self.steps.append(f"publish {ck}")
        self._count("publish")

    @precondition(paused)
    @rule()
    def resume(self) -> None:
        if self.active is None:
            return
        self.run(self.coordinator().resume(self.active))  # a participant restarted since says so; the rest reopen
        self.active, self.phase = None, "idle"
        self.steps.append("resume")
        self._count("resume")

    @precondition(online)
    @rule()
    def checkpoint_online(self) -> None:
        """An online checkpoint, whatever else is going on: a paused one open, servers killed."""
        self._online()

    def _online(self) -> str | None:
        """The online checkpoint's id once committed; None where the database refused it."""
        assert self.coll is not None
        ck = f"{self.run_id}-{self.CHECKPOINT_TAG}{next(self.counter)}"
        try:
            self.run(self.coordinator().checkpoint_online(ck, self.coll.run_id, time.time() + DEADLINE_S))
        except RollbookError as exc:  # only the database being away may refuse it
            assert exc.code == "database_unavailable", exc
            self.steps.append(f"online {ck} refused: {exc.code}")
            self._count("online_refused")
            return None
        self.restorable.append(ck)
        self.steps.append(f"online {ck}")
        self._count("online")
        return ck

"""A hypothesis state machine over the control operations, checked through the public SQL views.

Rules: dispatch, prepare, commit, publish, resume, crash-and-restore, retire, forget, in any order
hypothesis picks, against the four servers in process (apps/stack.py: real aiohttp servers on
127.0.0.1, one real PostgreSQL). A "crash" closes the whole stack with no handover and starts a
fresh one on the same database, then restores the latest committed or published checkpoint. The
real-process faults (SIGKILL of a subset, a PostgreSQL restart, a dropped connection)
are not among the rules yet: in process they run in seconds, as processes they do not fit CI.

After every step (invariant) and at the end (teardown), through rollbook.attempts,
rollbook.episode_history, rollbook.checkpoints and rollbook.model_calls:
- no rollout has more than one finished attempt, and at the end each one not retired has exactly one;
- no model call completes twice, and no session revision is applied twice in one attempt;
- no event of an attempt lands after its fence;
- every restored attempt names a checkpoint that was committed or published;
- at the end every server is idle.

Each example gets its own run prefix on one database, so invariants read only its own rows. No
rule has a precondition: whether one applies depends on what the servers answered (a prepare that
was not ready, a commit that aborted), and hypothesis must draw the same rules when it replays a
sequence to shrink it, so a rule that does not apply does nothing.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import aiohttp
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from sqlalchemy import text

from adapters.pg_pool import with_retry
from adapters.postgres import PostgresEventStore
from apps import config as cfg
from apps.collection import Collection
from apps.stack import CREDS, SEED, Stack, start_stack
from engine.coordinator import Coordinator
from participants.environments.tasks import make_tasks
from participants.model.backends.scripted import ScriptedBackend
from testkit.checkpoint_rules import CheckpointRules

ENVS = ["math", "blackjack", "workplace"]
ROLLOUTS = 4
DEADLINE_S = 20.0
_runs = itertools.count()
# Operations that took effect, over every sequence of this process (benchmarks/soak.py prints them).
TALLY: dict[str, int] = {}


def _count(op: str) -> None:
    TALLY[op] = TALLY.get(op, 0) + 1

AFTER_FENCE = """
SELECT e.rollout_id, e.attempt, e.kind FROM rollbook.episode_history f
JOIN rollbook.episode_history e ON e.rollout_id = f.rollout_id AND e.attempt = f.attempt AND e.position > f.position
WHERE f.kind = 'attempt_fenced' AND f.rollout_id LIKE :p
"""
FINISHED_TWICE = """
SELECT rollout_id, count(*) FROM rollbook.attempts WHERE rollout_id LIKE :p AND status = 'finished'
GROUP BY rollout_id HAVING count(*) > 1
"""
CALL_COMPLETED_TWICE = """
SELECT data->>'call_id', count(*) FROM rollbook.episode_history WHERE rollout_id LIKE :p AND kind = 'call_completed'
GROUP BY 1 HAVING count(*) > 1
"""
MUTATION_TWICE = """
SELECT rollout_id, attempt, stream, data->>'revision', count(*) FROM rollbook.episode_history
WHERE rollout_id LIKE :p AND kind = 'mutation_applied' GROUP BY 1, 2, 3, 4 HAVING count(*) > 1
"""
RESTORED_FROM_UNCOMMITTED = """
SELECT a.rollout_id, a.attempt, a.restored_from_checkpoint, c.phase FROM rollbook.attempts a
LEFT JOIN rollbook.checkpoints c ON c.checkpoint_id = a.restored_from_checkpoint
WHERE a.rollout_id LIKE :p AND a.restored_from_checkpoint IS NOT NULL
  AND (c.log_position IS NULL OR c.phase NOT IN ('committed', 'published'))
"""


class _Collection(Collection):
    """The framework side, less the rollouts it retired (it stops asking for those)."""

    retired: set[str]

    async def unfinished(self) -> list[int]:
        return [i for i in await super().unfinished() if self.rollout_id(i) not in self.retired]


class ControlMachine(CheckpointRules, RuleBasedStateMachine):
    # dispatch, prepare, commit, publish and resume: testkit/checkpoint_rules.py
    CHECKPOINT_TAG = "ck"
    tally = TALLY
    dsn: str = ""  # set by the test or the soak before running
    progress: Any = None  # called with TALLY after each checked sequence (benchmarks/soak.py)

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.run_id = f"sm{next(_runs)}x{int(time.time() * 1000) % 100000}"
        self.stack: Stack | None = None
        self.store = PostgresEventStore.connect(self.dsn, writer=f"driver-{self.run_id}")
        self.session: aiohttp.ClientSession | None = None
        self.coll: _Collection | None = None
        self.dispatching: asyncio.Task[Any] | None = None
        self.active: str | None = None
        self.phase = "idle"  # of the active checkpoint: prepared, committed, published
        self.restorable: list[str] = []
        self.retired: dict[str, int] = {}
        self.counter = itertools.count(1)
        self.steps: list[str] = []

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    # ---- plumbing --------------------------------------------------------------------------

    async def _start(self) -> None:
        self.stack = await start_stack(self.dsn, f"{self.run_id}-{next(self.counter)}", ScriptedBackend(token_latency_s=0.002))
        servers = {k: cfg.ServerConfig(port=self.stack.servers[k].port) for k in cfg.KINDS}
        config = cfg.Config(dsn=self.dsn, control_token=CREDS.control, data_token=CREDS.data, servers=servers)
        if self.session is None:
            self.session = aiohttp.ClientSession()
        tasks = make_tasks(ROLLOUTS, 3, ENVS)
        self.coll = _Collection(config, self.store, self.run_id, tasks, seed=SEED, max_steps=6)
        self.coll.retired = set(self.retired)

    def coordinator(self) -> Coordinator:
        assert self.coll is not None and self.session is not None
        return self.coll.coordinator(self.session)

    async def _rows(self, sql: str) -> list[Any]:
        async def read() -> list[Any]:
            async with self.store.engine.connect() as conn:
                return list(await conn.execute(text(sql), {"p": f"{self.run_id}-%"}))
        return await with_retry(read, what="an invariant's query")  # across a restarted PostgreSQL

    # ---- rules -------------------------------------------------------------------------------

    @initialize()
    def boot(self) -> None:
        """Servers up and every rollout dispatched: each later rule then has live work to act on."""
        self.run(self._start())
        _count("sequences")
        self.dispatch()
        self.run(self._wait_started(ROLLOUTS))

    @rule(wait=st.sampled_from([0.0, 0.1, 0.3]))
    def let_time_pass(self, wait: float) -> None:
        self.run(asyncio.sleep(wait))

    @rule()
    def crash_and_restore(self) -> None:
        """Every server dies at once, with the framework's dispatches; fresh ones restore the latest cut."""
        if not self.restorable:
            return
        assert self.stack is not None
        if self.dispatching is not None:
            self.dispatching.cancel()
            self.run(asyncio.gather(self.dispatching, return_exceptions=True))
            self.dispatching = None
        self.run(self.stack.close())
        self.run(self._start())
        ck = self.restorable[-1]
        self.run(self.coordinator().restore(ck, time.time() + DEADLINE_S))
        self.run(self.coordinator().resume(ck))
        self.active, self.phase = None, "idle"
        self.steps.append(f"crash, restore {ck}")
        _count("crash_and_restore")

    @rule(i=st.integers(0, ROLLOUTS - 1))
    def retire(self, i: int) -> None:
        assert self.coll is not None
        rid = self.coll.rollout_id(i)
        rows = self.run(self.store.attempt_rows([rid]))
        if not rows or any(row["status"] == "finished" for row in rows.values()):
            return  # nothing live to retire
        through = max(a for _, a in rows)
        self.run(self.coordinator().retire(f"{self.run_id}-retire", [(rid, through)]))
        self.retired[rid] = through
        self.coll.retired.add(rid)
        self.steps.append(f"retire {rid} through {through}")
        _count("retire")

    @rule(i=st.integers(0, ROLLOUTS - 1))
    def forget(self, i: int) -> None:
        assert self.coll is not None
        rid = self.coll.rollout_id(i)
        if rid not in self.retired:
            return
        self.run(self.coordinator().forget(f"{self.run_id}-forget", [rid]))
        self.steps.append(f"forget {rid}")
        _count("forget")

    # ---- invariants ----------------------------------------------------------------------------

    @invariant()
    def the_log_stays_honest(self) -> None:
        self.run(self._check())

    async def _check(self) -> None:
        for name, sql in (("events after a fence", AFTER_FENCE), ("finished twice", FINISHED_TWICE),
                          ("model call completed twice", CALL_COMPLETED_TWICE), ("mutation applied twice", MUTATION_TWICE),
                          ("restored from an uncommitted checkpoint", RESTORED_FROM_UNCOMMITTED)):
            rows = await self._rows(sql)
            assert not rows, f"{name}: {rows[:5]} after {self.steps}"

    def teardown(self) -> None:
        try:
            if self.stack is not None and self.coll is not None:
                self.run(self._finish())
        finally:
            self.run(self._close())
            self.loop.close()

    async def _finish(self) -> None:
        assert self.coll is not None and self.session is not None and self.stack is not None
        if self.active is not None:
            await self.coordinator().resume(self.active)
        if self.dispatching is not None:
            self.dispatching.cancel()
            await asyncio.gather(self.dispatching, return_exceptions=True)
        deadline = time.monotonic() + 60
        while await self.coll.unfinished() and time.monotonic() < deadline:
            await asyncio.wait_for(self.coll.dispatch(self.session), 60)
        left = await self.coll.unfinished()
        assert not left, f"rollouts never finished: {left} after {self.steps}"
        finished = {r: n for r, n in await self._rows(
            "SELECT rollout_id, count(*) FROM rollbook.attempts WHERE rollout_id LIKE :p AND status = 'finished' "
            "GROUP BY rollout_id")}
        for i in range(ROLLOUTS):
            rid = self.coll.rollout_id(i)
            if rid not in self.retired:
                assert finished.get(rid) == 1, f"{rid} finished {finished.get(rid, 0)} times after {self.steps}"
        for kind in cfg.KINDS:
            status = await self.stack.control_client.get(f"{self.stack.url(kind)}/rollbook/v1/control/status")
            assert status["phase"] == "idle", f"{kind} is {status['phase']} at the end, after {self.steps}"
        await self._check()
        _count("sequences_checked")
        if self.progress is not None:
            self.progress(TALLY)
        TALLY["rollouts_finished"] = TALLY.get("rollouts_finished", 0) + sum(finished.values())

    async def _close(self) -> None:
        if self.dispatching is not None and not self.dispatching.done():
            self.dispatching.cancel()
            await asyncio.gather(self.dispatching, return_exceptions=True)
        if self.stack is not None:
            await self.stack.close()
        if self.session is not None:
            await self.session.close()
        await self.store.close()

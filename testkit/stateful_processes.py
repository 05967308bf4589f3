"""Control operations and real faults in random order, against real processes.

Two instances of each of the four kinds run as separate processes (apps.processes.ServerProcesses,
each in its own process group, each started with `rollbook serve`) on a PostgreSQL server of the
suite's own (testkit.pg.restartable_server). The second set's config names its own peers, as a
second machine's would: the framework dispatches even rollouts to the first environment instance
and odd ones to the second, each environment instance calls the agent and resources instances of
its set, and every agent reaches both model instances (participants/base/routing.py), so calls really
spread over two instances of every kind and a checkpoint drives all eight (apps/participant_set.py).
The faults are the real ones:

- kill_servers: SIGKILL of every instance of any non-empty subset of the four kinds, restarted
  after a pause in which the framework's dispatches go on against whatever is left;
- kill_instance: SIGKILL of one process of one kind, the other instance of the kind still
  serving, restarted at the same address after a pause (the fresh process supersedes the dead
  one's membership);
- kill_worker: SIGKILL of one worker of the second instance of a kind (it runs two behind a front):
  the live worker takes its sessions over, then the instance restarts after a pause;
- kill_coordinator: a coordinator process (testkit/coordinator_child.py, which checkpoints as
  `rollbook run` does) SIGKILLed a drawn delay into its checkpoint: its lease runs out on the
  servers, and a cut it managed to commit is restorable like any other;
- restart_postgres: `pg_ctl restart -m fast` while the rollouts run (every connection dropped);
- drop_connections: pg_terminate_backend of every other connection to the database;
- crash_and_restore: SIGKILL of all eight, fresh processes restore the latest committed cut;

mixed with the control operations of testkit/stateful_control.py (dispatch, prepare, commit,
publish, resume, retire, forget) and online checkpoints; `MODES` (testkit/checkpoint_rules.py)
limits a run to paused or to online checkpoints, and then every checkpoint the machine takes
(checkpoint_and_publish, crash_and_restore's first cut, the killed coordinator's) is of that mode. After every step the invariants of testkit/stateful_control.py
are read through the public SQL views, plus: no model call generated twice for one turn, no tool
call applied twice and no agent turn recorded twice within one attempt (a restarted server that
redid its own work); at the end of each sequence every rollout that was not
retired must have finished exactly once by its latest attempt, nothing may have been done twice
within an attempt or again by a continued attempt (testkit/log_queries.py), and
every server must be idle.

Whether an operation takes effect depends on the state (a commit needs a prepared checkpoint, a
publish a committed one), so drawn one by one they rarely line up: checkpoint_and_publish takes
one whole (prepare, commit, publish) from whatever state it meets, crash_and_restore takes a cut
first when there is none, and publish_crash_and_restore does both. TALLY counts every operation that took effect and, as
`sequences_with_OP`, the sequences in which it did at least once.

The processes and the database live for the whole hypothesis run (starting them per sequence
would not fit CI); each sequence works under its own run prefix, restarts what it killed, and
leaves every server idle, so a sequence never sees another's rollouts live.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import psycopg
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from sqlalchemy import text

from adapters.pg_pool import with_retry
from adapters.postgres import PostgresEventStore
from apps import config as cfg
from apps.collection import Collection
from apps.processes import ServerProcesses, free_port, worker_pids
from engine.coordinator import Coordinator
from engine.phases import LEASE_GRACE_S
from participants.environments.tasks import make_tasks
from testkit.checkpoint_rules import ONLINE, PAUSED, CheckpointRules
from testkit.log_queries import REGENERATED_ACROSS, REPEATED_CALLS, REPEATED_MUTATIONS, REPEATED_TURNS
from testkit.stateful_control import (
    AFTER_FENCE,
    CALL_COMPLETED_TWICE,
    FINISHED_TWICE,
    MUTATION_TWICE,
    RESTORED_FROM_UNCOMMITTED,
)

ROOT = Path(__file__).resolve().parent.parent
ENVS = ["math", "blackjack", "workplace", "sandbox"]
ROLLOUTS = 4
INSTANCES = 2  # of every kind
DEADLINE_S = 20.0
COORDINATOR_DEADLINE_S = 2.0  # a killed coordinator's checkpoint holds the servers this long (plus the grace)
TALLY: dict[str, int] = {}
_runs = itertools.count()

# A model call generated twice for the same turn within one attempt (a replayed reply is not generated).
GENERATED_TWICE = """
SELECT rollout_id, attempt, split_part(data->>'call_id', '.t', 2) AS turn, count(*)
FROM rollbook.episode_history
WHERE kind = 'call_completed' AND rollout_id LIKE :p AND coalesce(data->>'disposition', 'generated') = 'generated'
GROUP BY 1, 2, 3 HAVING count(*) > 1
"""
# One tool call (activation, turn, index) applied twice within one attempt.
TOOL_CALL_TWICE = """
SELECT rollout_id, attempt, data->>'tool_call' AS tool_call, count(*)
FROM rollbook.episode_history WHERE kind = 'mutation_applied' AND rollout_id LIKE :p AND data->>'tool_call' IS NOT NULL
GROUP BY 1, 2, 3 HAVING count(*) > 1
"""
ENDINGS = """
SELECT rollout_id, count(*) FILTER (WHERE status = 'finished') AS finished,
       count(*) FILTER (WHERE status = 'live') AS live,
       max(attempt) AS latest, max(attempt) FILTER (WHERE status = 'finished') AS finished_attempt
FROM rollbook.attempts WHERE rollout_id LIKE :p GROUP BY rollout_id
"""


@dataclass
class World:
    """What lives across sequences: the database, its restart, and two instances of each kind (the second
    with two workers)."""

    dsn: str
    restart_db: Any
    config: cfg.Config  # the first set's; the coordinator finds the second set in the log
    config_path: Path
    sets: list[ServerProcesses]  # one per instance of every kind

    @property
    def log_dir(self) -> Path:
        return self.sets[0].log_dir

    def dead(self, which: int) -> tuple[str, ...]:
        procs = self.sets[which].procs
        return tuple(k for k in cfg.KINDS if k not in procs or procs[k].poll() is not None)

    def revive(self) -> None:
        """Start a fresh process of every kind of every set whose process is dead (at its old address),
        the sets side by side: each start waits for Python's import, which is most of a restart."""
        with ThreadPoolExecutor(len(self.sets)) as pool:
            starting = [pool.submit(procs.start, 90.0, dead)
                        for which, procs in enumerate(self.sets) if (dead := self.dead(which))]
            for done in starting:
                done.result()  # a server that did not start fails the step, with its log's tail

    def urls(self, kind: str) -> list[str]:
        return [procs.config.url(kind) for procs in self.sets]  # type: ignore[arg-type]

    def stop(self) -> None:
        for procs in self.sets:
            procs.stop()


def start_world(dsn: str, restart_db: Any, work: Path, token_latency_s: float = 0.015) -> World:
    work.mkdir(parents=True, exist_ok=True)
    sets = []
    for which in range(INSTANCES):
        # The second instance of every kind runs two workers behind a front (apps/workers.py): a SIGKILL of
        # it takes the front and its workers; callers reach its workers straight from the log.
        servers = {k: cfg.ServerConfig(port=free_port(), token_latency_s=token_latency_s if k == "model" else 0.0,
                                       workers=2 if which else 1)
                   for k in cfg.KINDS}
        config = cfg.Config(dsn=dsn, control_token="faults-c0ntrol", data_token="faults-d4ta", servers=servers,
                            sandbox=cfg.SandboxConfig(),  # the sandbox environment is off unless configured
                            # every process of both instances shares the database's connections: 4 + 4 x 3, and
                            # the driver, a coordinator child and one more
                            limits=cfg.LimitsConfig(processes=len(cfg.KINDS) * 4 + 3))
        path = work / ("rollbook.toml" if which == 0 else f"rollbook-{which}.toml")
        cfg.write(config, path)
        sets.append(ServerProcesses(config, path, work, name="" if which == 0 else f"i{which}-"))
    world = World(dsn, restart_db, sets[0].config, sets[0].config_path, sets)
    world.revive()
    return world


class _Collection(Collection):
    retired: set[str]
    environments: list[str]  # every environment instance's address: rollout i goes to i modulo their number

    def episodes_url(self, i: int) -> str:
        return self.environments[i % len(self.environments)] + "/episodes"

    async def unfinished(self) -> list[int]:
        return [i for i in await super().unfinished() if self.rollout_id(i) not in self.retired]


class FaultMachine(CheckpointRules, RuleBasedStateMachine):
    # dispatch, prepare, commit, publish and resume: testkit/checkpoint_rules.py
    CHECKPOINT_TAG = "m"
    START_TIMEOUT_S = 60.0
    tally = TALLY
    world: World  # set by the test or the soak before running
    progress: Any = None  # called with TALLY after each checked sequence (benchmarks/soak.py)

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.run_id = f"rf{next(_runs)}x{int(time.time() * 1000) % 100000}"
        self.store = PostgresEventStore.connect(self.world.dsn, writer=f"driver-{self.run_id}")
        self.session: aiohttp.ClientSession | None = None
        self.coll: _Collection | None = None
        self.dispatching: asyncio.Task[Any] | None = None
        self.active: str | None = None
        self.phase = "idle"
        self.restorable: list[str] = []
        self.retired: dict[str, int] = {}
        self.counter = itertools.count(1)
        self.lease_until = 0.0  # a killed coordinator's checkpoint may hold the servers until then
        self.steps: list[str] = []
        self.effects: set[str] = set()  # the operations that took effect in this sequence

    def _count(self, op: str) -> None:
        TALLY[op] = TALLY.get(op, 0) + 1
        self.effects.add(op)

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    @staticmethod
    async def _new_session() -> aiohttp.ClientSession:
        return aiohttp.ClientSession()  # inside the loop that will use it

    def coordinator(self) -> Coordinator:
        assert self.coll is not None and self.session is not None
        return self.coll.coordinator(self.session)

    async def _rows(self, sql: str, **params: Any) -> list[Any]:
        async def read() -> list[Any]:
            async with self.store.engine.connect() as conn:
                return list(await conn.execute(text(sql), {"p": f"{self.run_id}-%", **params}))
        return await with_retry(read, what="an invariant's query")  # across a restarted PostgreSQL

    def _revive(self) -> None:
        self.run(asyncio.to_thread(self.world.revive))

    def _kill(self, which: int, kinds: tuple[str, ...] = cfg.KINDS) -> None:
        self.run(asyncio.to_thread(self.world.sets[which].kill, kinds))

    def _live_now(self, fault: str) -> None:
        """Count a fault that lands while some rollout of the sequence is live (the ones that test recovery)."""
        if self.run(self._rows("SELECT 1 FROM rollbook.attempts WHERE rollout_id LIKE :p AND status = 'live' LIMIT 1")):
            self._count(f"{fault}_on_live_rollouts")

    def _stop_dispatch(self) -> None:
        if self.dispatching is not None:
            self.dispatching.cancel()
            self.run(asyncio.gather(self.dispatching, return_exceptions=True))
            self.dispatching = None

    # ---- rules -------------------------------------------------------------------------------

    @initialize()
    def boot(self) -> None:
        self._revive()  # a sequence that failed may have left a server dead
        self.session = self.run(self._new_session())
        self.coll = _Collection(self.world.config, self.store, self.run_id, make_tasks(ROLLOUTS, 3, ENVS), max_steps=6)
        self.coll.retired = set()
        self.coll.environments = self.world.urls("environment")
        self._count("sequences")
        self.dispatch()
        self.run(self._wait_started(ROLLOUTS))

    @rule(wait=st.sampled_from([0.0, 0.2, 0.5]))
    def let_time_pass(self, wait: float) -> None:
        self.run(asyncio.sleep(wait))

    @rule(i=st.integers(0, ROLLOUTS - 1))
    def retire(self, i: int) -> None:
        assert self.coll is not None
        rid = self.coll.rollout_id(i)
        if rid in self.retired:
            return
        rows = self.run(self.store.attempt_rows([rid]))
        if not rows or any(row["status"] == "finished" for row in rows.values()):
            return
        through = max(a for _, a in rows)
        self.run(self.coordinator().retire(f"{self.run_id}-retire", [(rid, through)]))
        self.retired[rid] = through
        self.coll.retired.add(rid)
        self.steps.append(f"retire {rid} through {through}")
        self._count("retire")

    @rule(i=st.integers(0, ROLLOUTS - 1))
    def forget(self, i: int) -> None:
        assert self.coll is not None
        rid = self.coll.rollout_id(i)
        if rid not in self.retired:
            return
        self.run(self.coordinator().forget(f"{self.run_id}-forget", [rid]))
        self.steps.append(f"forget {rid}")
        self._count("forget")

    # ---- faults ------------------------------------------------------------------------------

    @rule(kinds=st.sets(st.sampled_from(cfg.KINDS), min_size=1), pause=st.sampled_from([0.0, 0.3]))
    def kill_servers(self, kinds: set[str], pause: float) -> None:
        """SIGKILL every instance of a subset of kinds; the framework's dispatches meet whatever is
        left, then fresh ones start."""
        killed = tuple(k for k in cfg.KINDS if k in kinds)
        self._live_now("kill_servers")
        for which in range(INSTANCES):
            self._kill(which, killed)
        self.run(asyncio.sleep(pause))
        self._revive()
        self.steps.append(f"SIGKILL {','.join(killed)}")
        self._count("kill_servers")
        self._count(f"kill_{len(killed)}_servers")

    @rule(kind=st.sampled_from(cfg.KINDS), which=st.integers(0, INSTANCES - 1), pause=st.sampled_from([0.0, 0.3, 1.0]))
    def kill_instance(self, kind: str, which: int, pause: float) -> None:
        """SIGKILL one process of one kind while the other instance of the kind serves on: its callers
        meet a dead address that the log still holds live until a fresh process takes it over."""
        self._live_now("kill_instance")
        self._kill(which, (kind,))
        self.run(asyncio.sleep(pause))
        self._revive()
        self.steps.append(f"SIGKILL {kind} instance {which}")
        self._count("kill_instance")
        self._count(f"kill_instance_{kind}")

    @rule(kind=st.sampled_from(cfg.KINDS), pause=st.sampled_from([0.3, 1.0]))
    def kill_worker(self, kind: str, pause: float) -> None:
        """SIGKILL one worker of the second instance of a kind: its front records it stopped and the live
        worker takes its sessions over from the log for `pause` s; then the instance starts afresh (a
        front does not restart a worker), so the next sequence meets two workers again."""
        front = self.world.sets[1].procs.get(kind)
        workers = worker_pids(front.pid) if front is not None and front.poll() is None else []
        if not workers:
            return
        self._live_now("kill_worker")
        try:
            os.kill(workers[0], signal.SIGKILL)
        except ProcessLookupError:
            return
        self.run(asyncio.sleep(pause))
        self._kill(1, (kind,))
        self._revive()
        self.steps.append(f"SIGKILL one {kind} worker")
        self._count("kill_worker")

    @rule(delay=st.sampled_from([0.1, 0.25, 0.5]))  # its first 0.1 s or so is reading the log
    def kill_coordinator(self, delay: float) -> None:
        """A coordinator process SIGKILLed `delay` s into a checkpoint (prepare, commit, publish, resume;
        online: the cut, publish)."""
        if self.active is not None:
            return
        ck = f"{self.run_id}-k{next(self.counter)}"
        self._live_now("kill_coordinator")
        child = subprocess.Popen(
            [sys.executable, "-m", "testkit.coordinator_child", "--config", str(self.world.config_path), "--run-id",
             self.run_id, "--rollouts", str(ROLLOUTS), "--checkpoint", ck, "--deadline-s", str(COORDINATOR_DEADLINE_S),
             "--mode", PAUSED if PAUSED in self.MODES else ONLINE],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=ROOT, start_new_session=True)
        assert child.stdin is not None and child.stdout is not None
        try:
            line = self.run(asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 60))
            assert line.strip() == b"ready", f"the coordinator process did not start: {line!r}"
            child.stdin.write(b"go\n")
            child.stdin.flush()
            self.run(asyncio.sleep(delay))
        finally:
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            child.wait()
        phase = self.run(self._rows("SELECT phase FROM rollbook.checkpoints WHERE checkpoint_id = :c", c=ck))
        phase = phase[0].phase if phase else None
        if phase in ("committed", "published"):
            self.restorable.append(ck)  # its cut is whole in the log: restorable, whoever wrote it
        if PAUSED in self.MODES:  # an online checkpoint holds no server
            self.lease_until = time.time() + COORDINATOR_DEADLINE_S + LEASE_GRACE_S + 1.0
        self.steps.append(f"SIGKILL coordinator {delay} s into {ck} (left {phase})")
        self._count("kill_coordinator")
        self._count(f"kill_coordinator_left_{phase}")

    @rule()
    def restart_postgres(self) -> None:
        self._live_now("restart_postgres")
        self.run(asyncio.to_thread(self.world.restart_db))
        self.steps.append("restart PostgreSQL")
        self._count("restart_postgres")

    @rule()
    def drop_connections(self) -> None:
        self._live_now("drop_connections")
        def drop() -> int:
            with psycopg.connect(self.world.dsn, autocommit=True) as conn:
                row = conn.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                                   "WHERE datname = current_database() AND pid <> pg_backend_pid()").fetchone()
                return int(row[0]) if row else 0
        n = self.run(asyncio.to_thread(drop))
        self.steps.append(f"drop {n} connections")
        self._count("drop_connections")

    @rule()
    def checkpoint_and_publish(self) -> None:
        """A whole checkpoint from whatever state it meets, then published. Paused: prepare unless one
        is open, commit it if prepared, publish it if committed (resume is a rule of its own); drawn one
        by one, prepare, commit and publish line up in too few sequences for the faults to meet a
        committed cut. Online: the cut from the log, committed in one step, then published."""
        if ONLINE in self.MODES and PAUSED not in self.MODES:
            if (ck := self._online()) is not None:
                self._publish(ck)
            return
        if self.active is None:
            self.prepare()
        if self.phase == "prepared":
            self.commit()
        if self.phase == "committed":
            self.publish()

    def _take_a_cut(self) -> None:
        """A committed cut, of the machine's mode, for a restore that has none yet."""
        if PAUSED not in self.MODES:
            self._online()
            return
        if self.active is None:
            self.prepare()
        if self.phase == "prepared":
            self.commit()

    @rule()
    def publish_crash_and_restore(self) -> None:
        """A published cut restored at once: with crash_and_restore, a restore is drawn twice as often
        as any other operation, so that it takes effect in a quarter of the sequences or more."""
        self.checkpoint_and_publish()
        self.crash_and_restore()

    @rule()
    def crash_and_restore(self) -> None:
        """Every server SIGKILLed with the framework's dispatches; fresh ones restore the latest cut.

        With no committed cut yet, it first takes one (prepare and commit, or an online cut): drawing
        prepare, commit and this rule in that order by chance is rare, and a restore of real processes
        must be tried."""
        if not self.restorable:
            self._take_a_cut()
            if not self.restorable:
                return
        self._live_now("crash_and_restore")
        self._stop_dispatch()
        for which in range(INSTANCES):
            self._kill(which)
        self._revive()
        ck = self.restorable[-1]
        self.run(self.coordinator().restore(ck, time.time() + DEADLINE_S))
        self.run(self.coordinator().resume(ck))
        self.active, self.phase = None, "idle"
        self.steps.append(f"SIGKILL all, restore {ck}")
        self._count("crash_and_restore")

    # ---- invariants ----------------------------------------------------------------------------

    @invariant()
    def the_log_stays_honest(self) -> None:
        self.run(self._check())

    async def _check(self) -> None:
        for name, sql in (("events after a fence", AFTER_FENCE), ("finished twice", FINISHED_TWICE),
                          ("model call completed twice", CALL_COMPLETED_TWICE),
                          ("model call generated twice for one turn of one attempt", GENERATED_TWICE),
                          ("mutation applied twice in one attempt", MUTATION_TWICE),
                          ("tool call applied twice in one attempt", TOOL_CALL_TWICE),
                          ("agent turn recorded twice in one attempt (work redone)", REPEATED_TURNS),
                          ("restored from an uncommitted checkpoint", RESTORED_FROM_UNCOMMITTED)):
            rows = await self._rows(sql)
            assert not rows, f"{name}: {rows[:5]} after {self.steps}"

    def teardown(self) -> None:
        try:
            if self.coll is not None:
                self.run(self._finish())
        finally:
            for op in self.effects:
                if not op.startswith("sequences"):
                    TALLY[f"sequences_with_{op}"] = TALLY.get(f"sequences_with_{op}", 0) + 1
            self.run(self._close())
            self.loop.close()

    async def _idle(self, until: float) -> dict[str, str]:
        assert self.session is not None
        while True:
            phases = {}
            for kind in cfg.KINDS:
                for which, url in enumerate(self.world.urls(kind)):
                    async with self.session.get(url + "/rollbook/v1/control/status",
                                                headers={"Authorization": f"Bearer {self.world.config.control_token}"}) as resp:
                        phases[f"{kind}{which}"] = (await resp.json())["phase"]
            if all(p == "idle" for p in phases.values()) or time.time() > until:
                return phases
            await asyncio.sleep(0.1)

    async def _finish(self) -> None:
        assert self.coll is not None and self.session is not None
        if self.active is not None:
            await self.coordinator().resume(self.active)
            self.active = None
        if self.dispatching is not None:
            self.dispatching.cancel()
            await asyncio.gather(self.dispatching, return_exceptions=True)
            self.dispatching = None
        # A killed coordinator's checkpoint holds admission closed until its lease runs out; the
        # dispatches below wait it out (admission_closed is retried).
        deadline = time.monotonic() + 90
        while await self.coll.unfinished() and time.monotonic() < deadline:
            await asyncio.wait_for(self.coll.dispatch(self.session), 90)
        left = [self.coll.rollout_id(i) for i in await self.coll.unfinished()]
        if left:
            last = await self._rows("SELECT rollout_id, attempt, kind, writer, left(data::text, 160) AS data FROM rollbook.events "
                                    "WHERE rollout_id = ANY(:left) ORDER BY position DESC LIMIT 12", left=left)
            raise AssertionError(f"rollouts never finished: {left} after {self.steps}; their last events, newest first: "
                                 f"{[tuple(r) for r in last]}")
        phases = await self._idle(max(self.lease_until, time.time()) + 5.0)
        assert all(p == "idle" for p in phases.values()), f"servers not idle at the end: {phases} after {self.steps}"
        await self._check()
        for r in await self._rows(ENDINGS):
            if r.rollout_id in self.retired:
                assert r.finished <= 1, f"retired {r.rollout_id} finished {r.finished} times after {self.steps}"
            else:
                assert (r.finished, r.live, r.finished_attempt) == (1, 0, r.latest), \
                    f"{r.rollout_id}: finished {r.finished}, live {r.live}, finished attempt {r.finished_attempt} " \
                    f"of {r.latest}, after {self.steps}"
        # Across attempts, over every continued attempt's ancestry (recovered from the log or restored).
        for name, sql in (("model calls an ancestor completed before the boundary, generated again", REGENERATED_ACROSS),
                          ("model calls a restored cut held, generated again", REPEATED_CALLS.format(upto="cut")),
                          ("mutations an ancestor applied before the boundary, applied again", REPEATED_MUTATIONS)):
            rows = await self._rows(sql)
            assert not rows, f"{name}: {rows[:5]} after {self.steps}"
        print(f"{self.run_id}: {len(self.steps)} steps checked: {'; '.join(self.steps)}", file=sys.stderr)
        self._count("sequences_checked")
        TALLY["rollouts_finished"] = TALLY.get("rollouts_finished", 0) + ROLLOUTS - len(self.retired)
        if self.progress is not None:
            self.progress(TALLY)

    async def _close(self) -> None:
        if self.dispatching is not None and not self.dispatching.done():
            self.dispatching.cancel()
            await asyncio.gather(self.dispatching, return_exceptions=True)
        if self.session is not None:
            await self.session.close()
        await self.store.close()

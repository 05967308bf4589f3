"""Control operations and real faults in random order against real processes, and the sequences
that random order once found broken, replayed as fixed tests.

testkit/stateful_processes.FaultMachine, over two instances of every kind: SIGKILL of every instance
of any subset of the four kinds, of one instance of one kind, of a coordinator process mid-checkpoint,
a PostgreSQL restart and dropped connections, mixed with dispatch, checkpoints, publish, restore,
retire and forget; every invariant read through the public SQL views after every step and at the end
of every sequence. It runs once per checkpoint mode: a paused run (prepare, commit, publish, resume,
and restores of paused cuts) and an online run (cuts from the log with every server running,
published and restored), so each mode meets every fault. Each run prints how often each operation
took effect, and in how many sequences.

CI runs ROLLBOOK_STATEFUL_EXAMPLES sequences (default 4: hypothesis' simplest, then drawn ones)
of up to ROLLBOOK_STATEFUL_STEPS=10 steps, the drawn ones split between the two modes, each of which
also runs the simplest (boot alone, quick); raise it to run more, or run `benchmarks/soak.py
--machine processes --seeds N`. Each sequence is drawn whole before it runs (testkit/programs.py).
The seed is printed before the run; a failing sequence is printed as hypothesis' falsifying example
(a list of rule names and arguments), not shrunk, and ROLLBOOK_STATEFUL_SEED=<seed> draws the same
sequences again (real processes do not replay them exactly).
"""

from __future__ import annotations

import asyncio
import os
import random
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import text

from adapters import database
from adapters.postgres import PostgresEventStore
from apps import config as cfg
from participants.base.routing import pick
from testkit import pg, programs
from testkit.checkpoint_rules import ONLINE, PAUSED
from testkit.log_queries import tracebacks
from testkit.stateful_processes import INSTANCES, ROLLOUTS, TALLY, FaultMachine, World, start_world

EXAMPLES = int(os.environ.get("ROLLBOOK_STATEFUL_EXAMPLES", "4"))
STEPS = int(os.environ.get("ROLLBOOK_STATEFUL_STEPS", "10"))
SIMPLEST = 1  # the sequence hypothesis tries first in every run, whatever the seed: no step after boot


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    """One database and one set of server processes for the file: each sequence works under its own
    run prefix and leaves every server idle (testkit/stateful_processes.py)."""
    server, restart = pg.restartable_server()
    work = Path(tempfile.mkdtemp(prefix="rbfaults-"))
    print(f"server logs: {work}")
    w = start_world(database.scratch_database(server.admin_dsn, "rollbook_faults"), restart, work)
    try:
        yield w
    finally:
        w.stop()
        server.close()


# The operations only a paused checkpoint takes, and the one only an online checkpoint takes.
PAUSED_ONLY = ("prepare", "prepare_not_ready", "commit", "commit_aborted", "resume")
ONLINE_ONLY = ("online", "online_refused")


@pytest.mark.parametrize("mode", [PAUSED, ONLINE])
def test_random_faults_against_real_processes_keep_every_invariant_of_the_log(world: World, mode: str) -> None:
    # The drawn sequences are split between the two modes, not run again for each: the suite's time
    # stays. Hypothesis starts every run with its simplest sequence (no step after boot), which is quick,
    # so each mode runs it on top of its share.
    share = (EXAMPLES - SIMPLEST + 1) // 2 if mode == PAUSED else (EXAMPLES - SIMPLEST) // 2
    examples = SIMPLEST + max(1, share)
    chosen = int(os.environ.get("ROLLBOOK_STATEFUL_SEED") or random.SystemRandom().randrange(1 << 31))
    print(f"random faults, {mode} checkpoints: seed {chosen}, {examples} sequences of up to {STEPS} steps "
          f"(replay: ROLLBOOK_STATEFUL_SEED={chosen})")
    machine = type("Faults", (FaultMachine,), {"world": world, "MODES": (mode,)})
    before = dict(TALLY)
    # Each sequence is drawn whole before it runs (testkit/programs.py): real processes under real
    # faults do not replay a sequence exactly, which hypothesis' own stateful runner requires.
    programs.run_drawn(machine, examples=examples, most=STEPS, chosen=chosen)
    gained = {op: n - before.get(op, 0) for op, n in sorted(TALLY.items()) if n != before.get(op, 0)}
    print(f"random faults, {mode} checkpoints: operations that took effect: {gained}")
    other = ONLINE_ONLY if mode == PAUSED else PAUSED_ONLY
    assert not {op for op in gained if op in other or op.removeprefix("sequences_with_") in other}, gained
    # No server prints a traceback for any of these faults (a database outage included).
    assert not (found := tracebacks(world.log_dir)), "\n".join(found)


def _replay(world: World, steps: Callable[[FaultMachine], list[Callable[[], None]]],
            before: Callable[[FaultMachine], None] = lambda m: None) -> FaultMachine:
    """Run one fixed sequence as hypothesis would: boot, each step followed by the invariants, teardown
    (every rollout not retired finishes exactly once, every server idle, lineage checked)."""
    machine = type("Fixed", (FaultMachine,), {"world": world})()
    before(machine)
    programs.run(machine, steps(machine))
    assert not (found := tracebacks(world.log_dir)), "\n".join(found)
    return machine


ALL = set(cfg.KINDS)


def test_retired_rollouts_then_a_crash_and_a_restore_of_a_cut_that_holds_them(world: World) -> None:
    """Shrunk from seed 991880827: three rollouts are retired after the cut that continued them, then
    everything is killed and that cut restored again. The restore used to fence the retired attempts
    (refused: stale_attempt), and once that was mended the resources server's resume refused to
    install the cut (no live attempt for a retired rollout), stayed closed, and the last rollout
    waited for it forever without a word. Retired rollouts stay retired; the rest finish."""
    _replay(world, lambda m: [
        lambda: m.kill_servers({"agent"}, 0.0), m.crash_and_restore, lambda: m.retire(2), lambda: m.retire(3),
        lambda: m.retire(0), lambda: m.kill_servers(ALL, 0.0), m.crash_and_restore])


def test_retire_restart_postgres_kill_the_coordinator_then_crash_and_restore(world: World) -> None:
    """The second sequence the same seed shrank to: a retire after a restore, a PostgreSQL restart, a
    coordinator killed early in its checkpoint, every server killed, then a restore. It failed where
    the killed coordinator left nothing restorable, so the restore went back to the first cut, which
    holds the retired rollout; the kill comes at once here (the drawn 0.1 s may let it publish), and
    the test says which cut it restored."""
    def no_new_cut(m: FaultMachine) -> None:
        m.kill_coordinator(0.0)
        assert len(m.restorable) == 1, f"the killed coordinator committed its cut: {m.steps}"
    _replay(world, lambda m: [
        m.crash_and_restore, lambda: m.retire(2), m.restart_postgres, m.dispatch, lambda: no_new_cut(m),
        lambda: m.kill_servers(ALL, 0.0), m.commit, m.crash_and_restore])


# The addresses of the instances that wrote each kind's events of one run's rollouts.
WRITTEN_BY = """
SELECT p.kind, array_agg(DISTINCT COALESCE(p.front, p.address)) AS addresses FROM rollbook.events e
JOIN rollbook.participants p ON p.instance = e.writer WHERE e.rollout_id LIKE :p GROUP BY p.kind
"""


def _every_instance(world: World) -> Callable[[FaultMachine], None]:
    """A run id whose first attempts reach both instances of every kind (participants/base/routing.py:
    each hop picks among the live processes of the callee's kind by (rollout, attempt), an episode
    under attempt 0), so the test does not depend on the luck of the draw. The driver sends every
    other episode straight to the first environment instance, a process that serves what it is sent;
    only the rest meet the rule, at the second instance's front."""
    def choose(m: FaultMachine) -> None:
        # The live processes of each kind, each with its instance's address (a worker's front): the
        # routing rule picks among the processes, and the test wants both instances of every kind.
        with psycopg.connect(database.libpq_dsn(world.dsn), autocommit=True) as conn:
            rows = conn.execute("SELECT kind, address, COALESCE(front, address) FROM rollbook.participants "
                                "WHERE state = 'live'").fetchall()
        sites: dict[str, dict[str, str]] = {}
        for kind, address, site in rows:
            sites.setdefault(kind, {})[address] = site
        assert set(sites) == set(cfg.KINDS), sites

        direct = world.urls("environment")[0].rstrip("/")  # FaultMachine's episodes_url: rollout i to instance i % 2

        def spread(kind: str, site: dict[str, str]) -> bool:
            routed = [i for i in range(ROLLOUTS) if kind != "environment" or i % INSTANCES]
            reached = {site[pick(list(site), f"{m.run_id}-{i:04d}", 0)].rstrip("/") for i in routed}
            return len(reached | ({direct} if kind == "environment" else set())) == INSTANCES
        while not all(spread(kind, site) for kind, site in sites.items()):
            m.run_id += "y"
    return choose


def test_one_instance_of_each_kind_killed_while_the_other_serves_then_a_restore_of_a_published_cut(
        world: World) -> None:
    """Calls spread over both instances of every kind; one process of each kind is SIGKILLed in turn
    (its callers meet a dead address the log holds live until a fresh process supersedes it), around a
    published checkpoint that every instance is then restored from. Each rollout still finishes exactly
    once with nothing done twice, and the tally says which operations took effect in this sequence."""
    before = dict(TALLY)
    m = _replay(world, lambda m: [
        lambda: _until_written(m, world, "model"), lambda: m.kill_instance("model", 1, 0.3),
        lambda: m.kill_instance("agent", 0, 0.0),
        m.checkpoint_and_publish, m.resume, lambda: m.kill_instance("resources", 1, 0.0),
        lambda: m.kill_instance("environment", 0, 0.0), m.dispatch, m.crash_and_restore], before=_every_instance(world))
    gained = {op: n - before.get(op, 0) for op, n in TALLY.items() if n != before.get(op, 0)}
    for op in ("commit", "publish", "crash_and_restore", "kill_instance"):
        assert gained.get(f"sequences_with_{op}") == 1, gained
    assert gained["kill_instance"] == 4, gained
    written = _written_by(m, world)
    for kind in cfg.KINDS:
        assert written.get(kind) == set(world.urls(kind)), f"{kind}: written by {written.get(kind)}"


def test_an_online_cut_published_then_restored_after_an_instance_died(world: World) -> None:
    """The online run's commit, publish and restore, in one fixed sequence (the random one draws
    them by chance): a cut from the log with every server running, published, one model instance
    killed, then every server killed and the cut restored. No paused operation takes effect."""
    before = dict(TALLY)
    _replay(world, lambda m: [
        lambda: m.let_time_pass(0.2), m.checkpoint_and_publish, lambda: m.kill_instance("model", 0, 0.0),
        m.dispatch, m.crash_and_restore], before=lambda m: setattr(m, "MODES", (ONLINE,)))
    gained = {op: n - before.get(op, 0) for op, n in TALLY.items() if n != before.get(op, 0)}
    for op in ("online", "publish", "crash_and_restore"):
        assert gained.get(f"sequences_with_{op}") == 1, gained
    assert not {op for op in gained if op in PAUSED_ONLY}, gained


def _until_written(m: FaultMachine, world: World, kind: str, limit: float = 60.0) -> None:
    """Let the run go on until both instances of `kind` have written some of its events. A fixed pause
    (0.2 s) was once too short on a loaded machine: the instance about to be killed had not taken a
    call yet, and none reached it after its restart, so it had written nothing."""
    async def wait() -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        want = {u.rstrip("/") for u in world.urls(kind)}
        while loop.time() < deadline:
            async with m.store.engine.connect() as conn:
                rows = await conn.execute(text(WRITTEN_BY), {"p": f"{m.run_id}-%"})
                if {a.rstrip("/") for r in rows if r.kind == kind for a in r.addresses} >= want:
                    return
            await asyncio.sleep(0.05)
    m.run(wait())


def _written_by(m: FaultMachine, world: World) -> dict[str, set[str]]:
    async def read() -> dict[str, set[str]]:
        store = PostgresEventStore.connect(world.dsn, writer="spread")
        try:
            async with store.engine.connect() as conn:
                rows = await conn.execute(text(WRITTEN_BY), {"p": f"{m.run_id}-%"})
                return {r.kind: {a.rstrip("/") for a in r.addresses} for r in rows}
        finally:
            await store.close()
    return asyncio.run(read())

"""Issue 9, item 6: control operations and real faults in random order against real processes.

tests/stateful_processes.FaultMachine: SIGKILL of any subset of the four server processes, of a
coordinator process mid-checkpoint, a PostgreSQL restart and dropped connections, mixed with
dispatch, prepare, commit, publish, resume, restore, retire and forget; every invariant read
through the public SQL views after every step and at the end of every sequence.

CI runs ROLLBOOK_STATEFUL_EXAMPLES sequences (default 4, of up to ROLLBOOK_STATEFUL_STEPS=10 steps; raise it to run more, or run
`benchmarks/soak.py --machine processes --seeds N`). The seed is printed before the run; a
failing sequence is shrunk by hypothesis and printed as a list of steps (`state.kill_servers(...)`)
with a `@reproduce_failure` blob, and ROLLBOOK_STATEFUL_SEED=<seed> replays the same run.
"""

from __future__ import annotations

import os
import random
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, seed, settings
from hypothesis.stateful import run_state_machine_as_test

from adapters import database
from tests import pg
from tests.e2e.test_recovery import tracebacks
from tests.stateful_processes import TALLY, FaultMachine, World, start_world

EXAMPLES = int(os.environ.get("ROLLBOOK_STATEFUL_EXAMPLES", "4"))
STEPS = int(os.environ.get("ROLLBOOK_STATEFUL_STEPS", "10"))


@pytest.fixture
def world() -> Iterator[World]:
    server, restart = pg.restartable_server()
    work = Path(tempfile.mkdtemp(prefix="rbfaults-"))
    print(f"server logs: {work}")
    w = start_world(database.scratch_database(server.admin_dsn, "rollbook_faults"), restart, work)
    try:
        yield w
    finally:
        w.procs.stop()
        server.close()


def test_random_faults_against_real_processes_keep_every_invariant_of_the_log(world: World) -> None:
    chosen = int(os.environ.get("ROLLBOOK_STATEFUL_SEED") or random.SystemRandom().randrange(1 << 31))
    print(f"random faults: seed {chosen}, {EXAMPLES} sequences of up to {STEPS} steps "
          f"(replay: ROLLBOOK_STATEFUL_SEED={chosen})")
    machine = seed(chosen)(type("Faults", (FaultMachine,), {"world": world}))
    # No shrinking: real processes under real faults do not replay a sequence exactly, so shrinking ends
    # in hypothesis' Flaky error and hides the failure it set out to shrink. The printed steps say what ran.
    run_state_machine_as_test(machine, settings=settings(
        max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None, database=None, print_blob=True,
        phases=(Phase.explicit, Phase.generate),
        suppress_health_check=list(HealthCheck)))
    print(f"random faults: operations that took effect: {dict(sorted(TALLY.items()))}")
    # Issue 9, item 3: no server prints a traceback for any of these faults (a database outage included).
    assert not (found := tracebacks(world.procs.log_dir)), "\n".join(found)

"""Control operations in random order (testkit/stateful_control.py), a bounded number of sequences for CI.

`benchmarks/soak.py --seeds N` runs many more, one seed each, and prints a table. The seed is
printed first; ROLLBOOK_STATEFUL_SEED=<seed> replays the run, and a failing sequence is shrunk and
printed as its steps with a `@reproduce_failure` blob."""

from __future__ import annotations

import os
import random

from hypothesis import HealthCheck, seed, settings
from hypothesis.stateful import run_state_machine_as_test

from testkit.stateful_control import ControlMachine

EXAMPLES = int(os.environ.get("ROLLBOOK_STATEFUL_EXAMPLES", "6"))


def test_control_operations_in_any_order_keep_every_invariant_of_the_log(dsn: str) -> None:
    chosen = int(os.environ.get("ROLLBOOK_STATEFUL_SEED") or random.SystemRandom().randrange(1 << 31))
    print(f"control operations: seed {chosen}, {EXAMPLES} sequences (replay: ROLLBOOK_STATEFUL_SEED={chosen})")
    ControlMachine.dsn = dsn
    run_state_machine_as_test(seed(chosen)(type("Control", (ControlMachine,), {})), settings=settings(
        max_examples=EXAMPLES, stateful_step_count=12, deadline=None, database=None, print_blob=True,
        suppress_health_check=list(HealthCheck)))

"""Control operations in random order (tests/stateful_control.py), a bounded number of sequences for CI.

`benchmarks/soak.py --seeds N` runs many more, one seed each, and prints a table."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from tests.stateful_control import ControlMachine

EXAMPLES = int(os.environ.get("ROLLBOOK_STATEFUL_EXAMPLES", "6"))


def test_control_operations_in_any_order_keep_every_invariant_of_the_log(dsn: str) -> None:
    ControlMachine.dsn = dsn
    run_state_machine_as_test(ControlMachine, settings=settings(
        max_examples=EXAMPLES, stateful_step_count=12, deadline=None, database=None,
        suppress_health_check=list(HealthCheck)))

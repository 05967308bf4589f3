"""A stateful machine's sequences drawn whole before they run, for machines whose steps are real
processes and real faults.

Hypothesis' own stateful runner draws each step after the previous one has run, and it requires
that the same choices always lead to the same draws: it records every run in a tree and raises
FlakyStrategyDefinition when a later run with a known prefix stops drawing earlier. A sequence of
SIGKILLs, database restarts and timeouts against real processes does not replay exactly, and a CI run
failed that way with every invariant holding. Here a sequence is one drawn value, a list of (rule,
arguments), so what is drawn never depends on what the processes did; it then runs like hypothesis
runs a machine: the initialize rules, each step followed by every invariant, teardown at the end.

The machine's rules, their argument strategies and preconditions come from its hypothesis
decorators (one definition for both runners). A precondition is read from the machine's class,
before anything runs, so it may depend on the class's configuration only (MODES), never on state.
There is no shrinking: a real run does not reproduce a sequence exactly. A failure prints the
sequence as hypothesis' falsifying example, and the machine's own messages say which steps ran.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine

Step = tuple[str, dict[str, Any]]


def steps(machine: type[RuleBasedStateMachine], most: int) -> st.SearchStrategy[list[Step]]:
    """Sequences of up to `most` steps of the machine's rules whose preconditions its class meets."""
    rules = [r for r in machine.setup_state().rules if all(p(machine) for p in r.preconditions)]
    assert rules, f"{machine.__name__}: no rule's precondition holds"
    assert not any(r.targets for r in rules), "rules that fill bundles need hypothesis' own runner"
    one = st.one_of([st.tuples(st.just(r.function.__name__), st.fixed_dictionaries(r.arguments)) for r in rules])
    return st.lists(one, max_size=most)


def run(machine: RuleBasedStateMachine, sequence: list[Callable[[], None]]) -> None:
    """One sequence: the initialize rules, then each step, every invariant after each; teardown always."""
    state = type(machine).setup_state()
    check = [getattr(machine, i.function.__name__) for i in state.invariants]
    try:
        for init in state.initializers:
            assert not init.arguments, f"{init.function.__name__}: an initialize rule with arguments"
            getattr(machine, init.function.__name__)()
        for step in [lambda: None, *sequence]:
            step()
            for invariant in check:
                invariant()
    finally:
        machine.teardown()


def run_drawn(machine: type[RuleBasedStateMachine], *, examples: int, most: int, chosen: int) -> None:
    """`examples` sequences of up to `most` steps, drawn from seed `chosen`, each run on a fresh machine.
    Hypothesis tries the simplest first (no step after the initialize rules, then the first rule)."""
    @seed(chosen)
    @settings(max_examples=examples, deadline=None, database=None, print_blob=True,
              phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck))
    @given(sequence=steps(machine, most))
    def sequences(sequence: list[Step]) -> None:
        m = machine()
        run(m, [partial(getattr(m, name), **arguments) for name, arguments in sequence])

    sequences()

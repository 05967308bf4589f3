"""testkit/programs.py: a machine's sequences drawn whole, then run as hypothesis runs a machine."""

from __future__ import annotations

from typing import ClassVar

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from testkit import programs


def fast(machine: object) -> bool:
    return "fast" in getattr(machine, "MODES", ())


class Recorder(RuleBasedStateMachine):
    MODES: tuple[str, ...] = ("fast",)
    journal: ClassVar[list[list[str]]] = []

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []
        Recorder.journal.append(self.seen)

    @initialize()
    def boot(self) -> None:
        self.seen.append("boot")

    @rule(n=st.integers(0, 3))
    def step(self, n: int) -> None:
        self.seen.append(f"step {n}")

    @precondition(fast)
    @rule()
    def quick(self) -> None:
        self.seen.append("quick")

    @rule()
    def fail(self) -> None:
        self.seen.append("fail")
        raise AssertionError("a step that fails")

    @invariant()
    def checked(self) -> None:
        self.seen.append("check")

    def teardown(self) -> None:
        self.seen.append("teardown")


def test_a_run_is_boot_then_each_step_with_every_invariant_after_it_and_teardown_even_after_a_failure() -> None:
    m = Recorder()
    with pytest.raises(AssertionError, match="a step that fails"):
        programs.run(m, [lambda: m.step(2), m.quick, m.fail, m.quick])
    assert m.seen == ["boot", "check", "step 2", "check", "quick", "check", "fail", "teardown"]


@given(st.data())
def test_a_rule_whose_precondition_the_class_fails_is_never_drawn(data: st.DataObject) -> None:
    slow = type("Slow", (Recorder,), {"MODES": ("slow",)})
    names = {name for name, _ in data.draw(programs.steps(slow, 6))}
    assert "quick" not in names
    assert names <= {"step", "fail"}


def test_drawn_sequences_run_on_fresh_machines_and_the_simplest_comes_first() -> None:
    # A machine without the failing rule, so that every drawn sequence runs to its teardown.
    calm = type("Calm", (Recorder,), {"fail": None})
    Recorder.journal.clear()
    programs.run_drawn(calm, examples=15, most=5, chosen=7)
    runs = list(Recorder.journal)
    assert runs[0] == ["boot", "check", "teardown"]  # no step after boot
    assert len(runs) >= 10 and all(r[:2] == ["boot", "check"] and r[-1] == "teardown" for r in runs)
    assert any("quick" in r for r in runs) and any(s.startswith("step") for r in runs for s in r)

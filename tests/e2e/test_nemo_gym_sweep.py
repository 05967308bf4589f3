"""`rollbook nemo-gym sweep` on five of NeMo Gym 0.7.0's resources servers of different shapes, each
started by rollbook's relay with NeMo Gym's Python and seeded with its own first example row: a tool
server (`workplace_assistant`), one importing its sibling module (`calendar`), one whose seed needs the
row's own field (`example_session_state_mgmt`), a gymnasium-style one (`example_multi_turn_gymnasium`,
reset rather than seeded), an LLM-judged one whose judge nothing defines (`abstention`, its judge
resolved to rollbook's model server), and one whose requirements the install lacks (`math_with_judge`)."""

from __future__ import annotations

import pytest

from apps.nemo_gym_sweep import sweep, table

pytestmark = pytest.mark.timeout(600)


def test_the_sweep_starts_and_seeds_each_server_and_says_why_one_cannot() -> None:
    names = ["workplace_assistant", "calendar", "example_session_state_mgmt", "example_multi_turn_gymnasium",
             "abstention", "math_with_judge"]
    lines: list[str] = []
    verdicts, wall = sweep(names, parallel=2, say=lines.append)
    by = {v.server: v for v in verdicts}
    assert [by[n].verdict for n in names] == ["seeds"] * 5 + ["cannot start"], verdicts
    assert [by[n].protocol for n in names[:5]] == ["tools", "tools", "tools", "gymnasium", "tools"]
    assert by["abstention"].needs == ("a model server: judge_model_server",)
    judge = by["math_with_judge"]
    assert "math_verify" in judge.reason  # the launcher's one line: the import its requirements would bring
    assert "requirements: math-verify, datasets" in judge.needs and "a model server: judge_model_server" in judge.needs
    assert len(lines) == len(names) and lines[-1].startswith(f"[{len(names)}/{len(names)}]")  # progress, a line a server
    text = table(verdicts, wall)
    assert text.startswith(f"6 servers in {wall:.0f} s: 5 seeds, 1 cannot start.")
    assert "| `example_multi_turn_gymnasium` | gymnasium |  | seeds |  |" in text

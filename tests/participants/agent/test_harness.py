"""A harness's command in its jail: the task's prompt arrives as one argument whatever it holds, and
its answer is read from its output."""

from __future__ import annotations

from participants.agent.harness import Harness, HarnessDriver
from participants.environments.sandbox import SandboxLimits
from participants.environments.tasks import make_task

HOSTILE = "What is 1 + 1?' ; touch /home/sandbox/owned ; echo '$(id -u) `id -u` \"$HOME\" \\ {model}\nnext line"


def driver(command: list[str], answer: str | None = None) -> HarnessDriver:
    return HarnessDriver("h", Harness(tuple(command), SandboxLimits(timeout_s=30), answer=answer))


def test_a_prompt_holding_quotes_substitutions_and_placeholders_reaches_the_harness_as_one_argument() -> None:
    """Input: a prompt with a closing quote and a command after it, `$(...)`, backquotes, `$HOME`, a
    placeholder of the command's own and a newline, as a task (or a model that wrote one) may hold."""
    d = driver(["/bin/sh", "-c", 'printf "%s|" "$#" "$1"; ls -A', "harness", "{prompt}"])
    jail = d.sandbox.open_live(make_task("math", 0))
    try:
        output, code, _ = d.sandbox.run_script(jail, d.script(HOSTILE, "http://127.0.0.1:1/v1", "policy", None, "math-1"))
    finally:
        d.sandbox.close_live(jail)
    assert code == 0, output
    # One argument, as written, nothing filled in; nothing ran: the home holds the harness's log alone.
    assert output == f"1|{HOSTILE}|.harness.log\n", output


def test_the_answer_is_the_last_match_of_the_pattern_else_the_last_line() -> None:
    out = "Step 1\nFinal answer: 12\nStep 2\nFinal answer: 42\n[Step 2: Duration 0.01 seconds]\n\n"
    assert driver(["x"], r"^Final answer: (.*)$").answer(out) == "42"
    assert driver(["x"], r"Final answer: \d+").answer(out) == "Final answer: 42"  # no group: the whole match
    assert driver(["x"], r"^Answer: (.*)$").answer(out) == "[Step 2: Duration 0.01 seconds]"  # no match
    assert driver(["x"]).answer(out) == "[Step 2: Duration 0.01 seconds]"
    assert driver(["x"]).answer("") == ""


def test_a_task_is_asked_with_one_hash_seed_every_time_and_tasks_differ() -> None:
    """Python seeds its string hashes at random per process, and a set's order with them: a harness
    that lists a set in its prompt asks something else each run unless the seed is fixed. Fixed per
    task, a crashed run and an uninterrupted one of the same task ask the same things."""
    d = driver(["x"])
    seed = [line for line in d.script("p", "u", "m", None, "math-1").splitlines() if "PYTHONHASHSEED" in line]
    assert seed == [line for line in d.script("p", "u", "m", None, "math-1").splitlines() if "PYTHONHASHSEED" in line]
    assert seed != [line for line in d.script("p", "u", "m", None, "math-2").splitlines() if "PYTHONHASHSEED" in line]
    assert len(seed) == 1

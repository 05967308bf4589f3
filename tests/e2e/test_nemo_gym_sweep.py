"""`rollbook nemo-gym sweep` on NeMo Gym 0.7.0's resources servers of different shapes, each
started by rollbook's relay with NeMo Gym's Python and seeded with its own first example row: a tool
server (`workplace_assistant`), one importing its sibling module (`calendar`), one whose seed needs the
row's own field (`example_session_state_mgmt`), a gymnasium-style one (`example_multi_turn_gymnasium`,
reset rather than seeded), an LLM-judged one whose judge nothing defines (`abstention`, its judge
resolved to rollbook's model server), one that waits at start until its judge answers (`xstest`),
and one whose requirements the install lacks (`math_with_judge`); then the needs, installs, interrupt
and crash checks of others."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from apps.nemo_gym_install import install
from apps.nemo_gym_sweep import needs, sweep, table
from apps.processes import descendants

pytestmark = pytest.mark.timeout(600)


def test_the_sweep_starts_and_seeds_each_server_and_says_why_one_cannot() -> None:
    names = ["workplace_assistant", "calendar", "example_session_state_mgmt", "example_multi_turn_gymnasium",
             "abstention", "xstest", "math_with_judge"]
    lines: list[str] = []
    verdicts, wall = sweep(names, parallel=2, say=lines.append)
    by = {v.server: v for v in verdicts}
    assert [by[n].verdict for n in names] == ["seeds"] * 6 + ["cannot start"], verdicts
    assert [by[n].protocol for n in names[:6]] == ["tools", "tools", "tools", "gymnasium", "tools", "tools"]
    assert by["abstention"].needs == ("a model server: judge_model_server",)
    judge = by["math_with_judge"]
    assert "math_verify" in judge.reason  # the launcher's one line: the import its requirements would bring
    assert "requirements: math-verify, datasets" in judge.needs and "a model server: judge_model_server" in judge.needs
    assert len(lines) == len(names) and lines[-1].startswith(f"[{len(names)}/{len(names)}]")  # progress, a line a server
    text = table(verdicts, wall)
    assert text.startswith(f"7 servers in {wall:.0f} s: 6 seeds, 1 cannot start.")
    assert "| `example_multi_turn_gymnasium` | gymnasium |  | seeds |  |" in text


def test_what_a_server_needs_names_its_own_agent_and_its_sandbox() -> None:
    """NeMo Gym's `scicode` (only its scicode_agent writes a prompt from its rows, which hold no input),
    `gdpval` (its stirrup_agent runs code in an Apptainer container),
    `scale_swe` (a sandbox provider its config names; `litmus_agent`'s config holds the provider's block) and `swe_pivot` and `blackjack` (agents rollbook
    drives: neither is named)."""
    python, _ = install()
    site = next(python.parent.parent.glob("lib/python3*/site-packages")) / "resources_servers"
    assert "its own agent: scicode_agent" in needs(site / "scicode")
    # gdpval's stirrup_agent runs the model's code only in an Apptainer container (a .sif it must be given).
    assert {"its own agent: stirrup_agent", "apptainer (its agent's sandbox)"} <= set(needs(site / "gdpval"))
    assert not any(n.startswith("apptainer") for n in needs(site / "toolsandbox"))
    assert {"its own agent: opencode_sandboxed_agent", "a sandbox provider: sandbox"} <= set(needs(site / "scale_swe"))
    assert not any(n.startswith("its own agent") for n in needs(site / "blackjack") + needs(site / "example_multi_step"))
    assert "a sandbox provider: opensandbox" in needs(site / "litmus_agent")  # the provider's block itself, named
    # competitive_coding_challenges waits at start for NeMo Skills' code-execution service on localhost.
    assert "a code-execution sandbox service" in needs(site / "competitive_coding_challenges")


def test_a_server_that_reaches_for_the_network_at_start_needs_the_network() -> None:
    """Input: NeMo Gym's `bird_sql`, which downloads its databases when it starts (no network here)."""
    (verdict,), _ = sweep(["bird_sql"], parallel=1, say=lambda _line: None)
    assert verdict.verdict == "cannot start" and "network" in verdict.needs, verdict


def test_a_server_that_lacks_its_data_or_a_services_key_or_fetches_its_own_code_says_which() -> None:
    """Input: NeMo Gym's `wordle` (its word list, data/guesses.txt, is made by a script from the network;
    the wheel lacks it), `critpt` (its config class requires the `api_key` of a grading service) and
    `vlm_eval_kit` (it git-clones VLMEvalKit when it starts)."""
    verdicts, _ = sweep(["wordle", "critpt", "vlm_eval_kit"], parallel=2, say=lambda _line: None)
    wordle, critpt, vlm = verdicts
    assert wordle.verdict == "refused" and "data its wheel lacks: data/guesses.txt" in wordle.needs, wordle
    assert critpt.verdict == "cannot start" and "network: a service's api_key" in critpt.needs, critpt
    assert vlm.verdict == "cannot start" and "network" in vlm.needs, vlm


def test_a_server_whose_config_leaves_its_judges_url_to_the_operator_needs_a_model_server_there() -> None:
    """Input: NeMo Gym's `verifif`, its `judge_base_url: ${policy_base_url}` unset (NeMo Gym's env.yaml)."""
    (verdict,), _ = sweep(["verifif"], parallel=1, say=lambda _line: None)
    assert verdict.verdict == "cannot start" and "a model server at a URL you give: policy_base_url" in verdict.needs, verdict


def test_a_server_whose_config_leaves_a_services_key_to_the_operator_needs_that_service() -> None:
    """Input: NeMo Gym's `browsecomp_advanced_harness` with its requirements installed (one of them a
    package in its own folder, `-e ./pocketshell[pcre]`): its config's `${tavily_api_key}`, a web
    search service's key, is unset."""
    (verdict,), _ = sweep(["browsecomp_advanced_harness"], parallel=1, say=lambda _line: None, apart=True)
    assert verdict.verdict == "cannot start" and "tavily_api_key" in verdict.reason, verdict
    assert "network: a service's tavily_api_key" in verdict.needs, verdict
    assert "requirements: tavily-python, ./pocketshell" in verdict.needs, verdict


def test_a_server_that_imports_what_its_requirements_do_not_declare_says_which_module() -> None:
    """Input: NeMo Gym's `code_fim`, installed as `--install` installs it: it imports `human_eval_infilling`,
    which neither its folder (it has no requirements.txt) nor NeMo Gym declares."""
    (verdict,), _ = sweep(["code_fim"], parallel=1, say=lambda _line: None, apart=True)
    assert verdict.verdict == "cannot start", verdict
    assert "a module its requirements do not declare: human_eval_infilling" in verdict.needs, verdict


def test_a_server_whose_requirements_do_not_install_says_so_in_its_row() -> None:
    """Input: NeMo Gym's `tales`, whose requirements.txt names a git URL (no network here): with
    `--install` its row says `cannot install` and pip's reason, and the sweep goes on."""
    (verdict,), _ = sweep(["tales"], parallel=1, say=lambda _line: None, apart=True)
    assert verdict.verdict == "cannot install" and "tale-suite" in verdict.reason, verdict
    assert "network" in verdict.needs, verdict  # git's own line says it could not reach github.com


def test_a_sweep_stopped_with_sigterm_leaves_no_server_behind() -> None:
    """Input: SIGTERM to `rollbook nemo-gym sweep` while NeMo Gym's `example_multi_step` runs under it
    (its server in a process group and session of its own, as every server the sweep starts)."""
    install()
    sweep_proc = subprocess.Popen([sys.executable, "-m", "apps.cli", "nemo-gym", "sweep", "--server", "example_multi_step"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline, below = time.monotonic() + 120, []
    while time.monotonic() < deadline and not any(_launcher(p) for p in below):
        time.sleep(0.1)
        below = descendants(sweep_proc.pid)
    assert any(_launcher(p) for p in below), "the NeMo Gym server never started"
    sweep_proc.send_signal(signal.SIGTERM)
    assert sweep_proc.wait(30) == 128 + signal.SIGTERM
    time.sleep(0.5)
    assert [p for p in below if _alive(p)] == []


def _launcher(pid: int) -> bool:
    try:
        return b"nemo_gym_launcher" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


def test_the_crash_check_runs_a_servers_rows_through_a_sigkill_of_everything_against_an_uninterrupted_run(
        dsn: str) -> None:
    """NeMo Gym's `example_multi_step` (its tools called by the scripted model): killed mid-run, every
    rollout ends with the uninterrupted run's reward and tool calls, sessions rebuilt by replay."""
    (verdict,), _ = sweep(["example_multi_step"], parallel=1, say=lambda _line: None, crash_dsn=dsn)
    assert (verdict.verdict, verdict.crash) == ("seeds", "conforms"), verdict
    killed = re.fullmatch(r"killed at (\d+) of (\d+) model and relayed call events; (\d+) sessions rebuilt, \d+ rollouts "
                          r"continued under a new attempt, (\d+) started over", verdict.crash_reason)
    assert killed, verdict.crash_reason
    at, of, rebuilt, restarted = map(int, killed.groups())
    assert 0 < at < of and rebuilt >= 1 and restarted == 0, verdict.crash_reason


def test_a_server_that_deals_at_random_is_told_apart_from_a_killed_run_that_went_wrong(dsn: str) -> None:
    """NeMo Gym's `blackjack` deals each hand from an unseeded generator: two uninterrupted runs of its
    rows end with other rewards, so the killed run's difference from the first is the server's own chance.
    The check runs its rows once more uninterrupted and says so, instead of `differs` (rollbook's fault)."""
    (verdict,), _ = sweep(["blackjack"], parallel=1, say=lambda _line: None, crash_dsn=dsn)
    assert verdict.verdict == "seeds" and verdict.crash in ("does not replay", "conforms"), verdict
    if verdict.crash_reason.startswith("two uninterrupted runs"):
        assert "its outcomes are its own" in verdict.crash_reason, verdict


def test_a_server_only_its_own_agent_can_play_is_driven_by_that_agent_through_a_sigkill(dsn: str) -> None:
    """NeMo Gym's `toolsandbox`, its requirements installed, and its own `toolsandbox_agent`, both unchanged:
    its rows hold no prompt (the agent writes it from `task_idx`), and the agent seeds it, steps it (each
    step asking rollbook's model server, as the server's user simulator, for the user's turn), closes and
    verifies it. Through the kill every rollout finishes once with the uninterrupted run's reward and calls;
    a session lost mid-episode cannot be rebuilt (its seed hands out a fresh uuid4 `env_id`), so those
    start over, which the check names as the server's own."""
    (verdict,), _ = sweep(["toolsandbox"], parallel=1, say=lambda _line: None, crash_dsn=dsn, apart=True)
    assert "its own agent: toolsandbox_agent" in verdict.needs, verdict
    assert (verdict.verdict, verdict.crash) == ("seeds", "does not replay"), verdict
    assert "(seed_session, key a0.s0) replied" in verdict.crash_reason, verdict


def test_a_judge_call_lost_with_the_killed_model_server_loses_the_attempt_rather_than_failing_it(dsn: str) -> None:
    """NeMo Gym's `false_statement_judge` judges each answer with a model call of its own, made under the
    rollout's capture path to rollbook's model server. Killed halfway (its judge's call in flight), the
    rerun's verify asks that call again: the model server refuses it as lost with the process that held it,
    the NeMo Gym server reports its verify failed (500), and the environment server, finding the lost call
    in the attempt's log, continues the rollout under a new attempt instead of failing it."""
    (verdict,), _ = sweep(["false_statement_judge"], parallel=1, say=lambda _line: None, crash_dsn=dsn)
    assert (verdict.verdict, verdict.crash) == ("seeds", "conforms"), verdict


def test_a_server_that_judges_a_cohort_of_rollouts_outside_any_rollout_gets_them_and_a_judge_of_its_own(
        dsn: str) -> None:
    """NeMo Gym's `genrm_compare`, unchanged: its verify waits for all 16 rollouts of a prompt
    (`num_rollouts_per_prompt`, each tagged `_ng_rollout_index` as NeMo Gym's collector tags repeats), then
    judges them pairwise in a task of no rollout's, its calls naming none. rollbook's model server refuses
    those, NeMo Gym masks the verify, and the check says what the server needs (a judge at a URL given),
    then runs it again with a stand-in judge there: 16 verifies held at once, killed, conforming."""
    (verdict,), _ = sweep(["genrm_compare"], parallel=1, say=lambda _line: None, crash_dsn=dsn)
    assert "a model server at a URL you give: genrm_model (its calls name no rollout)" in verdict.needs, verdict
    assert (verdict.verdict, verdict.crash) == ("seeds", "conforms"), verdict

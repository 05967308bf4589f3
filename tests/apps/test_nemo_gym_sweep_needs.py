"""What a server's failure shows it needs (apps.nemo_gym_sweep.try_server), read from the lines NeMo Gym
0.7.0's own servers said in the sweep of all 143 on this machine (no network, no docker)."""

from __future__ import annotations

from pathlib import Path

import pytest

from apps import nemo_gym_sweep
from apps.nemo_gym_sweep import Verdict

GYM = "/root/.cache/rollbook/nemo-gym-0.7.0/lib/python3.13/site-packages/resources_servers"


@pytest.mark.parametrize("server, verdict, said, need", [
    ("interactive_browser", "refused", 'answered /seed_session with 500: "RuntimeError(\\"Could not install Playwright '
     'Chromium, which the local browser backend needs. `python -m playwright install chromium` exited 1.\\nError: '
     'getaddrinfo ENOTFOUND cdn.playwright.dev', "network"),
    ("wordle", "refused", f"/reset: 500 \"FileNotFoundError('{GYM}/wordle/data/guesses.txt not found. Run `python "
     "resources_servers/wordle/generate_data.py` first.')\"", "data its wheel lacks: data/guesses.txt"),
    ("deepswe", "cannot start", f"FileNotFoundError: DeepSWE tasks directory does not exist: {GYM}/deepswe/data/cache/tasks",
     "data its wheel lacks: data/cache/tasks"),
    ("bigcodebench", "cannot start", "subprocess.CalledProcessError: Command '['uv', 'venv', '--seed', '--python', '3.10', "
     f"'{GYM}/bigcodebench/.bcb_venv']' returned non-zero exit status 2.", "network: uv downloads the Python 3.10 it runs in"),
    ("critpt", "cannot start", "nemo_gym.sweep_critpt: CritPtResourcesServerConfig of resources_servers.critpt.app refuses "
     "its config: api_key.str: Input should be a valid string", "network: a service's api_key"),
    ("finance_sec_search", "cannot start", "RuntimeError: Failed to load SEC ticker data after retries. Server cannot start "
     "without company_tickers.json.", "network"),
    ("speed_bench", "cannot start", "nemo_gym.config_types.ConfigInterpolationError: Config value 'sweep_speed_bench."
     "resources_servers.speed_bench.vllm_base_url' references 'policy_base_url', which is not set after merging.",
     "a model server at a URL you give: policy_base_url"),
    ("cvdp", "cannot start", "nemo_gym.config_types.ConfigInterpolationError: Config value 'sweep_cvdp.resources_servers.cvdp."
     "oss_sim_image' references 'cvdp_sim_image', which is not set after merging.", "a value its config leaves unset: cvdp_sim_image"),
])
def test_a_servers_own_failure_line_names_what_it_needs(monkeypatch: pytest.MonkeyPatch, server: str, verdict: str,
                                                         said: str, need: str) -> None:
    monkeypatch.setattr(nemo_gym_sweep, "_tried", lambda *_args: Verdict(server, "", (), verdict, said))
    needs = nemo_gym_sweep.try_server(Path("/python"), Path("/site"), server).needs
    assert need in needs, needs


def test_a_file_of_its_own_folder_named_in_a_failure_that_is_no_missing_file_is_no_lacking_data(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Input: bigcodebench's failed `uv venv` into its own folder's `.bcb_venv` (a path, not a file not found)."""
    said = f"subprocess.CalledProcessError: Command '['uv', 'venv', '{GYM}/bigcodebench/.bcb_venv']' returned non-zero exit status 2."
    monkeypatch.setattr(nemo_gym_sweep, "_tried", lambda *_args: Verdict("bigcodebench", "", (), "cannot start", said))
    assert not any("data" in n for n in nemo_gym_sweep.try_server(Path("/python"), Path("/site"), "bigcodebench").needs)

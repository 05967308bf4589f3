"""Every configuration mistake ends the command with one line naming the cause and the
fix, exit code 2, and no traceback. Each case names the bad input it tried."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from adapters.database import sibling_url
from apps import config as cfg
from apps.processes import free_port
from participants.environments.tasks import make_tasks

ROLLBOOK = [sys.executable, "-m", "apps.cli"]


@dataclass
class Case:
    args: list[str]
    env: dict[str, str]
    holds: socket.socket | None = None


def write_config(work: Path, dsn: str | None, *, tasks: str | None = None, extra: str = "", run: bool = True) -> Path:
    servers = {k: cfg.ServerConfig(port=free_port()) for k in cfg.KINDS}
    tasks_path = work / "tasks.jsonl"
    tasks_path.write_text("".join(json.dumps(t.to_json()) + "\n" for t in make_tasks(2, 1, ["math"])))
    config = cfg.Config(dsn=dsn, control_token="control-t0k", data_token="data-t0ken", servers=servers,
                        run=cfg.RunConfig(run_id="cfg", tasks=tasks or str(tasks_path)) if run else None)
    path = work / "rollbook.toml"
    cfg.write(config, path)
    if extra:
        path.write_text(path.read_text() + extra)
    return path


def wrong_dsn_unreachable(work: Path, dsn: str) -> Case:
    return Case(["db", "url", "--dsn", f"postgresql://someone:pw@127.0.0.1:{free_port()}/rollbook"], {})


def wrong_dsn_no_such_database(work: Path, dsn: str) -> Case:
    return Case(["checkpoint", "status", "--dsn", sibling_url(dsn, "no_such_database_i9a")], {})


def key_value_dsn(work: Path, dsn: str) -> Case:
    return Case(["db", "upgrade", "--dsn", "host=127.0.0.1 port=5432 dbname=rollbook user=postgres"], {})


def key_value_dsn_in_the_config(work: Path, dsn: str) -> Case:
    return Case(["serve", "model", "--config", str(write_config(work, "host=127.0.0.1 dbname=rollbook"))], {})


def unwritable_rollbook_home(work: Path, dsn: str) -> Case:
    blocker = work / "a-file"
    blocker.write_text("")
    return Case(["db", "url"], {"ROLLBOOK_HOME": str(blocker / "home")})


def missing_config_file(work: Path, dsn: str) -> Case:
    return Case(["run", "--config", str(work / "nowhere.toml")], {})


def missing_tasks_file(work: Path, dsn: str) -> Case:
    return Case(["run", "--config", str(write_config(work, dsn, tasks=str(work / "missing.jsonl")))], {})


def malformed_toml(work: Path, dsn: str) -> Case:
    path = work / "rollbook.toml"
    path.write_text('token = "t"\n[servers.model\nport = 1\n')
    return Case(["run", "--config", str(path)], {})


def unknown_config_key(work: Path, dsn: str) -> Case:
    return Case(["run", "--config", str(write_config(work, dsn, extra="checkpoint_evry_s = 5\n"))], {})


def port_in_use(work: Path, dsn: str) -> Case:
    path = write_config(work, dsn)
    port = cfg.load(path).servers["model"].port
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", port))
    holder.listen()
    return Case(["serve", "model", "--config", str(path)], {}, holds=holder)


def unreachable_servers(work: Path, dsn: str) -> Case:
    return Case(["run", "--config", str(write_config(work, dsn))], {})


def unknown_environment_in_tasks(work: Path, dsn: str) -> Case:
    tasks = work / "bad-tasks.jsonl"
    tasks.write_text(json.dumps(make_tasks(1, 1, ["math"])[0].to_json()) + "\n"
                     + json.dumps({"env": "chess", "task_id": "c1", "prompt": "play", "params": {}}) + "\n")
    return Case(["run", "--config", str(write_config(work, dsn, tasks=str(tasks)))], {})


def model_section(work: Path, dsn: str, lines: str) -> Path:
    path = write_config(work, dsn)
    path.write_text(path.read_text().replace("[servers.model]\n", f"[servers.model]\n{lines}"))
    return path


def unknown_generation_backend(work: Path, dsn: str) -> Case:
    return Case(["serve", "model", "--config", str(model_section(work, dsn, 'backend = "gpt5"\n'))], {})


def upstream_backend_without_url(work: Path, dsn: str) -> Case:
    return Case(["serve", "model", "--config", str(model_section(work, dsn, 'backend = "openai_compatible"\n'))], {})


def config_open_to_others(work: Path, dsn: str) -> Case:
    path = write_config(work, dsn)
    path.chmod(0o640)  # what `cp` or an editor under umask 022 leaves: the group reads both credentials
    return Case(["serve", "model", "--config", str(path)], {})


def control_token_on_the_command_line(work: Path, dsn: str) -> Case:
    return Case(["checkpoint", "status", "--dsn", dsn, "--control-token", "control-t0k"], {})


def control_token_file_open_to_others(work: Path, dsn: str) -> Case:
    token = work / "control-token"
    token.write_text("control-t0k\n")
    token.chmod(0o644)
    return Case(["checkpoint", "status", "--dsn", dsn, "--control-token-file", str(token),
                 "--participant", f"model=http://127.0.0.1:{free_port()}"], {})


def with_tables(work: Path, dsn: str, tables: str) -> Path:
    path = write_config(work, dsn)
    path.write_text(path.read_text() + tables)
    return path


def harness_without_a_sandbox(work: Path, dsn: str) -> Case:
    tables = '\n[harness.smol]\ncommand = ["{python}", "-m", "smolagents.cli", "{prompt}"]\n'
    return Case(["serve", "agent", "--config", str(with_tables(work, dsn, tables))], {})


def harness_answer_not_a_regex(work: Path, dsn: str) -> Case:
    tables = '\n[sandbox]\n\n[harness.smol]\ncommand = ["smol", "{prompt}"]\nanswer = "^Final answer: (.*$"\n'
    return Case(["serve", "agent", "--config", str(with_tables(work, dsn, tables))], {})


def harness_path_not_absolute(work: Path, dsn: str) -> Case:
    tables = '\n[sandbox]\n\n[harness.smol]\ncommand = ["smol"]\npaths = ["../../etc"]\n'
    return Case(["serve", "agent", "--config", str(with_tables(work, dsn, tables))], {})


# (the bad input, words the one line must say: the cause first, then where the fix goes)
CASES: list[tuple[Callable[[Path, str], Case], list[str]]] = [
    (wrong_dsn_unreachable, ["cannot connect to PostgreSQL", "Connection refused", "ROLLBOOK_DSN"]),
    (wrong_dsn_no_such_database, ["cannot connect to PostgreSQL", "no_such_database_i9a", "--dsn"]),
    (key_value_dsn, ["key=value DSN", "postgresql://"]),
    (key_value_dsn_in_the_config, ["key=value DSN", "postgresql://"]),
    (unwritable_rollbook_home, ["ROLLBOOK_HOME", "a-file/home", "writable"]),
    (missing_config_file, ["nowhere.toml", "not found", "--config"]),
    (missing_tasks_file, ["missing.jsonl", "not found", "[run] tasks"]),
    (malformed_toml, ["not valid TOML", "line 2"]),
    (unknown_config_key, ["unknown key", "run.checkpoint_evry_s", "spelling"]),
    (port_in_use, ["already in use", "[servers.model] port"]),
    (unreachable_servers, ["cannot reach the environment server", "rollbook serve environment"]),
    (unknown_environment_in_tasks, ["bad-tasks.jsonl:2", "unknown environment 'chess'", "math"]),
    (unknown_generation_backend, ["servers.model.backend", "'gpt5' is not a registered generation backend",
                                  "openai_compatible, scripted"]),
    (upstream_backend_without_url, ["openai_compatible backend has no url", "[servers.model]"]),
    (config_open_to_others, ["rollbook.toml holds a credential", "open to group or others (mode 0640)",
                             "chmod 600 /", "rollbook.toml"]),
    (control_token_on_the_command_line, ["--control-token puts the control credential on the command line",
                                         "ROLLBOOK_CONTROL_TOKEN", "--control-token-file PATH"]),
    (control_token_file_open_to_others, ["control token file", "open to group or others (mode 0644)",
                                         "chmod 600 /"]),
    (harness_without_a_sandbox, ["harness.smol", "runs in a sandbox session", "[sandbox]"]),
    (harness_answer_not_a_regex, ["harness.smol.answer", "no regular expression", "missing )"]),
    (harness_path_not_absolute, ["harness.smol.paths", "'../../etc'", "absolute"]),
]


@pytest.mark.parametrize("make, says", CASES, ids=[m.__name__ for m, _ in CASES])
def test_a_configuration_mistake_is_one_line_naming_cause_and_fix_with_exit_code_2(
        make: Callable[[Path, str], Case], says: list[str], dsn: str, tmp_path: Path) -> None:
    case = make(tmp_path, dsn)
    env = {**os.environ, "ROLLBOOK_HOME": str(tmp_path / "home"), **case.env}
    env.pop("ROLLBOOK_DSN", None)
    try:
        out = subprocess.run([*ROLLBOOK, *case.args], env=env, capture_output=True, text=True, timeout=60)
    finally:
        if case.holds is not None:
            case.holds.close()
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert len(lines) == 1 and lines[0].startswith("rollbook: error: "), out.stderr
    for words in says:
        assert words in lines[0], lines[0]

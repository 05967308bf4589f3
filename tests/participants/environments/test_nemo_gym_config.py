"""The `[nemo_gym.<name>]` tables: each names a NeMo Gym resources server as an environment of that name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from apps import config as cfg
from apps.nemo_gym_install import installed_python
from apps.nemo_gym_tasks import convert
from engine.errors import ConfigError, InvalidRequest

SERVERS = {k: cfg.ServerConfig(port=9000 + i) for i, k in enumerate(cfg.KINDS)}
WORKPLACE = "resources_servers.workplace_assistant.app"


def config(**nemo_gym: cfg.NemoGymConfig) -> cfg.Config:
    return cfg.Config(control_token="control-t0k", data_token="data-t0ken", servers=SERVERS, nemo_gym=nemo_gym)


def test_a_table_round_trips_and_each_server_is_an_environment_of_the_deployment(tmp_path: Path) -> None:
    written = config(gym_workplace=cfg.NemoGymConfig(module=WORKPLACE, state="replay", python="/opt/gym/bin/python",
                                                     paths=["/src/Gym"], port=9100),
                     gym_ruler=cfg.NemoGymConfig(module="resources_servers.ruler.app", url="http://127.0.0.1:9200"),
                     gym_plain=cfg.NemoGymConfig(module=WORKPLACE))
    cfg.write(written, tmp_path / "rollbook.toml")
    loaded = cfg.load(tmp_path / "rollbook.toml")
    assert loaded.nemo_gym == written.nemo_gym
    assert {"gym_workplace", "gym_ruler", "gym_plain"} <= loaded.environments()
    servers = {s.name: s for s in loaded.gym_servers(port=lambda: 9300)}
    assert servers["gym_workplace"].state == "replay" and servers["gym_workplace"].paths == ("/src/Gym",)
    assert servers["gym_workplace"].port == 9100  # its own port wins
    assert (servers["gym_ruler"].url, servers["gym_ruler"].python, servers["gym_ruler"].port) == \
        ("http://127.0.0.1:9200", None, None)  # the operator runs it: nothing to start
    # A server that declares nothing is restart_only; rollbook starts it with the installed NeMo Gym.
    assert servers["gym_plain"].state == "restart_only"
    assert (servers["gym_plain"].python, servers["gym_plain"].port) == (str(installed_python()), 9300)


@pytest.mark.parametrize("table, problem", [
    ('[nemo_gym.workplace]\nmodule = "resources_servers.workplace_assistant.app"\n', "nemo_gym.workplace"),
    ('[nemo_gym.g]\nmodule = "resources_servers.x.app"\nstate = "deterministic"\n', "nemo_gym.g.state"),
    ('[nemo_gym.g]\nmodule = "../../etc/passwd"\n', "nemo_gym.g.module"),
    ('[nemo_gym.g]\nmodule = "m"\ncookie = "x"\n', "nemo_gym.g.cookie"),
    ('[nemo_gym.g]\nmodule = "m"\nmodels = { genrm_model = "https://judge:8000" }\n', "nemo_gym.g.models"),
    ('[nemo_gym.g]\nmodule = "m"\nmodels = { genrm_model = "http://judge" }\n', "nemo_gym.g.models"),
    ('[nemo_gym.g]\nmodule = "m"\nmodels = { "a b" = "http://judge:8000" }\n', "nemo_gym.g.models"),
], ids=["shadows-a-registered-environment", "unknown-state", "not-a-module", "unknown-key", "model-over-https",
        "model-without-port", "model-name-with-space"])
def test_a_bad_table_is_refused_naming_it(tmp_path: Path, table: str, problem: str) -> None:
    cfg.write(config(), tmp_path / "rollbook.toml")
    path = tmp_path / "rollbook.toml"
    path.write_text(path.read_text() + "\n" + table)
    with pytest.raises(ConfigError) as caught:
        cfg.load(path)
    assert problem in str(caught.value)


def test_from_gym_with_an_environment_binds_each_data_row_as_it_is() -> None:
    rows = [{"id": 7, "responses_create_params": {"input": [{"role": "system", "content": "Today is Monday."},
                                                            {"role": "user", "content": "Reply to Ana."}],
                                                  "tools": [{"type": "function", "name": "email_reply_email",
                                                             "parameters": {"type": "object"}}]},
             "ground_truth": [], "category": "email", "environment_name": "workplace_assistant"},
            {"responses_create_params": {"input": "What is 2 + 2?"}, "outputs": ["4"]}]
    tasks = convert([json.dumps(r) for r in rows], "rows.jsonl", "gym_workplace")
    assert [(t.env, t.task_id, t.prompt) for t in tasks] == [
        ("gym_workplace", "7", "Today is Monday.\n\nReply to Ana."), ("gym_workplace", "1", "What is 2 + 2?")]
    assert [t.params["row"] for t in tasks] == rows  # verify gets the row's own fields back
    with pytest.raises(InvalidRequest, match="rows.jsonl:2"):
        convert([json.dumps(rows[0]), json.dumps({"id": 1})], "rows.jsonl", "gym_workplace")


def test_rollbook_run_takes_tasks_of_the_configs_nemo_gym_servers_and_no_other_unknown_one(tmp_path: Path) -> None:
    from apps.run import load_tasks

    tasks = convert([json.dumps({"id": 3, "responses_create_params": {"input": "hi"}})], "rows.jsonl", "gym_workplace")
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(tasks[0].to_json()) + "\n")
    assert load_tasks(path, frozenset({"gym_workplace"})) == tasks
    with pytest.raises(ConfigError, match="unknown environment 'gym_workplace'"):
        load_tasks(path)


async def test_a_tool_name_never_reaches_another_path_or_an_endpoint_of_the_server() -> None:
    from participants.environments import ToolError
    from participants.environments.nemo_gym_relay import Live, NemoGymEnvironment

    live = Live("http://127.0.0.1:9", None, 1.0)  # nothing listens: a request sent would be LiveGone
    for name in ("../verify", "verify", "seed_session", "a/b", "email..x?y", "x" * 129):
        with pytest.raises(ToolError, match="not a tool of this server"):
            await NemoGymEnvironment._send(live, name, {})


async def test_a_server_killed_between_its_headers_and_its_body_is_a_live_session_gone() -> None:
    """Input: a reply that promises 37 bytes of body and closes the connection before sending any (what a
    SIGKILLed NeMo Gym server leaves mid-reply). It is LiveGone, which rebuilds the session in a fresh
    process, not an unhandled error that leaves the rollout unfinished."""
    import socket
    import threading

    from participants.environments.nemo_gym_relay import Live, LiveGone

    listener = socket.create_server(("127.0.0.1", 0))

    def answer_half() -> None:
        conn, _ = listener.accept()
        # The whole request is read first: closing with any of it unread would reset the connection
        # (an OSError) rather than end a reply short.
        request = b""
        while b"\r\n\r\n" not in request:
            request += conn.recv(65536)
        head, body = request.split(b"\r\n\r\n", 1)
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        while len(body) < length:
            body += conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 37\r\n\r\n")
        conn.close()

    server = threading.Thread(target=answer_half, daemon=True)
    server.start()
    live = Live(f"http://127.0.0.1:{listener.getsockname()[1]}", None, 5.0)
    try:
        with pytest.raises(LiveGone, match="ClientPayloadError"):
            await live.post("/company_directory_find_email_address", {"name": "x"})
    finally:
        server.join(5)
        listener.close()


def test_a_model_server_given_by_url_reaches_the_server_as_a_named_server_beside_rollbooks() -> None:
    """Input: `models = { genrm_model = "http://u:secret@10.0.0.5:8000" }` (genrm_compare's GenRM judge)."""
    loaded = config(gym_genrm=cfg.NemoGymConfig(module="resources_servers.genrm_compare.app",
                                                models={"genrm_model": "http://u:secret@10.0.0.5:8000"}))
    servers = json.loads(loaded.gym_servers(port=lambda: 9300)[0].servers)
    assert servers["genrm_model"] == {"responses_api_models": {"given": {
        "entrypoint": "given", "host": "u:secret@10.0.0.5", "port": 8000}}}  # NeMo Gym sends the credential
    assert "rollbook" in servers["rollbook_model"]["responses_api_models"]  # the others still resolve to rollbook's


def test_from_gym_with_repeats_tags_each_rows_repeats_as_nemo_gyms_collector_does() -> None:
    """Input: two rows, repeats = 3 (NeMo Gym's num_repeats); then repeats without an environment, and 0."""
    rows = [{"id": "a", "responses_create_params": {"input": "one"}}, {"responses_create_params": {"input": "two"}}]
    tasks = convert([json.dumps(r) for r in rows], "rows.jsonl", "gym_genrm", repeats=3)
    assert [t.task_id for t in tasks] == ["a.0", "a.1", "a.2", "1.0", "1.1", "1.2"]
    assert [(t.params["row"]["_ng_task_index"], t.params["row"]["_ng_rollout_index"]) for t in tasks] == \
        [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert [t.prompt for t in tasks] == ["one"] * 3 + ["two"] * 3
    with pytest.raises(InvalidRequest, match="repeats take an env"):
        convert([json.dumps(rows[0])], "rows.jsonl", None, repeats=2)
    with pytest.raises(InvalidRequest, match="at least 1"):
        convert([json.dumps(rows[0])], "rows.jsonl", "gym_genrm", repeats=0)

"""NeMo Gym's wire format on rollbook's environment and agent servers (all four servers real).

The request and response shapes are NeMo Gym 0.7.0's (`nemo_gym/episode_types.py`); the
collector-level test against the real `ng_collect_rollouts` is tests/e2e/test_nemo_gym.py.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from sqlalchemy import text

from adapters.participant_client import HttpParticipant
from adapters.postgres import PostgresEventStore
from apps.run import load_tasks
from apps.stack import CREDS, TOKEN, Stack, start_stack
from engine.admission import JOINING
from participants.base.nemo_gym_rows import EpisodeResponse, flat_row_task, scoped_rollout_id
from participants.environments import ENVIRONMENTS, Task, enabled_environments
from participants.environments.tasks import make_task
from participants.model.backends.scripted import ScriptedBackend

pytestmark = pytest.mark.timeout(120)
ROLLBOOK = [sys.executable, "-m", "apps.cli"]


@contextlib.asynccontextmanager
async def stack(dsn: str, tag: str) -> AsyncIterator[Stack]:
    s = await start_stack(dsn, tag, ScriptedBackend())
    s.participant("agent").environment_url = s.url("environment")  # type: ignore[attr-defined]
    try:
        yield s
    finally:
        await s.close()


def episode(taskset: str, rollout_id: str, task_input: dict[str, Any], attempt: int = 0,
            task_id: str = "t0") -> dict[str, Any]:
    return {"episode_id": {"rollout_id": rollout_id, "attempt": attempt},
            "task": {"task_id": {"taskset": taskset, "task_id": task_id}, "task_input": task_input}}


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


# How NeMo Gym's client authenticates: the data credential in the server address, which aiohttp sends
# as HTTP Basic (http://rollbook:<data credential>@host:port).
GYM_AUTH = basic("rollbook", CREDS.data)


async def post(url: str, body: Any, headers: dict[str, str] | None = GYM_AUTH) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.post(url, json=body, headers=headers) as resp:
        return resp.status, await resp.json()


async def rows(store: PostgresEventStore, sql: str, **params: Any) -> list[Any]:
    async with store.engine.connect() as conn:
        return list(await conn.execute(text(sql), params))


async def scalar(store: PostgresEventStore, sql: str, **params: Any) -> Any:
    async with store.engine.connect() as conn:
        return (await conn.execute(text(sql), params)).scalar()


MATH = {"env": "math", "generate": 0}
BLACKJACK = {"env": "blackjack", "generate": 6, "seed": 7}
WRONG_SUM = {"env": "math", "prompt": "What is 2 + 3?", "params": {"expression": "2 + 3", "answer": 6}}  # verify fails


async def test_run_answers_an_episode_in_nemo_gyms_response_shape(dsn: str) -> None:
    async with stack(dsn, "shape") as s:
        status, body = await post(f"{s.url('environment')}/run", episode("blackjack:train", "0-0", BLACKJACK))
    assert status == 200
    assert set(body) == {"episode_id", "task_id", "result"}
    assert body["episode_id"] == {"rollout_id": "0-0", "attempt": 0}
    assert body["task_id"] == {"taskset": "blackjack:train", "task_id": "t0"}
    EpisodeResponse.model_validate(body)  # extra="forbid": nothing but the 0.7.0 fields
    result = body["result"]
    assert isinstance(result["reward"], float)
    kinds = [item["type"] for item in result["response"]["output"]]
    # blackjack is multi-turn: tool calls, their outputs, then the final message
    assert kinds[0] == "function_call" and "function_call_output" in kinds and kinds[-1] == "message"
    assert result["rollbook"]["rollout_id"] == scoped_rollout_id("blackjack:train", "0-0")
    assert result["rollbook"]["steps"] == ["seed", "agent", "verify", "close"]


async def test_the_same_rollout_id_in_two_tasksets_is_two_rollouts(dsn: str, store: PostgresEventStore) -> None:
    async with stack(dsn, "two") as s:
        _, a = await post(f"{s.url('environment')}/run", episode("math:a", "0-0", MATH))
        _, b = await post(f"{s.url('environment')}/run", episode("math:b", "0-0", {"env": "math", "generate": 1}))
    assert a["result"]["rollbook"]["rollout_id"] != b["result"]["rollbook"]["rollout_id"]
    finished = await scalar(store, "SELECT count(DISTINCT rollout_id) FROM rollbook.attempts WHERE status = 'finished'")
    assert finished == 2
    # a taskset slug that sanitises to the same text is still another taskset
    assert scoped_rollout_id("math:a", "0-0") != scoped_rollout_id("math_a", "0-0")


async def test_the_same_episode_again_answers_the_recorded_result_and_runs_nothing(
        dsn: str, store: PostgresEventStore) -> None:
    body = episode("blackjack:train", "3-1", BLACKJACK)
    async with stack(dsn, "again") as s:
        _, first = await post(f"{s.url('environment')}/run", body)
        head = await store.head()
        _, again = await post(f"{s.url('environment')}/run", body)
        # a later caller attempt of a finished rollout is answered the same way: it never runs twice
        _, later = await post(f"{s.url('environment')}/run", {**body, "episode_id": {"rollout_id": "3-1", "attempt": 1}})
        assert await store.head() == head  # nothing written by either
    assert again == first
    assert later["result"] == first["result"] and later["episode_id"]["attempt"] == 1


async def test_a_bad_episode_request_is_400_and_writes_nothing(dsn: str, store: PostgresEventStore) -> None:
    async with stack(dsn, "bad") as s:
        head = await store.head()
        url = f"{s.url('environment')}/run"
        extra = {**episode("math:a", "0-0", MATH), "unexpected": 1}
        unknown_env = episode("math:a", "0-0", {"env": "chess", "generate": 0})
        reserved = episode("math:a", "0-a1", MATH)
        both = episode("math:a", "0-0", {"env": "math", "generate": 0, "prompt": "2+2?"})
        for bad in (extra, unknown_env, reserved, both):
            status, reply = await post(url, bad)
            assert (status, reply["error"]["code"]) == (400, "invalid_request"), bad
        assert await store.head() == head


async def test_the_gym_fronts_need_the_data_credential_and_refuse_anything_else_writing_nothing(
        dsn: str, store: PostgresEventStore) -> None:
    async with stack(dsn, "auth") as s:
        head = await store.head()
        body = episode("math:a", "0-0", MATH)
        row = {"responses_create_params": {"input": "Reverse the string 'ab'."}, "expected_answer": "ba",
               "_ng_task_index": 0, "_ng_rollout_index": 0}
        refused = {}
        for server, path, payload in (("environment", "/run", body), ("agent", "/run", row),
                                      ("environment", "/aggregate_metrics", {"verify_responses": []}),
                                      ("agent", "/aggregate_metrics", {"verify_responses": []})):
            url = f"{s.url(server)}{path}"
            for name, headers in (
                    ("none", None),
                    ("wrong basic", basic("rollbook", "not-a-credential")),
                    ("not base64", {"Authorization": "Basic %%%"}),
                    ("no password", basic(CREDS.data, "")),
                    ("wrong bearer", {"Authorization": "Bearer not-a-credential"}),
                    ("control basic", basic("rollbook", CREDS.control)),
                    ("control bearer", {"Authorization": f"Bearer {CREDS.control}"})):
                status, reply = await post(url, payload, headers)
                refused[(server, path, name)] = (status, reply["error"]["code"])
        assert await store.head() == head  # nothing written by any refused request
        bearer = await post(f"{s.url('environment')}/run", body, {"Authorization": f"Bearer {CREDS.data}"})
        gym = await post(f"{s.url('agent')}/run", row)  # GYM_AUTH: what NeMo Gym's client sends
    for (server, path, name), got in refused.items():
        expected = (403, "forbidden") if name.startswith("control") else (401, "unauthorized")
        assert got == expected, (server, path, name, got)
    assert bearer[0] == 200 and "result" in bearer[1], bearer
    assert gym[0] == 200 and gym[1]["reward"] == 1.0, gym


async def test_basic_auth_opens_only_the_gym_fronts(dsn: str, store: PostgresEventStore) -> None:
    async with stack(dsn, "basiconly") as s:
        head = await store.head()
        task = {"env": "math", "task_id": "m", "prompt": "What is 1 + 1?", "params": {"expression": "1 + 1", "answer": 2}}
        episodes = await post(f"{s.url('environment')}/episodes", {"rollout_id": "b-0", "task": task})
        async with aiohttp.ClientSession() as http, http.get(f"{s.url('environment')}/rollbook/v1/control/status",
                                                            headers=basic("rollbook", CREDS.control)) as resp:
            control = resp.status, await resp.json()
        assert await store.head() == head
    assert (episodes[0], episodes[1]["error"]["code"]) == (401, "unauthorized")
    assert (control[0], control[1]["error"]["code"]) == (401, "unauthorized")


async def test_the_sandbox_through_the_gym_front_is_forbidden_unless_configured(
        dsn: str, store: PostgresEventStore) -> None:
    async with stack(dsn, "gymsandbox") as s:
        s.participant("environment").environments = enabled_environments(sandbox=False)  # type: ignore[attr-defined]
        head = await store.head()
        status, reply = await post(f"{s.url('environment')}/run",
                                   episode("sh:a", "0-0", {"env": "sandbox", "prompt": "run id", "params": {}}))
        assert await store.head() == head
    assert (status, reply["error"]["code"]) == (403, "forbidden")


async def test_a_different_task_under_a_recorded_rollout_is_a_conflict(dsn: str, store: PostgresEventStore) -> None:
    async with stack(dsn, "conflict") as s:
        await post(f"{s.url('environment')}/run", episode("math:a", "0-0", MATH))
        head = await store.head()
        status, reply = await post(f"{s.url('environment')}/run", episode("math:a", "0-0", {"env": "math", "generate": 5}))
        assert (status, reply["error"]["code"]) == (409, "task_conflict")
        assert await store.head() == head


def test_flat_rows_pick_their_environment_by_the_documented_rule() -> None:
    explicit = {"responses_create_params": {"input": [{"role": "user", "content": "hi"}]},
                "rollbook": {"env": "blackjack", "generate": 3}}
    _, chosen = flat_row_task(explicit)
    assert (chosen.env, chosen.generate) == ("blackjack", 3)
    answer = {"responses_create_params": {"input": [{"role": "system", "content": "be brief"},
                                                    {"role": "user", "content": [{"type": "input_text", "text": "Reverse 'ab'"}]}]},
              "expected_answer": "ba"}
    task_id, chosen = flat_row_task(answer)
    assert (chosen.env, chosen.prompt, chosen.params) == ("string_match", "Reverse 'ab'", {"expected": "ba"})
    assert task_id.taskset == f"flat:{task_id.task_id}"
    with pytest.raises(Exception, match="no rule picks its environment"):
        flat_row_task({"responses_create_params": {"input": "x"}, "_ng_task_index": 4})


async def test_the_agent_answers_legacy_agent_rows_with_the_row_a_response_and_a_reward(
        dsn: str, store: PostgresEventStore) -> None:
    row = {"responses_create_params": {"input": [{"role": "user", "content": "Reverse the string 'abcde'. Reply with the result only."}]},
           "expected_answer": "edcba", "agent_ref": {"name": "rollbook_agent"}, "_ng_task_index": 0, "_ng_rollout_index": 0,
           "note": "kept"}
    async with stack(dsn, "flat") as s:
        status, out = await post(f"{s.url('agent')}/run", row)
        assert status == 200, out
        status, plain = await post(f"{s.url('agent')}/run", {"task": {}})
        assert (status, plain["error"]["code"]) == (400, "rollout_id_required")
        status, metrics = await post(f"{s.url('agent')}/aggregate_metrics", {"verify_responses": [out]})
    assert {k: out[k] for k in row} == row
    assert out["reward"] == 1.0
    assert out["response"]["output"][-1]["content"][0]["text"] == "edcba"
    assert metrics["key_metrics"] == {"mean/reward": 1.0}
    assert await scalar(store, "SELECT count(*) FROM rollbook.attempts WHERE status = 'finished'") == 1


def test_tasks_from_gym_converts_materialized_and_flat_rows(tmp_path: Path) -> None:
    rows = [
        {"task_id": {"taskset": "math:train", "task_id": "m0"}, "task_input": {"env": "math", "generate": 0}},
        {"responses_create_params": {"input": [{"role": "user", "content": "Uppercase the string 'ab'."}]},
         "expected_answer": "AB", "agent_ref": {"name": "a"}},
        {"responses_create_params": {"input": "hi"}, "rollbook": {"env": "blackjack", "generate": 2}},
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "tasks.jsonl"
    done = subprocess.run([*ROLLBOOK, "tasks", "from-gym", str(src), "-o", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    tasks = [Task.from_json(json.loads(line)) for line in out.read_text().splitlines()]
    assert tasks[0] == Task("math", "m0", make_task("math", 0).prompt, make_task("math", 0).params)
    assert (tasks[1].env, tasks[1].prompt, tasks[1].params) == ("string_match", "Uppercase the string 'ab'.", {"expected": "AB"})
    assert (tasks[2].env, tasks[2].params) == ("blackjack", make_task("blackjack", 2).params)
    assert load_tasks(out) == tasks  # what `rollbook run` reads


def test_tasks_from_gym_names_the_bad_line_and_writes_nothing(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"task_id": {"taskset": "s", "task_id": "x"}, "task_input": {"env": "math", "generate": 0}})
                   + "\n" + json.dumps({"responses_create_params": {"input": "no rule for me"}}) + "\n")
    out = tmp_path / "tasks.jsonl"
    done = subprocess.run([*ROLLBOOK, "tasks", "from-gym", str(src), "-o", str(out)], capture_output=True, text=True)
    assert done.returncode == 2
    error = json.loads(done.stderr)["error"]
    assert error["code"] == "invalid_request" and error["detail"].startswith(f"{src}:2: ")
    assert not out.exists()


async def test_verify_receives_the_whole_trajectory_through_the_servers(
        dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # rb_coin's verifier scores an answer only inside a conversation about its own task (tests/plugins).
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "plugins"))
    from rb_coin import CoinEnvironment

    monkeypatch.setitem(ENVIRONMENTS, "coin", CoinEnvironment)
    async with stack(dsn, "coin") as s:
        env = s.participant("environment")
        env.environments = env.environments | {"coin"}  # type: ignore[attr-defined]  # as a config enabling it would
        status, body = await post(f"{s.url('environment')}/run", episode("coin:test", "0-0", {"env": "coin", "generate": 1}))
    assert status == 200, body
    assert body["result"]["reward"] == 1.0


async def test_a_new_episode_during_a_checkpoint_is_a_non_terminal_admission_failure(
        dsn: str, store: PostgresEventStore) -> None:
    async with stack(dsn, "admission") as s:
        env = HttpParticipant("environment", "environment", s.url("environment"), TOKEN, s.session)
        await env.call("prepare", {"checkpoint_id": "ck-gym", "deadline": time.time() + 30})
        head = await store.head()
        status, body = await post(f"{s.url('environment')}/run", episode("math:a", "0-0", MATH))
        assert await store.head() == head
        await env.call("resume", {"checkpoint_id": "ck-gym", "deadline": time.time() + 30})
        _, after = await post(f"{s.url('environment')}/run", episode("math:a", "0-0", MATH))
    assert status == 200
    assert body["failure"] == {"failure_reason": "a checkpoint is in progress; new work waits for resume",
                               "terminal": False, "failure_kind": "rollbook:admission_closed", "stage": "admission"}
    assert "result" in after


async def test_a_run_that_reaches_an_instance_still_joining_waits_for_the_join_not_a_failure(
        dsn: str, store: PostgresEventStore) -> None:
    # A fresh process listens before it is in the log (apps/serve.py); Gym's collector does not ask
    # again after a failure row, so the first /run after a restart must not be refused for the join.
    async with stack(dsn, "joining") as s:
        admission = s.participant("environment").admission
        admission.close(JOINING)
        run = asyncio.create_task(post(f"{s.url('environment')}/run", episode("math:a", "0-0", MATH)))
        await asyncio.sleep(0.3)
        assert not run.done()  # waiting, not refused
        admission.open(JOINING)
        status, body = await run
    assert status == 200 and "failure" not in body and "result" in body


def counting(store: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The store's reads of events and attempts, and its appends, by name, in order."""
    asked: list[str] = []

    def counted(name: str) -> Any:
        real = getattr(store, name)

        async def call(*args: Any, **kw: Any) -> Any:
            asked.append(name)
            return await real(*args, **kw)
        return call

    for name in ("read_rollout", "read_stream", "attempt_rows", "append"):
        monkeypatch.setattr(store, name, counted(name))
    return asked


async def test_a_rollout_the_log_has_not_seen_is_read_once_before_its_start_is_appended(
        dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Input: a /run for a rollout with no event in the log. The environment server reads the rollout
    once (under its lock) and appends its start: neither its attempts nor its stream are read again
    before that append (the claim at version 0 still refuses a start another instance made meanwhile);
    the answer is then read from the attempt it ran, whose `attempt_finished` is among what is read (no
    attempt rows). The agent server reads the attempt's history once and claims the activation from it:
    its stream is not read apart (it is in the history)."""
    async with stack(dsn, "unseen") as s:
        environment = counting(s.participant("environment").store, monkeypatch)  # type: ignore[attr-defined]
        agent = counting(s.participant("agent").store, monkeypatch)  # type: ignore[attr-defined]
        status, body = await post(f"{s.url('environment')}/run", episode("blackjack:train", "9-9", BLACKJACK))
    assert status == 200 and isinstance(body["result"]["reward"], float), body
    assert environment[:environment.index("append")] == ["read_rollout"], environment
    assert [name for name in environment if name != "append"] == ["read_rollout", "read_rollout"], environment
    assert agent[:agent.index("append")] == ["read_rollout"], agent


@pytest.mark.parametrize("task, rewarded", [(BLACKJACK, True), (WRONG_SUM, False)], ids=["passed", "failed"])
async def test_a_verify_that_closes_its_session_lands_with_the_close_step_in_one_append(
        dsn: str, store: PostgresEventStore, monkeypatch: pytest.MonkeyPatch, task: dict[str, Any], rewarded: bool) -> None:
    """Input: a /run. Its verify step asks the resources server to close the session with the verify
    (whatever the reward), in the verify's own append, so the environment server's close step asks no
    one: its verify step, its close step and the attempt's `attempt_finished` are one append (one
    transaction, so one `recorded_at`), and the episode's steps are the four, in order, the close step
    carrying the verify's reward. Both ways: a verify that passes, and one that fails (a sum whose
    answer the task gets wrong)."""
    async with stack(dsn, "closing") as s:
        environment = counting(s.participant("environment").store, monkeypatch)  # type: ignore[attr-defined]
        status, body = await post(f"{s.url('environment')}/run", episode("closing:train", "8-8", task))
    assert status == 200, body
    assert (body["result"]["reward"] > 0) is rewarded, body
    rid = scoped_rollout_id("closing:train", "8-8")
    steps = await rows(store, "SELECT data->>'step', (data->>'reward')::float, recorded_at FROM rollbook.events "
                       "WHERE rollout_id = :r AND kind = 'episode_step' ORDER BY position", r=rid)
    assert [r[0] for r in steps] == ["seed", "agent", "verify", "close"]
    assert steps[3][1] == steps[2][1] == body["result"]["reward"]
    finished = await scalar(store, "SELECT recorded_at FROM rollbook.events WHERE rollout_id = :r "
                            "AND kind = 'attempt_finished'", r=rid)
    assert steps[2][2] == steps[3][2] == finished
    assert steps[1][2] != steps[2][2]
    assert environment.count("append") == 4, environment  # start, seed, agent, verify with close

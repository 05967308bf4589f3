"""What `ng_run` gives a NeMo Gym server, rollbook's relay gives it; and what a server answers is
taken for what it is, never for a dead server to rebuild without end.

Every server here is a real process started by the relay with NeMo Gym 0.7.0's Python (the
environment `rollbook nemo-gym install` builds): NeMo Gym's own `calendar` (it imports its sibling
`utils`), `example_session_state_mgmt` (its seed needs the row's `initial_count`), `citation_if`
(its tool answers plain text) and `math_with_judge` (it imports `math_verify`, which that
environment lacks); and the test server `configured_resources` (tests/gym_servers/), which declares
config fields of its own and fails each way a reply can (a 500 from a live process, a process that
dies mid-call). The relay's session here is the resources server's, reduced to what the relay reads.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from apps.nemo_gym_install import install
from apps.nemo_gym_tasks import convert
from apps.processes import free_port
from engine import tool_replay
from engine.catalog import SESSION_REPLAYED
from engine.errors import GymServerFailed, ParticipantUnavailable
from participants.environments import ENVIRONMENTS, Task, ToolError
from participants.environments.nemo_gym_relay import (
    GymServer,
    NemoGymEnvironment,
    ensure_live,
    register,
    relay,
)
from tests.e2e.conftest import Cluster

pytestmark = pytest.mark.timeout(600)

GYM_SERVERS = Path(__file__).resolve().parents[1] / "gym_servers"
CONFIGURED = "configured_resources.app"


@pytest.fixture(scope="module")
def gym_python() -> Path:
    return install()[0]


def site(python: Path) -> Path:
    return next(python.parent.parent.glob("lib/python3.13/site-packages"))


def example_tasks(python: Path, env: str, server: str) -> list[Task]:
    return convert(example_rows(python, server), "example.jsonl", env)


def example_rows(python: Path, server: str) -> list[str]:
    return (site(python) / "resources_servers" / server / "data" / "example.jsonl").read_text().splitlines()


def row_task(env: str, **fields: Any) -> Task:
    row = {"responses_create_params": {"input": [{"role": "user", "content": "go"}]}, **fields}
    return convert([json.dumps(row)], "rows.jsonl", env)[0]


@pytest.fixture
def environment(gym_python: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., NemoGymEnvironment]]:
    """A relayed environment for one server, started by the relay on a free port (stopped after)."""
    monkeypatch.setenv("ROLLBOOK_GYM_LOG", str(tmp_path / "gym.log"))
    made: list[str] = []

    def make(name: str, module: str, state: str = "replay", **kw: Any) -> NemoGymEnvironment:
        paths = (str(GYM_SERVERS),) if module == CONFIGURED else ()
        register([GymServer(name, module, tool_replay.declared(state), None, str(gym_python), paths, free_port(),
                             start_timeout_s=120, call_timeout_s=30, **kw)])
        made.append(name)
        return ENVIRONMENTS[name]()  # type: ignore[return-value]

    yield make
    for name in made:
        ENVIRONMENTS[name].process.stop()  # type: ignore[attr-defined]
        del ENVIRONMENTS[name]


def session(env: NemoGymEnvironment, task: Task, state: list[dict[str, Any]] | None = None) -> SimpleNamespace:
    return SimpleNamespace(rollout_id=f"r-{time.monotonic_ns()}", attempt=0, env=env, task=task, state=state or [],
                           live=None, opened=True, revision=len(state or []), lock=asyncio.Lock())


def recorder() -> tuple[list[tuple[str, dict[str, Any]]], Callable[[Any, str, dict[str, Any]], Awaitable[None]]]:
    appended: list[tuple[str, dict[str, Any]]] = []

    async def append(_s: Any, kind: str, data: dict[str, Any]) -> None:
        appended.append((kind, data))

    return appended, append


# ---- what ng_run gives a server ---------------------------------------------------------------------


async def test_calendar_imports_its_sibling_module_and_verifies_a_row(environment: Callable[..., NemoGymEnvironment],
                                                                gym_python: Path) -> None:
    """NeMo Gym's `calendar` does `from utils import ...`: ng_run's working folder and sys.path."""
    env = environment("gym_calendar", "resources_servers.calendar.app", "stateless")
    task = example_tasks(gym_python, "gym_calendar", "calendar")[0]
    assert env.process.check() is None, env.process.failed
    live = await env.open_live(task)
    from participants.environments import Trajectory

    reward = await env.verify_live(live, task, Trajectory([{"role": "user", "content": task.prompt},
                                                           {"role": "assistant", "content": "[]"}], "[]"), "r1.0.0")
    assert 0.0 <= reward <= 1.0


async def test_the_seed_carries_the_row_as_simple_agent_posts_it(environment: Callable[..., NemoGymEnvironment]) -> None:
    """`example_session_state_mgmt` seeds its counter from the row's `initial_count` (422 on `{}`)."""
    env = environment("gym_counter", "resources_servers.example_session_state_mgmt.app")
    task = row_task("gym_counter", initial_count=5, expected_count=7)
    live = await env.open_live(task)
    assert (await env.call_live(live, "get_counter_value", {})).output == {"count": 5}
    await env.call_live(live, "increment_counter", {"count": 2})
    from participants.environments import Trajectory

    assert await env.verify_live(live, task, Trajectory([{"role": "assistant", "content": "7"}], "7"), "r1.0.0") == 1.0


async def test_a_seed_the_server_refuses_fails_with_its_status_and_body(environment: Callable[..., NemoGymEnvironment]) -> None:
    env = environment("gym_counter_bad", "resources_servers.example_session_state_mgmt.app")
    with pytest.raises(GymServerFailed) as caught:
        await env.open_live(row_task("gym_counter_bad", expected_count=7))  # no initial_count
    assert caught.value.context["stage"] == "seed" and caught.value.context["status"] == 422
    assert "initial_count" in caught.value.context["body"] and "initial_count" in caught.value.detail


async def test_the_servers_own_config_is_merged_with_the_tables_overrides(environment: Callable[..., NemoGymEnvironment]) -> None:
    env = environment("gym_configured", CONFIGURED, overrides=json.dumps({"bonus": 40, "step": 3}))
    live = await env.open_live(row_task("gym_configured", start=1))
    # greeting from its configs/*.yaml, step from the table over the yaml's, bonus from the table.
    assert (await env.call_live(live, "show", {})).output == {"greeting": "from its own yaml", "step": 3, "bonus": 40, "value": 1}


async def test_a_field_its_config_takes_from_the_environment_is_checked_as_nemo_gym_resolves_it(
        environment: Callable[..., NemoGymEnvironment]) -> None:
    """Input: `step = "${oc.env:ROLLBOOK_NO_SUCH_VARIABLE,5}"` (an int field, its value an interpolation
    with a default, as math_formal_lean's `sandbox_port` and litmus_agent's tolerances are)."""
    env = environment("gym_from_env", CONFIGURED, overrides=json.dumps({"step": "${oc.env:ROLLBOOK_NO_SUCH_VARIABLE,5}"}))
    assert env.process.check() is None
    live = await env.open_live(row_task("gym_from_env", start=1))
    assert (await env.call_live(live, "add", {})).output == {"value": 6}


async def test_a_key_the_servers_config_class_does_not_declare_is_refused_with_its_fields(
        environment: Callable[..., NemoGymEnvironment]) -> None:
    env = environment("gym_typo", CONFIGURED, overrides=json.dumps({"bonnus": 1}))
    why = env.process.check()
    assert why is not None and why.startswith("nemo_gym.gym_typo.config: bonnus is no field of "
                                              "ConfiguredResourcesServerConfig"), why
    assert "bonus" in why and "greeting" in why and "step" in why
    with pytest.raises(GymServerFailed, match="bonnus"):  # told again, never started again
        await env.open_live(row_task("gym_typo", start=1))
    assert env.process.starts == 1
    bad = environment("gym_badtype", CONFIGURED, overrides=json.dumps({"step": "many"}))
    assert "step" in (bad.process.check() or "") and bad.process.starts == 1


GENRM = "resources_servers.genrm_compare.app"


def genrm_judged_at(port: int, name: str = "genrm_model") -> str:
    """The servers a genrm_compare is told of: its GenRM model given at a URL, as `models` gives it."""
    return json.dumps({name: {"responses_api_models": {"given": {"entrypoint": "given", "host": "127.0.0.1",
                                                                 "port": port}}}})


async def test_a_verify_whose_judge_failed_is_a_failure_saying_why_not_a_reward_of_zero(
        environment: Callable[..., NemoGymEnvironment], gym_python: Path) -> None:
    """NeMo Gym's genrm_compare, a cohort of two, its GenRM judge at a port where nothing listens: NeMo
    Gym's judge_failsafe answers each verify 200 with `reward: 0.0` and `mask_sample: true`."""
    env = environment("gym_genrm", GENRM, overrides=json.dumps({"num_rollouts_per_prompt": 2, "genrm_parse_retries": 0,
                                                         "judge_request_timeout_s": 1}),
                      servers=genrm_judged_at(free_port()))
    tasks = convert(example_rows(gym_python, "genrm_compare")[:1], "example.jsonl", "gym_genrm", repeats=2)
    from participants.environments import Trajectory

    async def verified(task: Task) -> BaseException | float:
        try:
            return await env.verify_live(await env.open_live(task), task,
                                         Trajectory([{"role": "assistant", "content": "hi"}], "hi"), f"r{task.task_id}.0.0")
        except GymServerFailed as exc:
            return exc
    outcomes = await asyncio.gather(*(verified(t) for t in tasks))  # the cohort is judged once both are in
    for failed in outcomes:
        assert isinstance(failed, GymServerFailed), outcomes
        assert failed.context["stage"] == "verify" and '"failure_kind": "judge_failed"' in failed.detail, failed.detail


def test_a_model_server_given_by_a_name_the_servers_config_never_uses_is_refused_naming_those_it_does(
        environment: Callable[..., NemoGymEnvironment]) -> None:
    """Input: `models = { genrm_modle = ... }` for genrm_compare, whose config names `genrm_model`."""
    env = environment("gym_genrm_typo", GENRM, servers=genrm_judged_at(free_port(), "genrm_modle"))
    why = env.process.check()
    assert why == ("nemo_gym.gym_genrm_typo.models: 'genrm_modle' is no model server resources_servers.genrm_compare.app's "
                   "config names; it names genrm_model"), why
    # A server may name its judge in a plain field (verifif's `judge_server_name`): that name is used.
    named = environment("gym_named", CONFIGURED, overrides=json.dumps({"greeting": "my_judge"}),
                        servers=genrm_judged_at(free_port(), "my_judge"))
    assert named.process.check() is None, named.process.check()


async def test_a_server_that_cannot_import_says_why_in_one_line_and_is_started_once(
        environment: Callable[..., NemoGymEnvironment]) -> None:
    """NeMo Gym's `math_with_judge` imports `math_verify`, which the installed environment lacks."""
    env = environment("gym_judge", "resources_servers.math_with_judge.app")
    assert env.process.check() == "ModuleNotFoundError: No module named 'math_verify'"
    for _ in range(3):
        with pytest.raises(GymServerFailed, match="math_verify") as caught:
            await env.open_live(row_task("gym_judge"))
        assert caught.value.context == {"server": "gym_judge", "stage": "start"}
    assert env.process.starts == 1


def test_a_nemo_gym_server_ends_with_the_rollbook_server_that_started_it_however_that_one_ends(
        gym_python: Path, tmp_path: Path) -> None:
    """Input: the process that started NeMo Gym's `workplace_assistant` (as a resources server does) is
    SIGKILLed alone, not its process group, as a lease-lost exit or the kernel's OOM killer ends it. Left
    running, the NeMo Gym server would keep its port, where the server started in its place listens."""
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from participants.environments.nemo_gym_relay import GymProcess, GymServer
        p = GymProcess(GymServer("gym_orphan", "resources_servers.workplace_assistant.app", "replay", None,
                                 {str(gym_python)!r}, (), {free_port()}, start_timeout_s=120))
        p.base_url()
        print(p.proc.pid, flush=True)
        time.sleep(600)
        """)], stdout=subprocess.PIPE, cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "ROLLBOOK_GYM_LOG": str(tmp_path / "gym.log")})
    try:
        assert holder.stdout is not None
        launcher = int(holder.stdout.readline())
        assert Path(f"/proc/{launcher}").exists()
    finally:
        holder.kill()
        holder.wait()

    def gone() -> bool:
        try:
            return Path(f"/proc/{launcher}/stat").read_text().split(") ")[1][0] == "Z"
        except FileNotFoundError:
            return True
    deadline = time.monotonic() + 10
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(), f"the NeMo Gym server {launcher} outlived the process that started it"


# ---- replies taken for what they are -----------------------------------------------------------------


async def test_citation_ifs_plain_text_reply_is_a_tool_error_not_a_dead_server(
        environment: Callable[..., NemoGymEnvironment], gym_python: Path) -> None:
    env = environment("gym_citation", "resources_servers.citation_if.app", "stateless")
    task = example_tasks(gym_python, "gym_citation", "citation_if")[0]
    s = session(env, task)
    s.live = await env.open_live(task)
    appended, append = recorder()
    for _ in range(3):
        with pytest.raises(ToolError) as caught:
            await relay(s, append, lambda live: env.call_live(live, "web_search", {"query": "x"}, "k1"))
        assert caught.value.code == "gym_not_json" and "No further tool results" in caught.value.message, caught.value.message
    assert appended == [] and env.process.starts == 1  # nothing rebuilt, nothing restarted


async def test_a_500_from_a_live_server_is_a_tool_error_and_rebuilds_nothing(
        environment: Callable[..., NemoGymEnvironment]) -> None:
    env = environment("gym_broken", CONFIGURED)
    task = row_task("gym_broken", start=1)
    s = session(env, task)
    s.live = await env.open_live(task)
    appended, append = recorder()
    with pytest.raises(ToolError) as caught:
        await relay(s, append, lambda live: env.call_live(live, "broken", {}, "k1"))
    assert caught.value.code == "gym_refused" and caught.value.message.startswith("broken: 500"), caught.value.message
    assert appended == [] and env.process.starts == 1
    out = await relay(s, append, lambda live: env.call_live(live, "add", {}, "k2"))  # the same session goes on
    assert out.output == {"value": 3}  # its yaml's step


async def test_a_server_that_dies_on_every_rebuild_ends_the_rollout_after_the_configured_tries(
        environment: Callable[..., NemoGymEnvironment]) -> None:
    """Its process exits on the call each time: rebuilt `rebuild_attempts` times, then the rollout fails
    with a stable code, where it was re-seeded and replayed for as long as the agent asked."""
    env = environment("gym_dying", CONFIGURED, rebuild_attempts=2)
    task = row_task("gym_dying", start=1)
    s = session(env, task)
    s.live = await env.open_live(task)
    appended, append = recorder()
    first = await relay(s, append, lambda live: env.call_live(live, "add", {}, "k1"))
    s.state = env.apply(s.state, first.effect)
    asked = 0
    with pytest.raises(GymServerFailed) as caught:
        while asked < 20:  # as the agent's patience asks again after each ParticipantUnavailable
            asked += 1
            try:
                await relay(s, append, lambda live: env.call_live(live, "die", {}, "k2"))
            except ParticipantUnavailable:
                continue
    assert caught.value.context["stage"] == "rebuild" and caught.value.code == "gym_server_failed"
    replayed = [d for kind, d in appended if kind == SESSION_REPLAYED]
    assert len(replayed) == 2 and all(d["tool_calls"] == ["k1"] for d in replayed), replayed


async def test_a_stateless_servers_rebuild_lists_no_call_it_did_not_send(
        environment: Callable[..., NemoGymEnvironment]) -> None:
    env = environment("gym_stateless", CONFIGURED, "stateless")
    task = row_task("gym_stateless", start=1)
    recorded = [tool_replay.entry("add", {}, {"value": 2}, "k1")]
    s = session(env, task, recorded)
    appended, append = recorder()
    await ensure_live(s, append)
    assert appended == [(SESSION_REPLAYED, {**appended[0][1], "tool_calls": []})]


# ---- through every rollbook server ------------------------------------------------------------------


async def test_a_rollout_of_a_server_that_cannot_import_ends_at_once_with_gym_server_failed(
        cluster_factory: Callable[..., Awaitable[Cluster]], gym_python: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from apps import config as cfg

    monkeypatch.setenv("ROLLBOOK_GYM_LOG", str(tmp_path / "judge.log"))
    c = await cluster_factory(token_latency_s=0.01, nemo_gym={"gym_judge": cfg.NemoGymConfig(
        module="resources_servers.math_with_judge.app", state="stateless", python=str(gym_python), port=free_port())})
    coll = c.collection("noimport", [row_task("gym_judge")], seed=1)
    t0 = time.monotonic()
    await asyncio.wait_for(coll.dispatch(c.session), 120)
    assert coll.refused == {coll.rollout_id(0): "gym_server_failed"}, coll.refused
    assert time.monotonic() - t0 < 60
    fences = await c.rows("SELECT attempt, data FROM rollbook.episode_history WHERE kind = 'attempt_fenced' "
                          "AND rollout_id LIKE 'noimport-%'")
    assert [(f.data["reason"], f.data["code"], f.data["context"]["stage"]) for f in fences] == \
        [("failed", "gym_server_failed", "start")], fences
    assert "No module named 'math_verify'" in fences[0].data["detail"]
    assert "math_verify" in coll.reasons[coll.rollout_id(0)]
    # `rollbook serve resources` said it, in one line, and started the server once (not on every request).
    said = [line for line in c.procs.log("resources").read_text().splitlines() if "cannot start" in line]
    assert said and said[0].startswith("rollbook serve resources: nemo_gym.gym_judge: resources_servers."
                                       "math_with_judge.app cannot start: ModuleNotFoundError: No module named "
                                       "'math_verify'"), said
    assert (tmp_path / "judge.log").read_text().count("rollbook: ModuleNotFoundError") == 1


async def test_a_refused_seed_ends_the_attempt_failed_with_the_servers_status_and_body(
        cluster_factory: Callable[..., Awaitable[Cluster]], gym_python: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """NeMo Gym's `example_session_state_mgmt` refuses a seed without `initial_count` (422): the rollout's
    fence records the status and the body, the attempt is no longer live, and the run's output names it.
    Dispatched again, it runs again as a new attempt (here, to fail the same way)."""
    from apps import config as cfg

    monkeypatch.setenv("ROLLBOOK_GYM_LOG", str(tmp_path / "counter.log"))
    c = await cluster_factory(token_latency_s=0.01, nemo_gym={"gym_counter": cfg.NemoGymConfig(
        module="resources_servers.example_session_state_mgmt.app", state="replay", python=str(gym_python),
        port=free_port())})
    coll = c.collection("seed422", [row_task("gym_counter", expected_count=1)], seed=1)
    await asyncio.wait_for(coll.dispatch(c.session), 180)
    rid = coll.rollout_id(0)
    assert coll.refused == {rid: "gym_server_failed"} and "422" in coll.reasons[rid], (coll.refused, coll.reasons)
    await asyncio.wait_for(coll.dispatch(c.session), 180)
    fences = await c.rows("SELECT attempt, data FROM rollbook.episode_history WHERE kind = 'attempt_fenced' "
                          "AND rollout_id = :r ORDER BY position", r=rid)
    assert [f.attempt for f in fences] == [0, 1], fences
    for f in fences:
        context = f.data["context"]
        assert (f.data["reason"], context["stage"], context["status"]) == ("failed", "seed", 422), f.data
        assert "initial_count" in context["body"] and "Field required" in context["body"]
    statuses = await c.rows("SELECT attempt, status FROM rollbook.attempts WHERE rollout_id = :r ORDER BY attempt", r=rid)
    assert [(r.attempt, r.status) for r in statuses] == [(0, "fenced"), (1, "fenced")]


async def test_the_seeded_row_reaches_the_server_through_every_rollbook_server(
        cluster_factory: Callable[..., Awaitable[Cluster]], gym_python: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A row whose expected count is its initial count scores 1 only if the seed carried the row."""
    from apps import config as cfg

    monkeypatch.setenv("ROLLBOOK_GYM_LOG", str(tmp_path / "counter.log"))
    c = await cluster_factory(token_latency_s=0.01, nemo_gym={"gym_counter": cfg.NemoGymConfig(
        module="resources_servers.example_session_state_mgmt.app", state="replay", python=str(gym_python),
        port=free_port())})
    coll = c.collection("seeded", [row_task("gym_counter", initial_count=4, expected_count=4)], seed=1)
    await asyncio.wait_for(coll.dispatch(c.session), 180)
    assert not coll.refused, (coll.refused, coll.reasons)
    assert await c.scalar("SELECT reward FROM rollbook.attempts WHERE rollout_id = :r AND status = 'finished'",
                          r=coll.rollout_id(0)) == 1.0

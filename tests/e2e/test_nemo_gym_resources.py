"""NeMo Gym 0.7.0's own Workplace Assistant resources server, unchanged, under rollbook, through SIGKILL.

rollbook's resources server starts NeMo Gym's `resources_servers.workplace_assistant.app` (from the
environment `rollbook nemo-gym install` builds, cached outside git) as a process of its own, relays
every tool call of the example tasks (its `data/example.jsonl`, converted by `rollbook tasks
from-gym --env`) and records each with its reply's digest. Killed mid-episode (every rollbook
server, and the Workplace server with them; or the Workplace server alone), the live sessions are
rebuilt by replaying the recorded calls into fresh ones, and each rollout ends with the reward and
the tool-call sequence of an uninterrupted run of the same tasks, with no call applied twice in any
one live session, all read back through SQL. A server whose replies change between runs is caught
(`replay_divergence`), and one that declares nothing is restarted, never continued.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from apps import config as cfg
from apps.collection import Collection
from apps.nemo_gym_install import WORKPLACE, install
from apps.nemo_gym_tasks import convert
from apps.processes import free_port
from participants.environments import Task
from tests.e2e.conftest import Cluster, assert_invariants, effective, history

pytestmark = pytest.mark.timeout(900)

GYM_SERVERS = Path(__file__).resolve().parents[1] / "gym_servers"  # the negative control's folder
# A tool call applied twice in one live NeMo Gym session: a relayed call and the replays that sent it
# again, grouped by the live session (expect no rows).
TWICE_IN_ONE_LIVE_SESSION = """
WITH applied AS (
  SELECT rollout_id, data->>'live' AS live, data->>'tool_call' AS tool_call FROM rollbook.episode_history
  WHERE kind = 'mutation_applied' AND rollout_id LIKE :p
  UNION ALL
  SELECT rollout_id, data->>'live', jsonb_array_elements_text(data->'tool_calls') FROM rollbook.episode_history
  WHERE kind = 'session_replayed' AND rollout_id LIKE :p)
SELECT rollout_id, live, tool_call, count(*) FROM applied GROUP BY 1, 2, 3 HAVING count(*) > 1"""


def example_tasks(python: Path, env: str, server: str = "workplace_assistant") -> list[Task]:
    """A NeMo Gym server's own example rows, as `rollbook tasks from-gym --env` converts them."""
    site = next(python.parent.parent.glob("lib/python3.13/site-packages"))
    rows = (site / "resources_servers" / server / "data" / "example.jsonl").read_text().splitlines()
    return convert(rows, "example.jsonl", env)


def gym(python: Path, state: str | None, port: int, module: str = WORKPLACE, paths: tuple[str, ...] = ()) -> cfg.NemoGymConfig:
    return cfg.NemoGymConfig(module=module, state=state, python=str(python), port=port, paths=list(paths))


async def outcomes(c: Cluster, coll: Collection) -> dict[int, tuple[float, list[tuple[str, Any]]]]:
    """Each task's reward and the tool calls (name, arguments) of the attempt lineage that finished it."""
    events = await history(c, coll.run_id)
    out: dict[int, tuple[float, list[tuple[str, Any]]]] = {}
    for i in range(len(coll.tasks)):
        rid = coll.rollout_id(i)
        row = (await c.rows("SELECT attempt, reward FROM rollbook.attempts WHERE rollout_id = :r AND status = 'finished'",
                            r=rid))[0]
        calls = [(e.data["tool"], e.data["arguments"]) for e in effective(events.get(rid, []), row.attempt)
                 if e.kind == "mutation_applied"]
        out[i] = (float(row.reward), calls)
    return out


async def killed_and_rerun(c: Cluster, run: str, tasks: list[Task], seed: int, kind: str, at_least: int) -> Collection:
    """`run` dispatched, every server SIGKILLed once `at_least` `kind` events of it are in the log, then
    dispatched again on fresh processes to its end, the log's invariants checked."""
    coll = c.collection(run, tasks, seed=seed)
    first = asyncio.create_task(coll.dispatch(c.session))
    await c.wait_count(run, kind, at_least, timeout=120)
    await c.crash(first)
    await c.start()
    await asyncio.wait_for(coll.dispatch(c.session), 300)
    await assert_invariants(c, coll)
    return coll


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def launcher_pids(port: int) -> list[int]:
    """The NeMo Gym servers rollbook started on `port` (their command line names the launcher and the port)."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                argv = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(a.endswith(b"nemo_gym_launcher.py") for a in argv) and str(port).encode() in argv:
                found.append(int(d.name))
    return found


@pytest.fixture(scope="module")
def gym_python() -> Path:
    python, seconds = install()
    if seconds:
        print(f"built the NeMo Gym environment in {seconds:.0f} s")
    return python


async def workplace_cluster(cluster_factory: Callable[..., Awaitable[Cluster]], python: Path, state: str | None,
                            port: int, tmp_path: Path) -> Cluster:
    os.environ["ROLLBOOK_GYM_LOG"] = str(tmp_path / f"gym-{port}.log")  # the servers hand it to the Gym process
    return await cluster_factory(token_latency_s=0.01, nemo_gym={"gym_workplace": gym(python, state, port)})


async def test_workplace_assistant_survives_a_sigkill_of_every_server_with_the_same_rewards_and_calls(
        cluster_factory: Callable[..., Awaitable[Cluster]], gym_python: Path, tmp_path: Path) -> None:
    port = free_port()
    c = await workplace_cluster(cluster_factory, gym_python, "replay", port, tmp_path)
    tasks = example_tasks(gym_python, "gym_workplace")
    base = c.collection("base", tasks, seed=5)
    await asyncio.wait_for(base.dispatch(c.session), 300)
    uninterrupted = await outcomes(c, base)
    assert any(reward == 1.0 for reward, _ in uninterrupted.values()), uninterrupted  # Gym's own verify scored
    assert sum(len(calls) for _, calls in uninterrupted.values()) >= 5

    coll = c.collection("gym", tasks, seed=5)
    first = asyncio.create_task(coll.dispatch(c.session))
    await c.wait_count("gym", "mutation_applied", 2, timeout=120)
    await c.crash(first)  # SIGKILL of the four servers' process groups: the Workplace server is in the resources one
    await c.wait_for("the Workplace server to die with the resources server's process group",
                     lambda: asyncio.sleep(0, not launcher_pids(port) and not listening(port)), timeout=10)
    await c.start()
    await asyncio.wait_for(coll.dispatch(c.session), 300)
    figures = await assert_invariants(c, coll)
    assert await outcomes(c, coll) == uninterrupted
    assert not await c.rows(TWICE_IN_ONE_LIVE_SESSION, p="gym-%")
    replays = await c.rows("SELECT data FROM rollbook.episode_history WHERE kind = 'session_replayed' "
                           "AND rollout_id LIKE 'gym-%'")
    assert any(r.data["tool_calls"] for r in replays), "no session was rebuilt by replaying its calls"
    print("NEMO_GYM_WORKPLACE " + json.dumps({**figures, "replays": len(replays)}))


async def test_a_sigkill_of_the_workplace_server_alone_is_replayed_into_its_fresh_process(
        cluster_factory: Callable[..., Awaitable[Cluster]], gym_python: Path, tmp_path: Path) -> None:
    port = free_port()
    c = await workplace_cluster(cluster_factory, gym_python, "replay", port, tmp_path)
    tasks = example_tasks(gym_python, "gym_workplace")
    base = c.collection("kept", tasks, seed=9)
    await asyncio.wait_for(base.dispatch(c.session), 300)
    uninterrupted = await outcomes(c, base)

    coll = c.collection("solo", tasks, seed=9)
    run = asyncio.create_task(coll.dispatch(c.session))
    await c.wait_count("solo", "mutation_applied", 1, timeout=120)
    (pid,) = launcher_pids(port)
    os.kill(pid, signal.SIGKILL)
    await asyncio.wait_for(run, 300)
    assert not await coll.unfinished()
    await assert_invariants(c, coll)
    assert await outcomes(c, coll) == uninterrupted
    assert not await c.rows(TWICE_IN_ONE_LIVE_SESSION, p="solo-%")
    assert launcher_pids(port) and launcher_pids(port) != [pid]  # a fresh Workplace process serves them
    # No rollbook server died: every rollout went on under its own attempt.
    assert await c.scalar("SELECT count(*) FROM rollbook.episode_history WHERE kind = 'rollout_recovered' "
                          "AND rollout_id LIKE 'solo-%'") == 0
    # Each row reached the model as NeMo Gym's simple_agent sends it: its system and user messages apart,
    # the row's temperature (1.0) with every call, recorded with it.
    rows = [t.params["row"] for t in tasks]
    opened = await c.rows("SELECT DISTINCT ON (rollout_id) data->'messages' AS messages FROM rollbook.episode_history "
                          "WHERE kind = 'agent_boundary' AND rollout_id LIKE 'kept-%' ORDER BY rollout_id, position")
    assert sorted(json.dumps(r.messages) for r in opened) == sorted(
        json.dumps(row["responses_create_params"]["input"]) for row in rows)
    temperatures = await c.rows("SELECT DISTINCT data->'sampling'->'temperature' AS temperature FROM rollbook.episode_history "
                                "WHERE kind = 'call_accepted' AND rollout_id LIKE 'kept-%'")
    assert [r.temperature for r in temperatures] == [1.0]


async def test_a_server_that_declares_nothing_is_restarted_never_continued(
        cluster_factory: Callable[..., Awaitable[Cluster]], gym_python: Path, tmp_path: Path) -> None:
    port = free_port()
    c = await workplace_cluster(cluster_factory, gym_python, None, port, tmp_path)
    tasks = example_tasks(gym_python, "gym_workplace")[:1]  # the email task: two calls, then the answer
    coll = c.collection("undeclared", tasks, seed=5)
    first = asyncio.create_task(coll.dispatch(c.session))
    await c.wait_count("undeclared", "mutation_applied", 1, timeout=120)
    await c.crash(first)
    await c.start()
    await asyncio.wait_for(coll.dispatch(c.session), 300)
    assert not await coll.unfinished()
    recovered = await c.rows("SELECT attempt, data FROM rollbook.episode_history WHERE kind = 'rollout_recovered' "
                             "AND rollout_id LIKE 'undeclared-%'")
    assert [r.data["disposition"] for r in recovered] == ["fresh_dispatch"], recovered
    assert not await c.rows("SELECT 1 FROM rollbook.episode_history WHERE kind = 'session_replayed' "
                            "AND rollout_id LIKE 'undeclared-%'")
    finished = await c.scalar("SELECT attempt FROM rollbook.attempts WHERE rollout_id LIKE 'undeclared-%' "
                              "AND status = 'finished'")
    assert finished == recovered[0].attempt + 1
    started = await c.scalar("SELECT data FROM rollbook.episode_history WHERE kind = 'attempt_started' "
                             "AND rollout_id LIKE 'undeclared-%' AND attempt = :a", a=finished)
    assert started["origin_attempt"] is None  # from its input, not from a boundary


async def test_a_server_whose_replies_change_between_runs_is_caught_as_replay_divergence(
        cluster_factory: Callable[..., Awaitable[Cluster]], gym_python: Path, tmp_path: Path) -> None:
    port = free_port()
    os.environ["ROLLBOOK_GYM_LOG"] = str(tmp_path / "flaky.log")
    c = await cluster_factory(token_latency_s=0.03, nemo_gym={  # slow turns: the kill lands mid-episode
        "gym_flaky": gym(gym_python, "replay", port, module="flaky_resources.app", paths=(str(GYM_SERVERS),))})
    tasks = example_tasks(gym_python, "gym_flaky")[:1]
    coll = c.collection("flaky", tasks, seed=5)
    first = asyncio.create_task(coll.dispatch(c.session))
    await c.wait_count("flaky", "mutation_applied", 1, timeout=120)
    await c.crash(first)
    await c.start()
    await asyncio.wait_for(coll.dispatch(c.session), 300)
    assert not await coll.unfinished()
    recovered = await c.rows("SELECT attempt, data->>'disposition' AS d, data->>'reason' AS reason "
                             "FROM rollbook.episode_history WHERE kind = 'rollout_recovered' AND rollout_id LIKE 'flaky-%' "
                             "ORDER BY position")
    # A model call the kill cut may first move the rollout to a new attempt that continues from its
    # boundary; that attempt's replay is what diverges.
    assert recovered and (recovered[-1].d, recovered[-1].reason) == ("fresh_dispatch", "replay_divergence"), recovered
    assert all(r.d == "continue" for r in recovered[:-1]), recovered
    recovered = recovered[-1:]
    # Nothing of the diverged replay was taken for the session: the attempt that finished started from its input.
    finished = await c.scalar("SELECT attempt FROM rollbook.attempts WHERE rollout_id LIKE 'flaky-%' AND status = 'finished'")
    assert finished == recovered[0].attempt + 1


async def test_a_stateless_verifier_goes_on_after_a_sigkill_with_a_fresh_session_and_the_same_rewards(
        cluster_factory: Callable[..., Awaitable[Cluster]], gym_python: Path, tmp_path: Path) -> None:
    """NeMo Gym's RULER verifier keeps nothing per session: declared `stateless`, a rollout whose live
    session died with the servers goes on under its own attempt, its verify asked of a fresh session."""
    port = free_port()
    os.environ["ROLLBOOK_GYM_LOG"] = str(tmp_path / "ruler.log")
    c = await cluster_factory(token_latency_s=0.01, nemo_gym={
        "gym_ruler": gym(gym_python, "stateless", port, module="resources_servers.ruler.app")})
    tasks = example_tasks(gym_python, "gym_ruler", "ruler")[:3]
    base = c.collection("ruler-base", tasks, seed=2)
    await asyncio.wait_for(base.dispatch(c.session), 300)
    uninterrupted = await outcomes(c, base)

    coll = await killed_and_rerun(c, "stateless", tasks, 2, "session_opened", 2)
    assert await outcomes(c, coll) == uninterrupted
    # Nothing restarted from its input: every rollout went on (a call cut off by the SIGKILL may still be
    # continued from its boundary under the next attempt: a `continue` recovery, which this allows).
    assert not await c.rows("SELECT 1 FROM rollbook.episode_history WHERE kind = 'rollout_recovered' "
                            "AND rollout_id LIKE 'stateless-%' AND data->>'disposition' = 'fresh_dispatch'")
    fresh = await c.rows("SELECT data FROM rollbook.episode_history WHERE kind = 'session_replayed' "
                         "AND rollout_id LIKE 'stateless-%'")
    assert fresh and all(r.data["tool_calls"] == [] for r in fresh), fresh


@pytest.mark.parametrize(("server", "judged"), [("abstention", 1), ("agentif", 0)])
async def test_an_llm_judges_calls_are_rollbooks_model_calls_of_the_rollout_they_judge(
        cluster_factory: Callable[..., Awaitable[Cluster]], gym_python: Path, tmp_path: Path, server: str,
        judged: int) -> None:
    """NeMo Gym's `abstention` and `agentif` verify with an LLM judge their config names
    (`judge_model_server`, defined nowhere here): from a table holding only its module and state each
    starts, its judge resolved to rollbook's model server, and each verify's judge call is a recorded
    model call of the rollout it judges (an unnamed call, numbered in the activation it verifies).
    `agentif` logs while it verifies (and asks its judge nothing for these rows): a log file NeMo Gym's
    config left in a folder the launcher had removed once failed every such verify with FileNotFoundError."""
    os.environ["ROLLBOOK_GYM_LOG"] = str(tmp_path / f"{server}.log")
    c = await cluster_factory(token_latency_s=0.01, nemo_gym={
        "gym_judged": gym(gym_python, "stateless", free_port(), module=f"resources_servers.{server}.app")})
    tasks = example_tasks(gym_python, "gym_judged", server)[:3]
    coll = c.collection("judged", tasks, seed=2)
    await asyncio.wait_for(coll.dispatch(c.session), 300)
    rows = await c.rows("SELECT rollout_id, count(*) FILTER (WHERE kind = 'call_completed' AND data->>'call_id' LIKE "
                        "'%.m%') AS judged, count(*) FILTER (WHERE kind = 'session_verified' AND data->>'status' <> "
                        "'error') AS verified FROM rollbook.episode_history WHERE rollout_id LIKE 'judged-%' "
                        "GROUP BY 1 ORDER BY 1")
    assert len(rows) == len(tasks) and all(r.verified == 1 and r.judged == judged for r in rows), rows
    assert not await c.rows("SELECT 1 FROM rollbook.events WHERE kind = 'call_completed' AND rollout_id IS NULL")


@pytest.mark.parametrize(("server", "state"), [("example_multi_step", "replay"), ("math_advanced_calculations", "replay")])
async def test_any_servers_tools_are_called_and_replayed_through_a_sigkill(
        cluster_factory: Callable[..., Awaitable[Cluster]], gym_python: Path, tmp_path: Path, server: str, state: str) -> None:
    """A server rollbook's scripted model knows nothing of: it calls the tools each example row offers
    with arguments built from their schemas (participants/environments/players.py `SCHEMA`), so the
    SIGKILL meets recorded calls, which are replayed into the fresh live sessions. Without that player
    no tool of theirs was ever called."""
    port = free_port()
    os.environ["ROLLBOOK_GYM_LOG"] = str(tmp_path / f"{server}.log")
    c = await cluster_factory(token_latency_s=0.01, nemo_gym={
        "gym_any": gym(gym_python, state, port, module=f"resources_servers.{server}.app")})
    tasks = example_tasks(gym_python, "gym_any", server)
    base = c.collection("uninterrupted", tasks, seed=3)
    await asyncio.wait_for(base.dispatch(c.session), 300)
    uninterrupted = await outcomes(c, base)
    assert all(len(calls) >= 1 for _, calls in uninterrupted.values()), uninterrupted

    coll = await killed_and_rerun(c, "schema", tasks, 3, "mutation_applied", 3)
    assert await outcomes(c, coll) == uninterrupted
    assert not await c.rows(TWICE_IN_ONE_LIVE_SESSION, p="schema-%")
    replays = await c.rows("SELECT data FROM rollbook.episode_history WHERE kind = 'session_replayed' "
                           "AND rollout_id LIKE 'schema-%'")
    assert any(r.data["tool_calls"] for r in replays), "no session was rebuilt by replaying its calls"


async def test_a_checkpoint_mid_episode_restored_after_a_sigkill_replays_each_session_to_its_boundary(
        cluster_factory: Callable[..., Awaitable[Cluster]], gym_python: Path, tmp_path: Path) -> None:
    """A checkpoint cut while Workplace sessions are under way, the run going on past it, then every
    server SIGKILLed and the checkpoint restored in fresh processes: each continued session is the
    replay of its calls up to the cut (its new attempt's own live session), and the run ends as the
    uninterrupted one did."""
    port = free_port()
    c = await workplace_cluster(cluster_factory, gym_python, "replay", port, tmp_path)
    tasks = example_tasks(gym_python, "gym_workplace")
    base = c.collection("whole", tasks, seed=7)
    await asyncio.wait_for(base.dispatch(c.session), 300)
    uninterrupted = await outcomes(c, base)

    coll = c.collection("cut", tasks, seed=7)
    run = asyncio.create_task(coll.dispatch(c.session))
    await c.wait_count("cut", "mutation_applied", 1, timeout=120)
    ck = await coll.checkpoint(c.session, "cut-ck1")
    assert ck["published"] and ck["continued"] >= 1, ck
    await c.crash(run)
    await c.start()
    restored = await coll.restore(c.session, "cut-ck1")
    assert restored["continued"] == ck["continued"], restored
    await asyncio.wait_for(coll.dispatch(c.session), 300)
    await assert_invariants(c, coll)
    assert await outcomes(c, coll) == uninterrupted
    assert not await c.rows(TWICE_IN_ONE_LIVE_SESSION, p="cut-%")
    replayed = await c.rows("SELECT attempt, data FROM rollbook.episode_history WHERE kind = 'session_replayed' "
                            "AND rollout_id LIKE 'cut-%'")
    assert any(r.attempt > 0 and r.data["tool_calls"] for r in replayed), replayed  # a restored attempt's replay

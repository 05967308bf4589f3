"""NeMo Gym 0.7.0's own rollout collector drives rollbook, and survives a SIGKILL of rollbook's servers.

The collector is the real `ng_collect_rollouts` from PyPI's `nemo-gym==0.7.0`, in a Python 3.13
virtual environment of its own (built once, cached under ~/.cache/rollbook-tests; see
`gym_venv`). Beside rollbook's four servers (real processes, on the test's database) run NeMo
Gym's head server (its HeadServer class on the config below) and NeMo Gym's `legacy_agent`
environment server (its own app.py, launched the way `ng_run` launches it). One collection holds
materialized rows (routed by taskset to rollbook's environment server) and flat rows (through
legacy_agent to rollbook's agent server). Mid-collection every rollbook server's process group is
SIGKILLed; the collector retries its in-flight requests on its own; fresh rollbook processes answer
them by continuing each rollout from the log. Then, through SQL: every rollout finished exactly once,
no model call generated twice for a turn, no mutation applied twice at a revision.

rollbook's Gym fronts need the data credential; the collector and legacy_agent send it the only way
NeMo Gym's client can, in the configured server address (`ROLLBOOK_HOST`), so the collection
finishing at all shows they authenticated.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from apps.processes import free_port
from testkit.nemo_gym_collector import gym_venv, spawn, stop, wait_http
from tests.e2e.conftest import Cluster

pytestmark = pytest.mark.timeout(1500)

# NeMo Gym's client sends no header of its own: the data credential rides in the server address
# (http://rollbook:<token>@host:port, which aiohttp sends as HTTP Basic), read from the environment.
ROLLBOOK_HOST = '"rollbook:${oc.env:ROLLBOOK_DATA_TOKEN}@127.0.0.1"'


def gym_config(cluster: Cluster, head_port: int, legacy_port: int, host: str = ROLLBOOK_HOST) -> str:
    """What a NeMo Gym user adds to an existing config to point it at rollbook (docs/nemo-gym.md)."""
    return f"""
head_server:
  host: 127.0.0.1
  port: {head_port}
rollbook_environment:            # rollbook's environment server: materialized rows, by taskset
  environment_servers:
    rollbook:
      host: {host}
      port: {cluster.config.servers['environment'].port}
rollbook_agent:                  # rollbook's agent server: flat rows, through legacy_agent
  responses_api_agents:
    rollbook:
      entrypoint: rollbook         # NeMo Gym validates a referenced agent; `rollbook serve agent` runs it
      host: {host}
      port: {cluster.config.servers['agent'].port}
rollbook_legacy_environment:
  environment_servers:
    legacy_agent:
      entrypoint: app.py
      host: 127.0.0.1
      port: {legacy_port}
      agent_server:
        type: responses_api_agents
        name: rollbook_agent
environment_server_routes:
  "blackjack:train": rollbook_environment
  "workplace:train": rollbook_environment
"""


def rows() -> list[dict[str, Any]]:
    materialized = [{"task_id": {"taskset": f"{env}:train", "task_id": f"{env}-{i}"},
                     "task_input": {"env": env, "generate": i, "seed": 7}}
                    for env in ("blackjack", "workplace") for i in range(4)]
    flat = [{"responses_create_params": {"input": [{"role": "user", "content": f"Reverse the string '{w}'. "
                                                                               "Reply with the result only."}]},
             "expected_answer": w[::-1], "agent_ref": {"name": "rollbook_agent"}} for w in ("kitten", "rollbook")]
    flat += [{"responses_create_params": {"input": "play a hand"}, "rollbook": {"env": "blackjack", "generate": 10 + i},
              "agent_ref": {"name": "rollbook_agent"}} for i in range(2)]
    return materialized + flat


# What was done twice, over every rollout of the collection (all of this test's database):
FINISHED_NOT_ONCE = """
SELECT count(*) FROM (SELECT rollout_id FROM rollbook.attempts GROUP BY rollout_id
                      HAVING count(*) FILTER (WHERE status = 'finished') <> 1) t"""
# a turn of a rollout whose model reply was generated (not delivered from the log) more than once
REPEATED_CALLS = """
SELECT count(*) FROM (SELECT rollout_id, split_part(data->>'call_id', '.t', 2) AS turn FROM rollbook.episode_history
                      WHERE kind = 'call_completed' AND coalesce(data->>'disposition', 'generated') = 'generated'
                      GROUP BY 1, 2 HAVING count(*) > 1) t"""
# a session revision of a rollout applied more than once (no restart-only environment runs here)
REPEATED_MUTATIONS = """
SELECT count(*) FROM (SELECT rollout_id, data->>'revision' FROM rollbook.episode_history
                      WHERE kind = 'mutation_applied' GROUP BY 1, 2 HAVING count(*) > 1) t"""


def gym_env(cluster: Cluster, tmp_path: Path) -> dict[str, str]:
    env = {**os.environ, "NEMO_GYM_RESOLVED_CONFIG": str(tmp_path / "resolved.yaml"), "PYTHONUNBUFFERED": "1",
           "RAY_USAGE_STATS_ENABLED": "0", "ROLLBOOK_DATA_TOKEN": cluster.config.data_token}
    env.pop("PYTHONPATH", None)
    for key in [k for k in env if k.startswith("VIRTUAL_ENV")]:
        env.pop(key)
    return env


@pytest.mark.parametrize("host", ["127.0.0.1", '"rollbook:${oc.env:ROLLBOOK_CONTROL_TOKEN}@127.0.0.1"'],
                         ids=["no-credential", "control-credential"])
async def test_ng_collect_rollouts_without_the_data_credential_is_refused_and_writes_nothing(
        cluster_factory: Callable[..., Awaitable[Cluster]], tmp_path: Path, host: str) -> None:
    venv = gym_venv()
    cluster = await cluster_factory()
    head_port = free_port()
    (tmp_path / "gym.yaml").write_text(gym_config(cluster, head_port, free_port(), host=host))
    materialized = [r for r in rows() if "task_id" in r][:2]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in materialized))
    env = {**gym_env(cluster, tmp_path), "ROLLBOOK_CONTROL_TOKEN": cluster.config.control_token}
    overrides = [f"+config_paths=[{tmp_path / 'gym.yaml'}]"]
    head = spawn([str(venv / "bin" / "python"), str(Path(__file__).with_name("nemo_gym_head.py")), *overrides],
                 tmp_path / "head.log", tmp_path, env)
    try:
        await asyncio.to_thread(wait_http, f"http://127.0.0.1:{head_port}/global_config_dict_yaml", head,
                                tmp_path / "head.log", 300)
        before = await cluster.head()
        out = tmp_path / "out" / "rollouts.jsonl"
        collector = subprocess.run([str(venv / "bin" / "ng_collect_rollouts"), *overrides,
                                    f"+input_jsonl_fpath={tmp_path / 'rows.jsonl'}", f"+output_jsonl_fpath={out}"],
                                   cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        log = collector.stdout + collector.stderr
        expected = "403" if "CONTROL" in host else "401"
        assert collector.returncode != 0 and f"status={expected}" in log, log[-3000:]
        assert await cluster.head() == before  # refused before anything was written
        assert await cluster.scalar("SELECT count(*) FROM rollbook.attempts") == 0
    finally:
        stop(head)


async def start_collection(cluster: Cluster, tmp_path: Path, procs: list[subprocess.Popen[bytes]],
                           out: Path) -> subprocess.Popen[bytes]:
    """NeMo Gym's head server and legacy_agent, then `ng_collect_rollouts` over rows(), six at a time, into
    `out`; each process is added to `procs` as it starts (the caller stops them)."""
    venv = gym_venv()
    head_port, legacy_port = free_port(), free_port()
    (tmp_path / "gym.yaml").write_text(gym_config(cluster, head_port, legacy_port))
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows()))
    env = gym_env(cluster, tmp_path)
    overrides = [f"+config_paths=[{tmp_path / 'gym.yaml'}]"]
    head = spawn([str(venv / "bin" / "python"), str(Path(__file__).with_name("nemo_gym_head.py")), *overrides],
                 tmp_path / "head.log", tmp_path, env)
    procs.append(head)
    await asyncio.to_thread(wait_http, f"http://127.0.0.1:{head_port}/global_config_dict_yaml", head,
                            tmp_path / "head.log", 300)
    legacy_dir = next((venv / "lib").glob("python3.13/site-packages/environment_servers/legacy_agent"))
    legacy = spawn([str(venv / "bin" / "python"), "app.py"], tmp_path / "legacy_agent.log", legacy_dir,
                   {**env, "NEMO_GYM_CONFIG_DICT": (tmp_path / "resolved.yaml").read_text(),
                    "NEMO_GYM_CONFIG_PATH": "rollbook_legacy_environment"})
    procs.append(legacy)
    await asyncio.to_thread(wait_http, f"http://127.0.0.1:{legacy_port}/docs", legacy, tmp_path / "legacy_agent.log", 300)
    collector = spawn([str(venv / "bin" / "ng_collect_rollouts"), *overrides,
                       f"+input_jsonl_fpath={tmp_path / 'rows.jsonl'}", f"+output_jsonl_fpath={out}",
                       "+num_samples_in_parallel=6"], tmp_path / "collector.log", tmp_path, env)
    procs.append(collector)
    return collector


async def test_ng_collect_rollouts_is_served_by_every_worker_of_a_server_with_workers(
        cluster_factory: Callable[..., Awaitable[Cluster]], tmp_path: Path) -> None:
    """`workers = 2` for the environment and agent servers: the collector's `/run` requests (materialized
    rows to the environment, flat rows through legacy_agent to the agent) spread over both workers of
    each, as rollbook's own episodes do; the episodes a worker starts are its writes in the log."""
    cluster = await cluster_factory(workers={"environment": 2, "agent": 2})
    procs: list[subprocess.Popen[bytes]] = []
    try:
        out = tmp_path / "out" / "rollouts.jsonl"
        collector = await start_collection(cluster, tmp_path, procs, out)
        rc = await asyncio.to_thread(collector.wait, 900)
        assert rc == 0, (tmp_path / "collector.log").read_text()[-4000:]
        written = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(written) == len(rows()) and all(isinstance(r["reward"], float) for r in written)
        starts = await cluster.rows("SELECT writer, count(*) AS n FROM rollbook.events WHERE kind = 'episode_started' "
                                    "GROUP BY writer")
        workers = await cluster.rows("SELECT instance FROM rollbook.participants WHERE kind = 'environment' "
                                     "AND parent IS NOT NULL")
        assert len(workers) == 2 and {r.writer for r in starts} == {w.instance for w in workers}, (starts, workers)
        assert await cluster.scalar(FINISHED_NOT_ONCE) == 0
    finally:
        for proc in reversed(procs):
            stop(proc)


async def test_ng_collect_rollouts_survives_a_sigkill_of_rollbooks_servers(
        cluster_factory: Callable[..., Awaitable[Cluster]], tmp_path: Path) -> None:
    cluster = await cluster_factory(token_latency_s=0.02)  # ~0.5 s a model reply: the kill lands mid-rollout
    procs: list[subprocess.Popen[bytes]] = []
    try:
        out = tmp_path / "out" / "rollouts.jsonl"
        t0 = time.monotonic()
        collector = await start_collection(cluster, tmp_path, procs, out)
        total = len(rows())

        async def mid_collection() -> bool:
            finished = await cluster.scalar("SELECT count(*) FROM rollbook.attempts WHERE status = 'finished'")
            generated = await cluster.scalar("SELECT count(*) FROM rollbook.model_calls WHERE status = 'completed'")
            assert collector.poll() is None, (tmp_path / "collector.log").read_text()[-3000:]
            return bool(generated >= 6 and 1 <= finished <= total - 4)

        await cluster.wait_for("the collection to be under way", mid_collection, timeout=600)
        before = {"finished": await cluster.scalar("SELECT count(*) FROM rollbook.attempts WHERE status = 'finished'"),
                  "model_calls": await cluster.scalar("SELECT count(*) FROM rollbook.model_calls WHERE status = 'completed'"),
                  "mutations": await cluster.scalar("SELECT count(*) FROM rollbook.episode_history WHERE kind = 'mutation_applied'")}
        kill_position = await cluster.head()
        await cluster.crash()  # SIGKILL every rollbook server's process group
        await asyncio.sleep(2.0)  # the collector and legacy_agent keep retrying against closed ports
        await cluster.start()  # fresh processes on the same database
        rc = await asyncio.to_thread(collector.wait, 900)
        elapsed = time.monotonic() - t0
        log = (tmp_path / "collector.log").read_text()
        assert rc == 0, log[-4000:]

        written = [json.loads(line) for line in out.read_text().splitlines()]
        failures = out.with_name("rollouts_failures.jsonl")
        failed = failures.read_text().splitlines() if failures.exists() else []
        by_server: dict[str, int] = {}
        for r in written:
            by_server[r["_ng_environment_server"]] = by_server.get(r["_ng_environment_server"], 0) + 1
        figures = {
            "rows": total, "written": len(written), "failures": len(failed), "by_server": by_server,
            "before_kill": before, "collector_s": round(elapsed, 1),
            "rollouts": await cluster.scalar("SELECT count(DISTINCT rollout_id) FROM rollbook.attempts"),
            "finished_not_once": await cluster.scalar(FINISHED_NOT_ONCE),
            "repeated_model_calls": await cluster.scalar(REPEATED_CALLS),
            "repeated_mutations": await cluster.scalar(REPEATED_MUTATIONS),
            "attempts": await cluster.scalar("SELECT count(*) FROM rollbook.attempts"),
            # rollouts under way at the kill that the fresh processes took to their end
            "continued_after_kill": await cluster.scalar(
                "SELECT count(DISTINCT s.rollout_id) FROM rollbook.episode_history s JOIN rollbook.attempts a "
                "ON a.rollout_id = s.rollout_id AND a.status = 'finished' AND a.ended_position > :k "
                "WHERE s.kind = 'episode_started' AND s.position <= :k", k=kill_position),
        }
        print("NEMO_GYM_FIGURES " + json.dumps(figures))
        assert (len(written), failed) == (total, []), figures
        assert by_server == {"rollbook_environment": 8, "rollbook_legacy_environment": 4}
        assert all(isinstance(r["reward"], float) and r["response"]["output"] for r in written)
        assert figures["rollouts"] == total and figures["finished_not_once"] == 0, figures
        assert (figures["repeated_model_calls"], figures["repeated_mutations"]) == (0, 0), figures
        assert figures["continued_after_kill"] >= 1, figures  # some rollouts were picked up by the new processes
        assert (tmp_path / "out" / "rollouts_aggregate_metrics.json").exists()
    finally:
        for p in procs:
            stop(p)

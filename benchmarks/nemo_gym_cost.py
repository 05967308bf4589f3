"""What rollbook costs a NeMo Gym run: CPU per model call against NeMo Gym's own servers, same rows, side by side.

    .venv/bin/python -m benchmarks.nemo_gym_cost [--rollouts 150] [--rounds 2] [--parallel 8]

NeMo Gym alone: NeMo Gym 0.7.0's `ng_collect_rollouts` -> `legacy_agent` -> `simple_agent` +
`vllm_model` + the Workplace Assistant resources server, each NeMo Gym's own `app.py` in a process of
its own, as `ng_run` starts them. Through rollbook: the same collector and `legacy_agent` -> rollbook's
four servers on a throwaway embedded PostgreSQL, the same Workplace server behind the resources
server's relay. Both sides: the same rows (Workplace's example rows, repeated; rollbook's copy carries
a `rollbook` selector naming the relayed environment) and the same upstream, a fake vLLM
(testkit/fake_vllm.py) whose scripted policy plays the Workplace tasks.

Measured per side and round, from the collector's start to its end: CPU seconds of each server's
process tree (/proc; the Workplace server rollbook starts is in its resources server's tree),
PostgreSQL's postmaster with every backend, the model calls the upstream served and the tool calls
the rows' outputs hold. rollbook's statements (pg_stat_statements), transactions and events per call
beside them. The collector, `legacy_agent` and the upstream run on both sides and are reported apart,
out of the totals. Rounds interleave the sides (A B A B); figures are medians of the rounds. Wall time
on a shared 2-core machine is noisy: reported, never asserted. 150 rollouts (390 model calls) is the
size the comparison was first measured at; what a process pays once (its database connections, the
first plans of its statements on each) weighs on each call about three times as much at 48.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psycopg

from adapters import database
from apps import config as cfg
from apps.nemo_gym_install import WORKPLACE, install
from apps.processes import ServerProcesses, free_port
from benchmarks.scaling import cpu_s, postgres_cpu_s, postmaster_pid, tree_cpu_s
from benchmarks.statements import counters, preloaded_server
from benchmarks.stats import median_interval
from participants.environments.nemo_gym_relay import task_from_row
from testkit.nemo_gym_collector import gym_venv, spawn, stop, wait_http

ROOT = Path(__file__).resolve().parent.parent
ENV = "gym_workplace"
MODEL = "fake-policy"


def progress(msg: str) -> None:
    print(f"[nemo_gym_cost] {msg}", file=sys.stderr, flush=True)


def site(python: Path) -> Path:
    return next(python.parent.parent.glob("lib/python3.13/site-packages"))


def example_rows(python: Path, n: int) -> list[dict[str, Any]]:
    rows = [json.loads(x) for x in (site(python) / "resources_servers/workplace_assistant/data/example.jsonl")
            .read_text().splitlines() if x.strip()]
    return [{**rows[i % len(rows)], "id": i} for i in range(n)]


def upstream_requests(url: str) -> int:
    with urllib.request.urlopen(f"{url}/fake/requests", timeout=10) as resp:
        return int(json.loads(resp.read())["requests"])


def gym_yaml(head: int, legacy: int, agent: dict[str, Any]) -> str:
    return json.dumps({  # JSON is YAML: the config NeMo Gym's Hydra reads
        "head_server": {"host": "127.0.0.1", "port": head},
        **agent,
        "bench_environment": {"environment_servers": {"legacy_agent": {
            "entrypoint": "app.py", "host": "127.0.0.1", "port": legacy,
            "agent_server": {"type": "responses_api_agents", "name": "bench_agent"}}}},
    }, indent=1)


def nemo_gym_agent(ports: dict[str, int], upstream: str) -> dict[str, Any]:
    """NeMo Gym's own simple_agent, vllm_model and Workplace server, as their configs/*.yaml declare them."""
    return {
        "bench_agent": {"responses_api_agents": {"simple_agent": {
            "entrypoint": "app.py", "host": "127.0.0.1", "port": ports["agent"], "max_steps": 6,
            "resources_server": {"type": "resources_servers", "name": "bench_resources"},
            "model_server": {"type": "responses_api_models", "name": "bench_model"}}}},
        "bench_model": {"responses_api_models": {"vllm_model": {
            "entrypoint": "app.py", "host": "127.0.0.1", "port": ports["model"], "base_url": f"{upstream}/v1",
            "api_key": "none", "model": MODEL, "return_token_id_information": False, "uses_reasoning_parser": True,
            "uses_interleaved_reasoning": True, "chat_template_kwargs": None, "sampling_overrides": None,
            "extra_body": None, "default_headers": {}, "endpoint_file": None, "endpoint_stale_grace_s": 300.0,
            "endpoint_connection_retries": 8, "endpoint_check_interval_s": 10.0}}},
        "bench_resources": {"resources_servers": {"workplace_assistant": {
            "entrypoint": "app.py", "host": "127.0.0.1", "port": ports["resources"], "domain": "agent",
            "verified": False, "description": "Workplace assistant", "value": "benchmark"}}},
    }


def rollbook_agent(port: int) -> dict[str, Any]:
    host = "rollbook:${oc.env:ROLLBOOK_DATA_TOKEN}@127.0.0.1"  # the data credential, the one way NeMo Gym can send it
    return {"bench_agent": {"responses_api_agents": {"rollbook": {"entrypoint": "rollbook", "host": host, "port": port}}}}


def gym_process_env(work: Path, token: str) -> dict[str, str]:
    env = {**os.environ, "NEMO_GYM_RESOLVED_CONFIG": str(work / "resolved.yaml"), "PYTHONUNBUFFERED": "1",
           "RAY_USAGE_STATS_ENABLED": "0", "ROLLBOOK_DATA_TOKEN": token}
    for key in [k for k in env if k.startswith("VIRTUAL_ENV") or k == "PYTHONPATH"]:
        env.pop(key)
    return env


def profile(work: Path, groups: dict[str, int]) -> list[subprocess.Popen[bytes]]:
    """With ROLLBOOK_BENCH_PROFILE set, py-spy samples every server (and its children) while the collector
    runs (only the thread holding the GIL: a thread blocked on a socket is no CPU), into
    <work>/profile-<group>.txt (folded stacks; the work folder is kept)."""
    if not os.environ.get("ROLLBOOK_BENCH_PROFILE"):
        return []
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    return [subprocess.Popen([spy, "record", "--pid", str(pid), "--subprocesses", "--nonblocking", "--gil", "--rate", "200",
                              "--format", "raw", "--output", str(work / f"profile-{name}.txt")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for name, pid in groups.items() if name != "postgres" and not name.endswith(" alone")]


def group_cpu_s(group: str, pid: int) -> float:
    """PostgreSQL: the postmaster and its backends; `<kind> alone`: that process without its children
    (rollbook's resources server without the NeMo Gym server it runs); any other: the process tree."""
    if group == "postgres":
        return postgres_cpu_s(pid)
    return cpu_s(pid, children=False) if group.endswith(" alone") else tree_cpu_s(pid)


def collect(work: Path, rows: list[dict[str, Any]], env: dict[str, str], groups: dict[str, int],
            procs: list[subprocess.Popen[bytes]], legacy_agent: int, parallel: int) -> dict[str, Any]:
    """legacy_agent on the config the head server merged, then the collector over `rows`; CPU of every
    group while the collector runs."""
    venv = gym_venv()
    (work / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [f"+config_paths=[{work / 'gym.yaml'}]"]
    legacy_dir = site(venv / "bin/python") / "environment_servers/legacy_agent"
    legacy = spawn([str(venv / "bin/python"), "app.py"], work / "legacy_agent.log", legacy_dir,
                   {**env, "NEMO_GYM_CONFIG_DICT": (work / "resolved.yaml").read_text(),
                    "NEMO_GYM_CONFIG_PATH": "bench_environment"})
    procs.append(legacy)
    wait_http(f"http://127.0.0.1:{legacy_agent}/docs", legacy, work / "legacy_agent.log", 300)
    groups = {**groups, "legacy_agent": legacy.pid}
    out = work / "out" / "rollouts.jsonl"
    profilers = profile(work, groups)
    before = {k: group_cpu_s(k, p) for k, p in groups.items()}
    t0 = time.perf_counter()
    with open(work / "collector.log", "wb") as log:
        collector = subprocess.Popen([str(venv / "bin/ng_collect_rollouts"), *overrides, f"+input_jsonl_fpath={work / 'rows.jsonl'}",
                                      f"+output_jsonl_fpath={out}", f"+num_samples_in_parallel={parallel}"],
                                     cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(collector.pid, 0)  # the collector's own rusage, not other children's
        collector.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    cpu = {k: group_cpu_s(k, p) - before[k] for k, p in groups.items()}
    for proc in profilers:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    cpu["collector"] = usage.ru_utime + usage.ru_stime
    if collector.returncode != 0:
        raise RuntimeError(f"ng_collect_rollouts exited {collector.returncode}:\n{(work / 'collector.log').read_text()[-3000:]}")
    written = [json.loads(x) for x in out.read_text().splitlines()]
    tool_calls = sum(1 for r in written for item in r["response"]["output"] if item.get("type") == "function_call")
    return {"wall_s": wall, "cpu_s": cpu, "rows": len(written), "tool_calls": tool_calls,
            "reward": statistics.mean(float(r["reward"]) for r in written)}


def start_head(work: Path, config: str, port: int, env: dict[str, str], procs: list[subprocess.Popen[bytes]]) -> None:
    """NeMo Gym's head server on `config`: it writes the merged config every other NeMo Gym process reads."""
    (work / "gym.yaml").write_text(config)
    head = spawn([str(gym_venv() / "bin/python"), str(ROOT / "tests/e2e/nemo_gym_head.py"), f"+config_paths=[{work / 'gym.yaml'}]"],
                 work / "head.log", work, env)
    procs.append(head)
    wait_http(f"http://127.0.0.1:{port}/global_config_dict_yaml", head, work / "head.log", 300)


def start_nemo_gym(work: Path, ports: dict[str, int], upstream: str, env: dict[str, str],
                   procs: list[subprocess.Popen[bytes]]) -> dict[str, int]:
    """NeMo Gym's three servers, each from its own folder with the merged config, as `ng_run` starts them."""
    python, venv = install()[0], gym_venv()
    start_head(work, gym_yaml(ports["head"], ports["legacy"], nemo_gym_agent(ports, upstream)), ports["head"], env, procs)
    resolved = (work / "resolved.yaml").read_text()
    groups = {}
    # The Workplace server in the Python rollbook's relay runs it in; the agent and model in the collector's
    # (vllm_model imports anthropic, which the resources servers' environment leaves out).
    for kind, name, folder, py in (("agent", "bench_agent", "responses_api_agents/simple_agent", venv / "bin/python"),
                                   ("model", "bench_model", "responses_api_models/vllm_model", venv / "bin/python"),
                                   ("resources", "bench_resources", "resources_servers/workplace_assistant", python)):
        proc = spawn([str(py), "app.py"], work / f"{kind}.log", site(py) / folder,
                     {**env, "NEMO_GYM_CONFIG_DICT": resolved, "NEMO_GYM_CONFIG_PATH": name})
        procs.append(proc)
        groups[kind] = proc.pid
    for kind, proc in zip(groups, procs[-3:], strict=True):
        wait_http(f"http://127.0.0.1:{ports[kind]}/docs", proc, work / f"{kind}.log", 300)
    return groups


def run_nemo_gym(work: Path, rows: list[dict[str, Any]], upstream: str, parallel: int) -> dict[str, Any]:
    ports = {k: free_port() for k in ("head", "legacy", "agent", "model", "resources")}
    env = gym_process_env(work, "unused")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        groups = start_nemo_gym(work, ports, upstream, env, procs)
        rows = [{**r, "agent_ref": {"name": "bench_agent"}} for r in rows]
        calls0 = upstream_requests(upstream)
        result = collect(work, rows, env, groups, procs, ports["legacy"], parallel)
        result["model_calls"] = upstream_requests(upstream) - calls0
        return result
    finally:
        for p in reversed(procs):
            stop(p)


def run_rollbook(work: Path, rows: list[dict[str, Any]], upstream: str, parallel: int, admin: str, n: int) -> dict[str, Any]:
    dbname = f"rollbook_ngcost_{n}"
    dsn = database.scratch_database(admin, dbname)
    servers = {k: cfg.ServerConfig(port=free_port()) for k in cfg.KINDS}
    servers["model"] = cfg.ServerConfig(port=free_port(), backend="openai_compatible", url=f"{upstream}/v1", model=MODEL)
    gym = cfg.NemoGymConfig(module=WORKPLACE, state="replay", python=str(install()[0]), port=free_port())
    config = cfg.Config(dsn=dsn, control_token=secrets.token_hex(16), data_token=secrets.token_hex(16), servers=servers,
                        nemo_gym={ENV: gym})
    path = work / "rollbook.toml"
    cfg.write(config, path)
    server = ServerProcesses(config, path, work)
    server.start(timeout=300)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        groups = {k: p.pid for k, p in server.procs.items()} | {"postgres": postmaster_pid(dsn),
                                                                 "resources alone": server.procs["resources"].pid}
        ports = {"head": free_port(), "legacy": free_port()}
        env = gym_process_env(work, config.data_token)
        start_head(work, gym_yaml(ports["head"], ports["legacy"], rollbook_agent(servers["agent"].port)), ports["head"], env, procs)
        tagged = []
        for r in rows:
            task = task_from_row(ENV, r, r["id"])
            tagged.append({**r, "agent_ref": {"name": "bench_agent"},
                           "rollbook": {"env": ENV, "prompt": task.prompt, "params": task.params}})
        calls0 = upstream_requests(upstream)
        before = counters(admin, dbname)
        result = collect(work, tagged, env, groups, procs, ports["legacy"], parallel)
        result["model_calls"] = upstream_requests(upstream) - calls0
        time.sleep(1.5)  # pg_stat_database is flushed about once a second
        after = counters(admin, dbname)
        result["statements"] = after["statements"] - before["statements"]
        result["transactions"] = after["transactions"] - before["transactions"]
        result["sessions"] = after["sessions"] - before["sessions"]  # connections PostgreSQL started
        with psycopg.connect(database.libpq_dsn(dsn)) as conn:
            result["events"] = conn.execute("SELECT count(*) FROM rollbook.events").fetchone()[0]  # type: ignore[index]
            # Which server wrote which events, in how many appends (an append's events share a commit time),
            # their payloads' JSON text and what PostgreSQL stores of them (compressed where large), in bytes.
            result["event_kinds"] = {f"{w} {k}": [n, a, int(t), int(c)] for w, k, n, a, t, c in conn.execute(
                "SELECT split_part(writer, '-', 1), kind, count(*), count(DISTINCT (writer, recorded_at)), "
                "sum(octet_length(data::text)), sum(pg_column_size(data)) "
                "FROM rollbook.events GROUP BY 1, 2 ORDER BY 3 DESC").fetchall()}
        result["statement_ms"] = statement_times(admin, dbname)
        result["planning"] = planning(admin, dbname)
        return result
    finally:
        for p in reversed(procs):
            stop(p)
        server.stop()


def statement_times(admin: str, dbname: str) -> dict[str, float]:
    """PostgreSQL's own time in each statement of the run (pg_stat_statements), ms in all."""
    with psycopg.connect(admin, autocommit=True) as conn:
        rows = conn.execute("SELECT left(regexp_replace(query, '\\s+', ' ', 'g'), 110), sum(total_exec_time + total_plan_time) "
                            "FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE datname = %s) "
                            "GROUP BY 1 ORDER BY 2 DESC LIMIT 12", (dbname,)).fetchall()
    return {q: float(ms) for q, ms in rows}


def planning(admin: str, dbname: str) -> dict[str, float]:
    """How often PostgreSQL planned the run's statements and its time planning them against running them,
    ms in all; the lock on the log's head is left out, its time being the wait for it. `by_statement`: the
    ten statements it spent most time planning, each [text, executions, plans, ms planning, ms running]."""
    with psycopg.connect(admin, autocommit=True) as conn:
        row = conn.execute("SELECT sum(calls), sum(plans), sum(total_plan_time), sum(total_exec_time) FROM pg_stat_statements "
                           "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = %s) AND query NOT LIKE %s",
                           (dbname, "%FOR UPDATE%")).fetchone()
        top = conn.execute("SELECT left(regexp_replace(query, '\\s+', ' ', 'g'), 90), sum(calls), sum(plans), sum(total_plan_time), "
                           "sum(total_exec_time) FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE datname = %s) "
                           "GROUP BY 1 ORDER BY 4 DESC LIMIT 10", (dbname,)).fetchall()
    assert row is not None
    return {"calls": float(row[0] or 0), "plans": float(row[1] or 0), "plan_ms": float(row[2] or 0), "exec_ms": float(row[3] or 0),
            "by_statement": [[q, int(c), int(n), round(float(pm), 1), round(float(em), 1)] for q, c, n, pm, em in top]}


GROUPS = ("agent", "model", "resources", "environment", "postgres")
COMMON = ("legacy_agent", "collector", "upstream")


def per_call(results: list[dict[str, Any]], group: str, per: str = "model_calls") -> float | None:
    values = [r["cpu_s"][group] / r[per] * 1000 for r in results if group in r["cpu_s"] and r[per]]
    return statistics.median(values) if values else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rollouts", type=int, default=150)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--parallel", type=int, default=8, help="the collector's num_samples_in_parallel")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "nemo_gym_cost.json")
    args = p.parse_args()
    progress("NeMo Gym's environments (built on first use)")
    python, _ = install()
    gym_venv()
    rows = example_rows(python, args.rollouts)
    work = Path(tempfile.mkdtemp(prefix="rb-ngcost-"))
    admin, stop_pg = preloaded_server()
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    port = free_port()
    upstream = f"http://127.0.0.1:{port}"
    fake = spawn([sys.executable, "-m", "testkit.fake_vllm", "--port", str(port), "--nemo-gym-players"], work / "upstream.log",
                 ROOT, {**os.environ, "PYTHONPATH": str(ROOT)})
    results: dict[str, list[dict[str, Any]]] = {"NeMo Gym alone": [], "through rollbook": []}
    try:
        wait_http(f"{upstream}/v1/models", fake, work / "upstream.log", 60)
        for r in range(args.rounds):
            for side in results:
                folder = work / f"{side.split()[0].lower()}-{r}"
                folder.mkdir()
                progress(f"round {r + 1}/{args.rounds}: {side}, {args.rollouts} rollouts")
                up0 = tree_cpu_s(fake.pid)
                if side == "NeMo Gym alone":
                    one = run_nemo_gym(folder, rows, upstream, args.parallel)
                else:
                    one = run_rollbook(folder, rows, upstream, args.parallel, admin, r)
                one["cpu_s"]["upstream"] = tree_cpu_s(fake.pid) - up0
                progress(f"  {one['model_calls']} model calls, {one['tool_calls']} tool calls, {one['wall_s']:.1f} s, "
                         f"mean reward {one['reward']:.3f}")
                results[side].append(one)
    except BaseException:
        progress(f"failed: the servers' logs are in {work}")
        raise
    finally:
        stop(fake)
        stop_pg()
    if os.environ.get("ROLLBOOK_BENCH_PROFILE"):
        progress(f"profiles: {work}/*/profile-*.txt")
    else:
        shutil.rmtree(work, ignore_errors=True)
    report(results, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": results}, indent=1))
    print(f"\nwritten to {args.out}")
    return 0


def report(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> None:
    gym, rb = results["NeMo Gym alone"], results["through rollbook"]
    for rs in (gym, rb):
        for r in rs:
            r["cpu_s"]["servers"] = sum(r["cpu_s"].get(g, 0.0) for g in GROUPS)
    print(f"\n{args.rollouts} rollouts, {args.rounds} rounds (A B A B), {args.parallel} in parallel; medians\n")
    print("| CPU ms per model call | NeMo Gym alone | through rollbook | ratio |")
    print("|---|--:|--:|--:|")
    for g in ("servers", *GROUPS, "resources alone", *COMMON):
        a, b = per_call(gym, g), per_call(rb, g)
        label = {"servers": "**all servers** (PostgreSQL included)", "resources": "resources (with the Workplace server)",
                 "resources alone": "of it, rollbook's resources server alone"}.get(
                     g, g + (" (both sides, not in the total)" if g in COMMON else ""))
        print(f"| {label} | {'-' if a is None else f'{a:.1f}'} | {'-' if b is None else f'{b:.1f}'} | "
              f"{f'{b / a:.2f}x' if a and b else '-'} |")
    a, b = per_call(gym, "servers", "tool_calls"), per_call(rb, "servers", "tool_calls")
    print(f"| all servers, per tool call | {a:.1f} | {b:.1f} | {b / a:.2f}x |" if a and b else "")
    # Each round against the NeMo Gym round just before it: the machine's speed moves less within a pair.
    ratios = [rb_ / gym_ for g, r in zip(gym, rb, strict=False)
              if (gym_ := per_call([g], "servers")) and (rb_ := per_call([r], "servers"))]
    if ratios:
        m, lo, hi = median_interval(ratios)
        print(f"\neach round's ratio, all servers: {', '.join(f'{x:.2f}' for x in ratios)}; their median {m:.2f}x"
              + (f", 95 % bootstrap interval {lo:.2f} to {hi:.2f}" if len(ratios) >= 5 else ""))

    def med(rs: list[dict[str, Any]], key: str) -> float:
        return statistics.median(float(r[key]) for r in rs)
    print(f"\nmodel calls a round: {med(gym, 'model_calls'):.0f} vs {med(rb, 'model_calls'):.0f}; tool calls "
          f"{med(gym, 'tool_calls'):.0f} vs {med(rb, 'tool_calls'):.0f}; mean reward {med(gym, 'reward'):.3f} vs "
          f"{med(rb, 'reward'):.3f}")
    print(f"wall (noisy): {med(gym, 'wall_s'):.1f} s vs {med(rb, 'wall_s'):.1f} s")
    calls = med(rb, "model_calls")
    print(f"rollbook per model call: {med(rb, 'statements') / calls:.1f} statements, "
          f"{med(rb, 'transactions') / calls:.1f} transactions, {med(rb, 'events') / calls:.2f} events; "
          f"{med(rb, 'sessions'):.0f} connections opened a round")
    last = rb[-1]
    if "planning" in last:
        pl = last["planning"]
        print(f"PostgreSQL (the last round, the database's migration included): {pl['plans'] / calls:.1f} plans for "
              f"{pl['calls'] / calls:.1f} statements, {pl['plan_ms'] / calls:.2f} ms planning and {pl['exec_ms'] / calls:.2f} ms "
              "running them per model call (the log head's lock left out)")
        print("\nPostgreSQL's planning by statement, per model call: executions, plans, ms planning, ms running (the last round):\n")
        for q, n, plans, plan_ms, exec_ms in pl.get("by_statement", []):
            print(f"  {n / calls:5.2f} {plans / calls:5.2f} {plan_ms / calls:6.2f} {exec_ms / calls:6.2f}  {q}")
    print("\nPostgreSQL's time in its costliest statements, ms per model call (the last round; the counters are the "
          "database's since it was made, so its migration is among them):\n")
    for q, ms in last["statement_ms"].items():
        print(f"  {ms / last['model_calls']:6.2f}  {q}")
    print("\nEvents per model call by writer and kind, the commits that wrote them, and their payloads' bytes per model "
          "call as JSON text and as stored (the last round):\n")
    for name, (n, commits, *size) in last.get("event_kinds", {}).items():
        text_b, stored_b = (f"{b / last['model_calls']:8.0f}" for b in size) if size else ("", "")
        print(f"  {n / last['model_calls']:5.2f}  {commits / last['model_calls']:5.2f} {text_b} {stored_b}  {name}")


if __name__ == "__main__":
    raise SystemExit(main())

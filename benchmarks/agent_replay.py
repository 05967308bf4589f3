"""How long a replay of N recorded calls takes, against the live calls it replaces.

    .venv/bin/python -m benchmarks.agent_replay [--calls 40] [--token-ms 5] [--repeats 3] [--out PATH]

A black-box agent (the OpenAI SDK, one growing conversation of arithmetic questions, no rollbook
header) makes `--calls` chat calls on attempt 0 of a rollout. The model server runs in this process
(aiohttp on 127.0.0.1, its log and token store on a throwaway PostgreSQL); its backend is the fake
vLLM in a process of its own, generating `--token-ms` ms a token. Then attempt 1 continues from all of
attempt 0 (as a recovery records it) and the agent runs again from its start under a fresh model
server process-state: every call is answered from the log (engine.agent_replay). Each repeat uses
a rollout of its own. Last, the agent runs against a stub that answers every call at once, which
is the agent's own cost of a call (the SDK sends the whole growing conversation each time). It prints
per-call medians, the totals, their ratio, and the CPU time this process (the model server and the
agent) spent on each phase, and writes one JSON object to
benchmarks/results/agent_replay.json. It never asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import openai
from aiohttp import web

from adapters.postgres import PostgresEventStore
from adapters.token_store import PostgresTokenStore
from apps.processes import free_port
from engine.attempts import ATTEMPT_STARTED
from engine.events import AppendRequest, NewEvent
from engine.identity import rollout_stream
from engine.recovery import Recovery, recovery_request
from participants.base.guard import Credentials
from participants.model.app import build_model_app
from participants.model.backends.openai_compatible import OpenAICompatibleBackend
from testkit.pg import primary_server

ROOT = Path(__file__).resolve().parent.parent
CREDS = Credentials(control="bench-control", data="bench-data")


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def agent(base_url: str, calls: int) -> list[float]:
    """The agent's calls, each timed from request to reply."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=CREDS.data, max_retries=0)
    history: list[Any] = []
    took = []
    for n in range(calls):
        history.append({"role": "user", "content": f"What is {n} + {2 * n + 1}?"})
        t0 = time.perf_counter()
        reply = await client.chat.completions.create(model="fake-policy", messages=history)
        took.append(time.perf_counter() - t0)
        history.append({"role": "assistant", "content": reply.choices[0].message.content})
    await client.close()
    return took


async def timed(app: web.Application, base_path: str, calls: int) -> dict[str, Any]:
    """The agent's run against `app`, served on a free port for it, at `base_path` there."""
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        cpu0, t0 = time.process_time(), time.perf_counter()
        took = await agent(f"http://127.0.0.1:{port}{base_path}", calls)
        return {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0,
                "per_call_p50_ms": statistics.median(took) * 1000, "per_call_max_ms": max(took) * 1000}
    finally:
        await runner.cleanup()


async def phase(store: PostgresEventStore, upstream: str, rollout: str, attempt: int, calls: int) -> dict[str, Any]:
    """One run of the agent against a model server started for it (a restarted process: nothing in memory)."""
    backend = OpenAICompatibleBackend(upstream, model="fake-policy")
    try:
        return await timed(build_model_app(store, backend, PostgresTokenStore(store), CREDS),
                           f"/rollouts/{rollout}/attempts/{attempt}/v1", calls)
    finally:
        await backend.close()


async def agent_alone(calls: int) -> dict[str, Any]:
    """The agent against a server that answers every call at once with a fixed reply: what the agent's
    own side of a call costs (the SDK builds and parses a request of the whole growing conversation)."""
    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"id": "stub", "object": "chat.completion", "created": 0, "model": "fake-policy",
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "42"},
                                               "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    return await timed(app, "/v1", calls)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    server = primary_server()
    port = free_port()
    fake = subprocess.Popen([sys.executable, "-m", "testkit.fake_vllm", "--port", str(port),
                             "--token-latency-s", str(args.token_ms / 1000)], cwd=ROOT)
    store = PostgresEventStore.connect(server.new_database(), writer="bench")
    try:
        await asyncio.sleep(1.5)
        runs = []
        for r in range(args.repeats):
            rollout = f"replay-{r}"
            await store.append(AppendRequest((NewEvent(rollout_stream(rollout), ATTEMPT_STARTED,
                                                       {"parent_attempt": None}, rollout, 0),)))
            live = await phase(store, f"http://127.0.0.1:{port}/v1", rollout, 0, args.calls)
            await store.append(recovery_request(Recovery(rollout, 0, "continue", None, True, "benchmark: a crash")))
            replay = await phase(store, f"http://127.0.0.1:{port}/v1", rollout, 1, args.calls)
            runs.append({"live": live, "replay": replay, "agent_alone": await agent_alone(args.calls)})
            progress(f"repeat {r + 1}/{args.repeats}: live {live['wall_s']:.2f} s, replay {replay['wall_s']:.2f} s")
    finally:
        await store.close()
        fake.terminate()
        fake.wait(10)
        server.close()

    def med(which: str, key: str) -> float:
        return statistics.median(run[which][key] for run in runs)

    return {"calls": args.calls, "token_ms": args.token_ms, "repeats": args.repeats, "runs": runs,
            "live_wall_s": med("live", "wall_s"), "replay_wall_s": med("replay", "wall_s"),
            "replay_over_live": med("replay", "wall_s") / med("live", "wall_s"),
            "live_per_call_p50_ms": med("live", "per_call_p50_ms"), "replay_per_call_p50_ms": med("replay", "per_call_p50_ms"),
            "live_cpu_s": med("live", "cpu_s"), "replay_cpu_s": med("replay", "cpu_s"),
            "agent_alone_wall_s": med("agent_alone", "wall_s"), "agent_alone_per_call_p50_ms": med("agent_alone", "per_call_p50_ms"),
            "agent_alone_cpu_s": med("agent_alone", "cpu_s")}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--token-ms", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "agent_replay.json")
    result = asyncio.run(main(parser.parse_args()))
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['calls']} calls, the fake vLLM at {result['token_ms']:g} ms a token, median of {result['repeats']}:")
    print(f"  live:   {result['live_wall_s']:.2f} s ({result['live_per_call_p50_ms']:.1f} ms a call, "
          f"{result['live_cpu_s']:.2f} s CPU here)")
    print(f"  replay: {result['replay_wall_s']:.2f} s ({result['replay_per_call_p50_ms']:.1f} ms a call, "
          f"{result['replay_cpu_s']:.2f} s CPU here): {result['replay_over_live']:.3f} of the live time")
    print(f"  the agent alone, every call answered at once by a stub: {result['agent_alone_wall_s']:.2f} s "
          f"({result['agent_alone_per_call_p50_ms']:.1f} ms a call, {result['agent_alone_cpu_s']:.2f} s CPU): "
          f"rollbook's part of a replayed call is the difference")

"""The model server's prepare with many calls mid-generation: it cuts, it never waits for a generation.

    .venv/bin/python benchmarks/prepare_model.py [--calls 80] [--repeats 5] [--token-latency-s 0.05]
                                                 [--backend scripted|upstream] [--settle-s 0.2] [--dsn DSN] [--out PATH]

One model server (aiohttp on a real port, its log on a real PostgreSQL: a throwaway embedded one
unless --dsn is given, migrated fresh) serves `--calls` concurrent calls, half streamed to their
client and half not, each of a different rollout. The backend is the scripted policy with
`--token-latency-s` per step (4.5 s per reply at the default 0.5 s), or with `--backend upstream` the
OpenAI-compatible backend against the fake vLLM server of testkit/fake_vllm.py at the same pace.
When every call has tokens of its own saved (participants.model.progress), the control plane's
prepare is called over HTTP and timed (the round trip as the coordinator sees it). Each in-flight
call must end cut at a token boundary: the prefix in the token store and `call_cut` in the log, which
the benchmark appends from the prepare's reply as the coordinator does with `checkpoint_prepared`
(timed apart: `records_append_ms`). Then resume, new calls, again:
`--repeats` times; the median is reported with each run, and with the time the generations would
still have needed (what a drain would have waited).

One JSON object goes to stdout and to benchmarks/results/prepare_model.json. Nothing asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
from aiohttp import web  # noqa: E402

from adapters import database, embedded  # noqa: E402
from adapters.postgres import PostgresEventStore  # noqa: E402
from adapters.token_store import PostgresTokenStore  # noqa: E402
from engine.attempts import ATTEMPT_STARTED  # noqa: E402
from engine.events import AppendRequest, NewEvent  # noqa: E402
from engine.identity import rollout_stream  # noqa: E402
from engine.prepare_records import PrepareRecord  # noqa: E402
from participants.base.app import PARTICIPANT  # noqa: E402
from participants.base.guard import Credentials  # noqa: E402
from participants.base.wire import CONTROL  # noqa: E402
from participants.model.app import build_model_app  # noqa: E402
from participants.model.backends.openai_compatible import OpenAICompatibleBackend  # noqa: E402
from participants.model.backends.scripted import ScriptedBackend  # noqa: E402

CREDS = Credentials(control="bench-control", data="bench-data")
PROMPT = "Say something."  # the scripted reply is 9 steps: 4.5 s of generation at the default 0.5 s a step


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def one_round(session: aiohttp.ClientSession, base: str, participant: Any, round_no: int, calls: int,
                    store: PostgresEventStore, settle_s: float = 0.0) -> dict[str, Any]:
    rollouts = [f"bench-{round_no}-{i}" for i in range(calls)]
    await store.append(AppendRequest(tuple(NewEvent(rollout_stream(r), ATTEMPT_STARTED, {"parent_attempt": None}, r, 0)
                                           for r in rollouts)))
    async def call(i: int, rid: str) -> tuple[int, str]:
        body = {"messages": [{"role": "user", "content": PROMPT}], "seed": i, "stream": i % 2 == 0}
        url = f"{base}/rollouts/{rid}/attempts/0/v1/chat/completions"
        async with session.post(url, json=body, headers={"X-Rollbook-Call-Id": f"{rid}.0.t0", "Authorization": f"Bearer {CREDS.data}"}) as resp:
            return resp.status, (await resp.text())[-200:]

    tasks = [asyncio.ensure_future(call(i, r)) for i, r in enumerate(rollouts)]
    # Wait until every call is mid-generation with tokens of its own saved (participants.model.progress
    # saves them every PROGRESS_S): the calls a prepare cuts. It has not finished.
    started = time.monotonic()
    while True:
        live = [c for c in participant.calls.values() if c.rollout_id in set(rollouts)]
        if len(live) == calls and all(c.saved_here() is not None and not c.done.is_set() for c in live):
            break
        await asyncio.sleep(0.005)
        if time.monotonic() - started > 60:
            raise RuntimeError("the calls did not all have tokens saved within 60 s")
    await asyncio.sleep(settle_s)  # tokens received since the last save are generated again after the cut
    mid = {"tokens_min": min(len(c.ids) for c in live), "tokens_max": max(len(c.ids) for c in live),
           "saved_before_prepare": sum(1 for c in live if getattr(c, "durable", None) is not None)}
    t0 = time.perf_counter()
    async with session.post(f"{base}{CONTROL}/prepare", json={"checkpoint_id": f"bench-ck{round_no}",
                                                               "deadline": time.time() + 30},
                            headers={"Authorization": f"Bearer {CREDS.control}"}) as resp:
        report = await resp.json()
    prepare_ms = (time.perf_counter() - t0) * 1000
    t0 = time.perf_counter()  # what the coordinator then appends with `checkpoint_prepared` (engine.prepare_records)
    await asyncio.gather(*(store.append(PrepareRecord.from_json(r).request()) for r in report.get("records", [])))
    records_ms = (time.perf_counter() - t0) * 1000
    async with session.post(f"{base}{CONTROL}/resume", json={"checkpoint_id": f"bench-ck{round_no}",
                                                              "deadline": time.time() + 30},
                            headers={"Authorization": f"Bearer {CREDS.control}"}) as resp:
        await resp.read()
    results = await asyncio.gather(*tasks)  # a cut call's reply goes out at resume
    async with store.engine.connect() as conn:
        from sqlalchemy import text

        cut = (await conn.execute(text(
            "SELECT count(*), min((data->>'tokens')::int), max((data->>'tokens')::int) FROM rollbook.events "
            "WHERE kind = 'call_cut' AND starts_with(rollout_id, :p)"), {"p": f"bench-{round_no}-"})).one()
    return {"prepare_ms": round(prepare_ms, 2), "records_append_ms": round(records_ms, 2), "ready": report.get("ready"), "counts": report.get("counts"),
            "tokens_at_prepare": mid,
            "calls_cut": cut[0], "cut_prefix_tokens_min": cut[1], "cut_prefix_tokens_max": cut[2],
            "client_statuses": sorted({s for s, _ in results})}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    cleanup = None
    if args.dsn:
        admin = args.dsn
    else:
        admin, cleanup = embedded.throwaway("rbprep-")
    dsn = database.scratch_database(admin, f"rollbook_prep_{int(time.time())}")
    store = PostgresEventStore.connect(dsn, writer="bench-model")
    tokens = PostgresTokenStore(store)  # as `rollbook serve` builds it: staged blobs ride in the next append
    fake = None
    if args.backend == "upstream":
        from testkit.fake_vllm import FakeVLLM

        fake = FakeVLLM(token_latency_s=args.token_latency_s)
        await fake.start()
        backend: Any = OpenAICompatibleBackend(fake.url, model="fake-policy")
    else:
        backend = ScriptedBackend(token_latency_s=args.token_latency_s)
    reply_steps = len(ScriptedBackend().plan({"messages": [{"role": "user", "content": PROMPT}], "seed": 0})[1])
    app = build_model_app(store, backend, tokens, CREDS, "bench-model")
    participant = app[PARTICIPANT]
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    rounds = []
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                         connector=aiohttp.TCPConnector(limit=0)) as session:
            for r in range(args.repeats):
                rounds.append(await one_round(session, base, participant, r, args.calls, store, args.settle_s))
                progress(f"round {r}: prepare {rounds[-1]['prepare_ms']} ms, {rounds[-1]['calls_cut']} cut")
    finally:
        await runner.cleanup()
        if fake is not None:
            await fake.stop()
            await backend.close()
        await store.close()
        if cleanup is not None:
            cleanup()
    med = statistics.median(x["prepare_ms"] for x in rounds)
    return {
        "benchmark": "model server prepare with calls mid-generation",
        "command": " ".join(["benchmarks/prepare_model.py", *sys.argv[1:]]),
        "backend": args.backend, "calls": args.calls, "token_latency_s": args.token_latency_s, "settle_s": args.settle_s,
        "reply_steps": reply_steps, "generation_s_per_reply": round(reply_steps * args.token_latency_s, 2),
        "prepare_ms_median": med, "rounds": rounds,
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=80)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--token-latency-s", type=float, default=0.5)
    parser.add_argument("--backend", choices=["scripted", "upstream"], default="scripted")
    parser.add_argument("--settle-s", type=float, default=0.0, help="wait this long after every call has a token")
    parser.add_argument("--dsn")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "prepare_model.json"))
    args = parser.parse_args()
    result = asyncio.run(main(args))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))

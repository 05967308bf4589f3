"""What NeMo Gym's serving path waits for when rollbook's log is its token-capture transport.

    .venv/bin/python benchmarks/nemo_gym_tokens.py [--rollouts 32] [--clients 1] [--calls 4] [--tokens 512] [--dsn DSN]

Gym's model server awaits `TokenSink.put` before it answers a call, so a put's latency is added to
every model call. `--rollouts` rollouts run concurrently over `--clients` clients (Gym builds one
sink per model-server process, shared by its concurrent calls; more clients stand for more
processes, which cannot share a connection pool), each making `--calls` calls in turn (begin_call, then put of a record with a `--tokens`-id
prompt growing by `--tokens` per call and `--tokens` generated ids), then a trainer freezes each
rollout and retires it. Without --dsn, a throwaway embedded PostgreSQL is used (as testkit/pg.py
does). One JSON object on stdout; nothing asserts a time. Needs nemo-gym importable (testkit/nemo_gym_env.py
installs it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from testkit import nemo_gym_env  # noqa: E402

nemo_gym_env.ensure()

from nemo_gym.token_id_capture.records import ParentResolutionStatus, TokenEntry, stamp_lineage  # noqa: E402

from adapters import database, embedded  # noqa: E402
from adapters.nemo_gym_tokens import RollbookTokenCapture  # noqa: E402


def entry(rollout: str, call: int, tokens: int) -> TokenEntry:
    prompt = list(range(1, tokens * (call + 1) + 1))
    e = TokenEntry(rollout_id=rollout, model_call_id=f"c{call}", prompt_token_ids=prompt,
                   generation_token_ids=list(range(tokens)), generation_log_probs=[-0.5] * tokens,
                   output_items=[{"type": "message", "role": "assistant", "content": "x"}], token_item_index=0)
    return stamp_lineage(e, None, parent_resolution=ParentResolutionStatus.ROOT)


def ms(xs: list[float], q: float) -> float:
    return round(1000 * statistics.quantiles(xs, n=100)[int(q) - 1], 2) if len(xs) > 1 else round(1000 * xs[0], 2)


async def run(dsn: str, rollouts: int, n_clients: int, calls: int, tokens: int) -> dict[str, object]:
    puts: list[float] = []
    begins: list[float] = []
    clients = [RollbookTokenCapture(dsn) for _ in range(n_clients)]

    async def one(i: int) -> None:
        client = clients[i % n_clients]
        for c in range(calls):
            t0 = time.perf_counter()
            await client.begin_call(f"bench-{i}", f"c{c}")
            t1 = time.perf_counter()
            await client.put(entry(f"bench-{i}", c, tokens))
            begins.append(t1 - t0)
            puts.append(time.perf_counter() - t1)

    start = time.perf_counter()
    try:
        await asyncio.gather(*(one(i) for i in range(rollouts)))
    finally:
        await asyncio.gather(*(c.close() for c in clients))
    serving = time.perf_counter() - start
    trainer = RollbookTokenCapture(dsn)
    freezes: list[float] = []
    try:
        for i in range(rollouts):
            t0 = time.perf_counter()
            snap = await trainer.freeze(f"bench-{i}")
            freezes.append(time.perf_counter() - t0)
            assert await trainer.drop(f"bench-{i}", snapshot_id=snap.snapshot_id, version=snap.version)
    finally:
        await trainer.close()
    return {"rollouts": rollouts, "clients": n_clients, "calls_per_rollout": calls, "tokens_per_segment": tokens,
            "put_p50_ms": ms(puts, 50), "put_p99_ms": ms(puts, 99),
            "begin_call_p50_ms": ms(begins, 50), "freeze_p50_ms": ms(freezes, 50),
            "calls_per_s": round(rollouts * calls / serving, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rollouts", type=int, default=32)
    ap.add_argument("--clients", type=int, default=1)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--dsn")
    args = ap.parse_args()
    cleanup = None
    if args.dsn:
        dsn = args.dsn
    else:
        admin, cleanup = embedded.throwaway("rbgym-")
        dsn = database.scratch_database(admin, "bench_gym")
    try:
        print(json.dumps(asyncio.run(run(dsn, args.rollouts, args.clients, args.calls, args.tokens))))
    finally:
        if cleanup is not None:
            cleanup()


if __name__ == "__main__":
    main()

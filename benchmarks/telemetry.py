"""What /metrics and spans cost the run: the same episodes with the instrumentation off, on, and on with spans.

    .venv/bin/python benchmarks/telemetry.py [--episodes 24] [--concurrency 8] [--repeats 5] [--dsn DSN] [--out PATH]

The four servers in one process (apps/stack.py: real aiohttp servers on 127.0.0.1, one PostgreSQL:
a throwaway embedded one unless --dsn is given), `--episodes` workplace episodes at `--concurrency`
(each 4 model calls, 3 tool calls and about 40 appends), then one checkpoint (prepare, commit,
resume). Three modes, interleaved within each repeat so a noisy moment does not land on one:

- off: no route wrapped, no store observer: what the servers did before /metrics existed;
- metrics: as `rollbook serve` runs without [telemetry] (histograms, counters, gauges; no tracer);
- spans: metrics and spans, through a BatchSpanProcessor whose exporter drops them (the SDK's cost,
  not a collector's).

Reported per mode (medians): episodes/s (wall clock), the servers' CPU time per episode (this process's
CPU time: steadier than the wall clock on a shared machine) and the checkpoint's wall time. Also the
cost of one instrumented operation alone (`Telemetry.operation`), in microseconds. Prints one
JSON object and writes it to benchmarks/results/telemetry.json. Nothing asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
import timeit
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from opentelemetry.sdk.trace import ReadableSpan  # noqa: E402
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult  # noqa: E402

from adapters import database, embedded  # noqa: E402
from adapters.postgres import PostgresEventStore  # noqa: E402
from adapters.telemetry import Telemetry  # noqa: E402
from apps.stack import start_stack  # noqa: E402
from participants.base import observability  # noqa: E402
from participants.base.observability import TELEMETRY  # noqa: E402
from participants.environments.tasks import make_task  # noqa: E402
from participants.model.backends.scripted import ScriptedBackend  # noqa: E402

MODES = ("off", "metrics", "spans")
TASK = make_task("workplace", 3)


class Dropping(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


async def one_run(dsn: str, store: PostgresEventStore, mode: str, tag: str, episodes: int, concurrency: int) -> dict[str, float]:
    instrument = observability._instrument
    if mode == "off":
        observability._instrument = lambda route, telemetry: route  # type: ignore[assignment]
    try:
        s = await start_stack(dsn, tag, ScriptedBackend())
    finally:
        observability._instrument = instrument
    try:
        for kind, srv in s.servers.items():
            if mode == "off":
                s.participant(kind).store.observers.clear()  # type: ignore[attr-defined]
            elif mode == "spans":
                srv.app[TELEMETRY].export_spans(Dropping())  # batched, like the OTLP exporter
        gate = asyncio.Semaphore(concurrency)

        async def episode(i: int) -> None:
            async with gate:
                result = await s.episode(TASK, f"{tag}-{i}")
                assert result["reward"] == 1.0, result

        started, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(episode(i) for i in range(episodes)))
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
        # How many times the instrumentation ran (read from the servers' own registries, metrics modes only).
        counted = {"operations": 0.0, "appends": 0.0}
        for srv in s.servers.values():
            for metric in srv.app[TELEMETRY].registry.collect():
                for sample in metric.samples:
                    if sample.name == "rollbook_operations_total":
                        counted["operations"] += sample.value
                    elif sample.name == "rollbook_appends_total":
                        counted["appends"] += sample.value
        coordinator = s.coordinator(store)
        began = time.perf_counter()
        assert (await coordinator.prepare(f"{tag}-ck", time.time() + 60))["ready"]
        await coordinator.commit(f"{tag}-ck", time.time() + 60)
        await coordinator.resume(f"{tag}-ck")
        checkpoint = time.perf_counter() - began
    finally:
        await s.close()
    # CPU time of this process (the four servers; PostgreSQL is another process) is what the instrumentation
    # adds to; on a shared machine it is much steadier than the wall clock.
    return {"episodes_per_s": episodes / elapsed, "server_cpu_ms_per_episode": cpu * 1000 / episodes,
            "checkpoint_ms": checkpoint * 1000, "operations_per_episode": counted["operations"] / episodes,
            "appends_per_episode": counted["appends"] / episodes}


def per_operation_us(n: int = 20000) -> dict[str, float]:
    """The instrumentation alone, best of 5 x `n`: one wrapped operation, one append reported."""
    plain, traced = Telemetry("model", "bench"), Telemetry("model", "bench")
    traced.export_spans(Dropping())
    attrs = {"rollbook.rollout_id": "r-1", "rollbook.attempt": 0, "rollbook.call_id": "r-1.0.t0"}

    def call(t: Telemetry, category: Any, op: str) -> Any:
        def run() -> None:
            with t.operation(category, op, attrs):
                pass
        return run

    cases = {"model_call": call(plain, "model_call", "chat_completions"), "phase": call(plain, "phase", "prepare"),
             "append_observed": lambda: plain.appended(4, 0.002),
             "model_call_with_span": call(traced, "model_call", "chat_completions")}
    out = {name: round(min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6, 2) for name, fn in cases.items()}
    traced.shutdown()
    return out


async def main(args: argparse.Namespace) -> dict[str, Any]:
    cleanup = None
    admin = args.dsn
    if not admin:
        admin, cleanup = embedded.throwaway("rbtele-")
    dsn = database.scratch_database(admin, f"rollbook_tele_{int(time.time())}")
    store = PostgresEventStore.connect(dsn, writer="bench-coordinator")
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    try:
        await one_run(dsn, store, "metrics", "warm", min(4, args.episodes), args.concurrency)  # imports, pools, caches
        for r in range(args.repeats):
            order = MODES[r % 3:] + MODES[:r % 3]  # rotate which mode goes first
            for mode in order:
                runs[mode].append(await one_run(dsn, store, mode, f"{mode}{r}", args.episodes, args.concurrency))
                print(f"repeat {r} {mode}: {runs[mode][-1]}", file=sys.stderr, flush=True)
    finally:
        await store.close()
        if cleanup:
            cleanup()

    def median(mode: str, key: str) -> float:
        return round(statistics.median(x[key] for x in runs[mode]), 2)

    keys = ("episodes_per_s", "server_cpu_ms_per_episode", "checkpoint_ms")
    summary: dict[str, dict[str, float]] = {m: {k: median(m, k) for k in keys} for m in MODES}
    for m in ("metrics", "spans"):
        summary[m]["throughput_vs_off"] = round(summary[m]["episodes_per_s"] / summary["off"]["episodes_per_s"], 3)
        summary[m]["cpu_vs_off"] = round(summary[m]["server_cpu_ms_per_episode"] / summary["off"]["server_cpu_ms_per_episode"], 3)
    # The instrumentation's own cost per episode: what ran (counted) times what each costs (timed alone),
    # against the servers' CPU time per episode with it off. A bound the noisy end-to-end figures cannot give.
    ops, appends = median("metrics", "operations_per_episode"), median("metrics", "appends_per_episode")
    unit = per_operation_us()
    metrics_ms = (ops * unit["model_call"] + appends * unit["append_observed"]) / 1000
    spans_ms = metrics_ms + ops * (unit["model_call_with_span"] - unit["model_call"]) / 1000
    cpu_off = summary["off"]["server_cpu_ms_per_episode"]
    estimate = {"operations_per_episode": ops, "appends_per_episode": appends,
                "metrics_ms_per_episode": round(metrics_ms, 3), "metrics_share_of_cpu": round(metrics_ms / cpu_off, 5),
                "spans_ms_per_episode": round(spans_ms, 3), "spans_share_of_cpu": round(spans_ms / cpu_off, 5)}
    return {
        "command": "python benchmarks/telemetry.py " + " ".join(sys.argv[1:]),
        "episodes": args.episodes, "concurrency": args.concurrency, "repeats": args.repeats,
        "median": summary,
        "per_operation_us": unit,
        "instrumentation_cost": estimate,
        "runs": runs,
        "machine": {"nproc": os.cpu_count(), "platform": platform.platform(), "loadavg": [round(x, 2) for x in os.getloadavg()]},
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--episodes", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dsn", default=None)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "telemetry.json")
    args = p.parse_args()
    out = asyncio.run(main(args))
    print(json.dumps(out, indent=2))
    args.out.write_text(json.dumps(out, indent=2) + "\n")

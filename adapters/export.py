"""`rollbook export --run RUN_ID --out FILE`: one training record per finished rollout of a run.

A record (JSONL: one JSON object a line; Parquet: one row, the same fields, by the file's suffix):

    rollout_id, attempt (the attempt that finished), task_id, reward, policy_versions,
    origin      = null, or for a fork {rollout_id, attempt, position}: the boundary it was forked from,
    fork_group  = null, or the fork's group (the rollouts one request forked from one boundary),
    shared_prefix = {turns, tokens}: how many of its turns and tokens a fork inherited (0 otherwise),
    turns: [{turn, call_id, policy_version, finish_reason,
             shared      = true for a turn a fork inherited from its origin, which it did not generate,
             token_ids   = prompt ids + generated ids of that model call,
             loss_mask   = 0 for each prompt token (the conversation so far, tool results included),
                           1 for each generated token, 0 for every token of a shared turn,
             logprobs    = 0.0 for each prompt token, the sampling logprob of each generated token}]

The turns are the model calls whose replies the finished trajectory used, read from the log along
its lineage (engine.lineage.effective_history: the origin attempt's events up to the boundary
it was restored from, then its own), with the token arrays from the token store. A call cut by a
checkpoint and continued after restore is one turn whose ids are prefix + continuation, so a
continued rollout's record equals an uninterrupted run's of the same deterministic policy.

A fork (engine/forks.py) is exported with the run it was forked from (its id starts with the run's):
its turns begin with its origin's, marked `shared` and masked, so a trainer groups a fork group's
samples by `fork_group` and trains each on what it generated; the origin's own record carries the
shared turns unmasked.

Each exported attempt is marked `rollout_exported` once the file is written (engine/exports.py:
exporting again marks nothing new); retention drops a finished rollout's events only once it is marked.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

from sqlalchemy import text

from adapters.postgres import PostgresEventStore
from engine import catalog as ev
from engine.errors import InvalidPayload
from engine.exports import mark_exported
from engine.forks import generated_by
from engine.lineage import effective_history
from engine.tokens import CallTokens, Receipt, TokenSource

RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


async def call_tokens(tokens: TokenSource, data: dict[str, Any], rollout_id: str, attempt: int,
                      parent: str | None = None) -> CallTokens:
    """A `call_completed` event's token record (engine.tokens.CallTokens)."""
    generated = await tokens.get(Receipt.from_json(data["receipt"]).blob_id)
    prompt = await tokens.get(Receipt.from_json(data["prompt_receipt"]).blob_id) if data.get("prompt_receipt") else None
    return CallTokens(
        model_call_id=data["call_id"], rollout_id=rollout_id, attempt=attempt,
        prompt_token_ids=prompt.ids if prompt else (), generation_token_ids=generated.ids,
        generation_log_probs=generated.logprobs or (0.0,) * len(generated.ids), policy_version=data.get("policy_version"),
        finish_reason=data.get("finish_reason"), parent_call_id=parent, segments=tuple(data.get("segments") or ()))


async def rollout_record(store: PostgresEventStore, tokens: TokenSource, rollout_id: str, attempt: int,
                         reward: float | None) -> dict[str, Any]:
    history = await effective_history(store, rollout_id, attempt)
    started = next((e for e in history if e.kind == ev.EPISODE_STARTED), None)
    parents = {e.data["call_id"]: e.data.get("parent_call_id") for e in history if e.kind == ev.CALL_ACCEPTED}
    forked = next((e.data for e in history if e.kind == ev.ROLLOUT_FORKED and e.rollout_id == rollout_id), None)
    turns = []
    for e in history:
        if e.kind != ev.CALL_COMPLETED:
            continue
        t = await call_tokens(tokens, e.data, rollout_id, int(e.attempt or 0), parents.get(e.data["call_id"]))
        n_prompt, n_gen = len(t.prompt_token_ids), len(t.generation_token_ids)
        shared = not generated_by(rollout_id, e)
        turns.append({
            "turn": len(turns), "call_id": t.model_call_id, "policy_version": t.policy_version,
            "finish_reason": t.finish_reason, "shared": shared,
            "token_ids": [*t.prompt_token_ids, *t.generation_token_ids],
            "loss_mask": [0] * n_prompt + [0 if shared else 1] * n_gen,
            "logprobs": [0.0] * n_prompt + list(t.generation_log_probs),
        })
    inherited = [t for t in turns if t["shared"]]
    return {
        "rollout_id": rollout_id, "attempt": attempt,
        "task_id": started.data.get("task_id") if started else None, "reward": reward,
        "policy_versions": sorted({str(t["policy_version"]) for t in turns if t["policy_version"] is not None}),
        "origin": None if forked is None else {"rollout_id": forked["origin_rollout_id"],
                                               "attempt": forked["origin_attempt"], "position": forked["origin_position"]},
        "fork_group": None if forked is None else forked["group"],
        "shared_prefix": {"turns": len(inherited), "tokens": sum(len(t["token_ids"]) for t in inherited)},
        "turns": turns,
    }


async def export_run(store: PostgresEventStore, tokens: TokenSource, run_id: str) -> list[dict[str, Any]]:
    async with store.engine.connect() as conn:
        rows = (await conn.execute(text(
            "SELECT a.rollout_id, a.attempt, a.reward, f.rollout_id IS NOT NULL AS forked FROM rollbook.attempts a "
            "LEFT JOIN rollbook.forks f ON f.rollout_id = a.rollout_id WHERE a.status = 'finished' "
            "AND starts_with(a.rollout_id, :p) ORDER BY a.rollout_id"), {"p": f"{run_id}-"})).all()
    ours = re.compile(re.escape(run_id) + r"-\d+")  # apps.collection names rollouts RUN_ID-NNNN; forks GROUP.i
    return [await rollout_record(store, tokens, r.rollout_id, int(r.attempt), r.reward) for r in rows
            if ours.fullmatch(r.rollout_id) or r.forked]


def write(records: list[dict[str, Any]], out: str | Path) -> str:
    """JSONL or Parquet, chosen by the suffix; returns the format written."""
    path = Path(out)
    if path.suffix == ".jsonl":
        with open(path, "w") as f:
            for r in records:
                f.write(json.dumps(r, sort_keys=True) + "\n")
        return "jsonl"
    if path.suffix == ".parquet":
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError as exc:  # an optional dependency: say how to get it
            raise InvalidPayload("writing Parquet needs pyarrow: pip install 'rollbook[parquet]'") from exc
        turn = pa.struct([("turn", pa.int32()), ("call_id", pa.string()), ("policy_version", pa.string()),
                          ("finish_reason", pa.string()), ("shared", pa.bool_()), ("token_ids", pa.list_(pa.int32())),
                          ("loss_mask", pa.list_(pa.int8())), ("logprobs", pa.list_(pa.float32()))])
        schema = pa.schema([("rollout_id", pa.string()), ("attempt", pa.int32()), ("task_id", pa.string()),
                            ("reward", pa.float64()), ("policy_versions", pa.list_(pa.string())),
                            ("origin", pa.struct([("rollout_id", pa.string()), ("attempt", pa.int32()),
                                                  ("position", pa.int64())])),
                            ("fork_group", pa.string()),
                            ("shared_prefix", pa.struct([("turns", pa.int32()), ("tokens", pa.int64())])),
                            ("turns", pa.list_(turn))])
        pq.write_table(pa.Table.from_pylist(records, schema=schema), path)
        return "parquet"
    raise InvalidPayload(f"--out {out}: the file name must end in .jsonl or .parquet (that chooses the format)")


def read(path: str | Path) -> list[dict[str, Any]]:
    """The records back from either format (tests and users checking an export)."""
    p = Path(path)
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        return list(pq.read_table(p).to_pylist())
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


async def export_command(dsn: str, run_id: str, out: str) -> dict[str, Any]:
    from adapters.token_store import PostgresTokenStore

    if not RUN_ID.fullmatch(run_id):
        raise InvalidPayload(f"--run {run_id!r} is not a run id (letters, digits, '.', '_', '-')")
    if Path(out).suffix not in (".jsonl", ".parquet"):
        write([], out)  # raises the clear error before any work
    store = PostgresEventStore.connect(dsn, writer="export")
    tokens = PostgresTokenStore(store.engine)
    try:
        records = await export_run(store, tokens, run_id)
        fmt = write(records, out)
        # Only once the file is written: the mark is what lets retention drop the rollout's events.
        marked = await asyncio.gather(*(mark_exported(store, r["rollout_id"], r["attempt"], run_id, fmt) for r in records))
    finally:
        await store.close()
    return {"run_id": run_id, "out": str(out), "format": fmt, "rollouts": len(records),
            "turns": sum(len(r["turns"]) for r in records), "newly_marked_exported": sum(marked)}

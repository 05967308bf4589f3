"""`rollbook demo`: rollouts checkpointed mid-flight, a crash, a restore, and the proof in the log.

Each rollout is a Simple Agent loop run in this process over the bundled environments and the
scripted policy. Every model call, mutation and boundary is an event in the log as it happens.
Halfway through, the demo parks every rollout at its boundary, commits a cut, drops everything
it holds in memory (the crash), validates the cut, fences attempt 0, starts attempt 1 and continues
each rollout from the replay of its history up to its boundary. Then it runs the same tasks again
uninterrupted and compares. (The multi-process version with the four servers is tracked in the
issue about the main job.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from adapters import database
from adapters.postgres import PostgresEventStore
from adapters.scripted_policy import scripted_reply
from engine import attempts as A
from engine.checkpoint import (
    committed_event,
    effective_history,
    install_request,
    load_cut,
    make_cut,
    validate_cut,
)
from engine.events import AppendRequest, NewEvent
from engine.identity import agent_stream, call_stream, rollout_stream, session_stream
from engine.phases import CheckpointPhases, checkpoint_started
from participants.environments import get_environment
from participants.environments.base import Task
from participants.environments.tasks import make_tasks

MAX_TURNS = 12


@dataclass
class Rollout:
    rollout_id: str
    task: Task
    seed: int
    attempt: int = 0
    messages: list[dict[str, Any]] = field(default_factory=list)
    state: Any = None
    revision: int = 0
    turn: int = 0
    calls: list[str] = field(default_factory=list)
    live: Any = None  # a restart-only environment's live process


class Gate:
    """Where rollouts park: before each model call, i.e. at a boundary."""

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.open.set()
        self.parked = 0


async def _turn(store: PostgresEventStore, r: Rollout, gate: Gate) -> float | None:
    env = get_environment(r.task.env)
    rid, n = r.rollout_id, r.attempt
    sess = session_stream(rid, n)
    await store.append(AppendRequest((NewEvent(agent_stream(rid, n), "agent_boundary", {
        "turn": r.turn, "messages": r.messages, "calls": r.calls, "state": "before_model",
        "revisions": {sess: r.revision} if env.state_mode == "exported" else {}}, rid, n),)))
    if not gate.open.is_set():
        gate.parked += 1
        await gate.open.wait()
    call_id = f"{rid}.{n}.t{r.turn}"
    reply = scripted_reply(r.messages, env.tools(), r.seed)
    await store.append(AppendRequest((
        NewEvent(call_stream(call_id), "call_accepted", {"call_id": call_id, "parent_call_id": r.calls[-1] if r.calls else None,
                                                         "policy_version": "scripted-1"}, rid, n),
        NewEvent(call_stream(call_id), "call_completed", {"call_id": call_id, "reply": reply, "disposition": "generated"}, rid, n),
    )))
    r.calls.append(call_id)
    r.messages.append(reply)
    done = False
    for tc in reply.get("tool_calls") or []:
        name, args = tc["function"]["name"], json.loads(tc["function"]["arguments"])
        outcome = env.call_live(r.live, name, args) if env.state_mode == "restart_only" else env.call_tool(r.state, name, args)
        if outcome.effect is not None:
            r.revision += 1
            await store.append(AppendRequest((NewEvent(sess, "mutation_applied", {
                "revision": r.revision, "tool": name, "arguments": args, "effect": outcome.effect}, rid, n),)))
            if env.state_mode == "exported":
                r.state = env.apply(r.state, outcome.effect)
        r.messages.append({"role": "tool", "tool_call_id": tc["id"], "content": json.dumps(outcome.output, sort_keys=True)})
        done = done or outcome.done
    r.turn += 1
    if reply.get("tool_calls") and r.turn < MAX_TURNS:
        return None
    return env.verify(r.task, r.state, reply.get("content"))


async def _finish(store: PostgresEventStore, r: Rollout, reward: float) -> None:
    await store.append(AppendRequest((NewEvent(rollout_stream(r.rollout_id), A.ATTEMPT_FINISHED, {"reward": reward},
                                               r.rollout_id, r.attempt),)))
    env = get_environment(r.task.env)
    if r.live is not None:
        env.close_live(r.live)


async def _start(store: PostgresEventStore, r: Rollout) -> None:
    env = get_environment(r.task.env)
    r.messages = [{"role": "user", "content": r.task.prompt}]
    r.state = env.initial_state(r.task)
    if env.state_mode == "restart_only":
        r.live = env.open_live(r.task)
    await store.append(AppendRequest((
        NewEvent(rollout_stream(r.rollout_id), A.ATTEMPT_STARTED, {"parent_attempt": None}, r.rollout_id, r.attempt),
        NewEvent(session_stream(r.rollout_id, r.attempt), "session_opened", {"env": r.task.env, "task": r.task.to_json()},
                 r.rollout_id, r.attempt),
    )) if r.attempt == 0 else AppendRequest((
        NewEvent(session_stream(r.rollout_id, r.attempt), "session_opened", {"env": r.task.env, "task": r.task.to_json()},
                 r.rollout_id, r.attempt),)))


async def _run(store: PostgresEventStore, r: Rollout, gate: Gate, results: dict[str, float], progress: Progress) -> None:
    while True:
        reward = await _turn(store, r, gate)
        if reward is not None:
            await _finish(store, r, reward)
            results[r.rollout_id] = reward
            progress.tick()
            return


def _rebuild(r: Rollout, history: list[Any]) -> None:
    """Replay: the rollout's conversation from its last boundary, its environment from the effects."""
    env = get_environment(r.task.env)
    boundary = [e for e in history if e.kind == "agent_boundary"][-1]
    r.messages, r.turn, r.calls = list(boundary.data["messages"]), boundary.data["turn"], list(boundary.data["calls"])
    state = env.initial_state(r.task)
    effects = [e.data for e in history if e.kind == "mutation_applied"]
    for m in effects:
        state = env.apply(state, m["effect"])
    r.state, r.revision = state, len(effects)


class Progress:
    def __init__(self, total: int, label: str, quiet: bool) -> None:
        self.total, self.done, self.label, self.quiet = total, 0, label, quiet
        self.draw()

    def tick(self) -> None:
        self.done += 1
        self.draw()

    def draw(self) -> None:
        if self.quiet:
            return
        filled = int(30 * self.done / max(1, self.total))
        end = "\n" if self.done >= self.total else ""
        print(f"\r{self.label:<28} [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total}", end=end, file=sys.stderr, flush=True)


async def _collect(store: PostgresEventStore, run: str, tasks: list[Task], seed: int, checkpoint: bool, quiet: bool) -> dict[str, Any]:
    rollouts = [Rollout(f"{run}-{i:03d}", t, seed * 1000 + i) for i, t in enumerate(tasks)]
    results: dict[str, float] = {}
    gate = Gate()
    out: dict[str, Any] = {"timings_ms": {}}
    for r in rollouts:
        await _start(store, r)
    progress = Progress(len(rollouts), "checkpointed run" if checkpoint else "uninterrupted run", quiet)
    workers = [asyncio.create_task(_run(store, r, gate, results, progress)) for r in rollouts]
    if not checkpoint:
        await asyncio.gather(*workers)
        out["rewards"] = results
        return out
    # Let the rollouts get going, then park them at their boundaries and take the cut.
    while len(results) < len(rollouts) // 4:
        await asyncio.sleep(0.01)
    ck = f"{run}-ck"
    t0 = time.perf_counter()
    gate.open.clear()
    await store.append(AppendRequest((checkpoint_started(ck),)))
    while gate.parked + len(results) + sum(w.done() for w in workers) < len(rollouts) and not all(w.done() for w in workers):
        await asyncio.sleep(0.005)
        if gate.parked + len(results) >= len(rollouts):
            break
    phases = CheckpointPhases(ck)
    await store.append(AppendRequest((phases.fire("prepared"),)))
    out["timings_ms"]["prepare"] = round((time.perf_counter() - t0) * 1000, 1)
    finished_before = set(results)
    live = [r for r in rollouts if r.rollout_id not in finished_before]
    restarts = [(r.rollout_id, 0) for r in live if get_environment(r.task.env).state_mode == "restart_only"]
    scope = [(r.rollout_id, 0) for r in live if (r.rollout_id, 0) not in set(restarts)]
    t0 = time.perf_counter()
    cut = await make_cut(store, ck, scope, restarts)
    phases._move("committed")
    await store.append(AppendRequest((committed_event(cut),)))
    out["timings_ms"]["commit"] = round((time.perf_counter() - t0) * 1000, 1)
    # The crash: everything in memory is gone; only the log remains.
    for w in workers:
        w.cancel()
    await asyncio.gather(*workers, return_exceptions=True)
    for r in live:
        if r.live is not None:
            get_environment(r.task.env).close_live(r.live)
    t0 = time.perf_counter()
    cut, _ = await load_cut(store, ck)
    await validate_cut(store, cut)
    await store.append(install_request(cut, {r.rollout_id: 0 for r in live}))
    out["timings_ms"]["restore"] = round((time.perf_counter() - t0) * 1000, 1)
    t0 = time.perf_counter()
    by_id = {r.rollout_id: r for r in rollouts}
    resumed = []
    for s in cut.scope:
        r = by_id[s.rollout_id]
        r.attempt = 1
        _rebuild(r, await effective_history(store, r.rollout_id, 1))
        resumed.append(r)
    for rid, _ in cut.fresh:
        r = by_id[rid]
        r.attempt, r.turn, r.calls, r.revision, r.live = 1, 0, [], 0, None
        await _start(store, r)
        resumed.append(r)
    gate.open.set()
    out["timings_ms"]["resume"] = round((time.perf_counter() - t0) * 1000, 1)
    await asyncio.gather(*(_run(store, r, gate, results, progress) for r in resumed))
    out.update(rewards=results, completed_before=len(finished_before), continued=len(cut.scope), restarted=len(cut.fresh),
               checkpoint=cut)
    return out


async def run_demo(args: argparse.Namespace) -> int:
    dsn = database.prepare_database(args.dsn)
    store = PostgresEventStore.connect(dsn, writer="demo")
    run = f"demo{args.seed}-{int(time.time())}"
    tasks = make_tasks(args.rollouts, args.seed)
    try:
        ck = await _collect(store, f"{run}-c", tasks, args.seed, checkpoint=True, quiet=args.json)
        plain = await _collect(store, f"{run}-u", tasks, args.seed, checkpoint=False, quiet=args.json)
        repeats = await _repeats(store, f"{run}-c")
    finally:
        await store.close()
    rewards_c = [ck["rewards"][k] for k in sorted(ck["rewards"])]
    rewards_u = [plain["rewards"][k] for k in sorted(plain["rewards"])]
    summary = {
        "rollouts": len(tasks),
        "completed_before_checkpoint": ck["completed_before"],
        "continued": ck["continued"],
        "restarted": ck["restarted"],
        "mean_reward_checkpointed": round(statistics.fmean(rewards_c), 4),
        "mean_reward_uninterrupted": round(statistics.fmean(rewards_u), 4),
        "rewards_identical": [round(x, 6) for x in rewards_c] == [round(x, 6) for x in rewards_u],
        **repeats,
        "timings_ms": ck["timings_ms"],
        "dsn": database.libpq_dsn(dsn),
        "run_id": run,
    }
    ok = summary["repeated_model_calls"] == 0 and summary["repeated_mutations"] == 0 and summary["rewards_identical"]
    if args.json:
        print(json.dumps(summary))
    else:
        _table(summary)
        print("all invariants hold" if ok else "INVARIANT FAILED: see the figures above")
    return 0 if ok else 1


async def _repeats(store: PostgresEventStore, prefix: str) -> dict[str, int]:
    """Count, from the log, model calls and mutations of attempt 1 that attempt 0 had already done."""
    async with store.engine.connect() as conn:
        from sqlalchemy import text

        calls = (await conn.execute(text(
            "SELECT count(*) FROM rollbook.episode_history a JOIN rollbook.episode_history b "
            "ON a.rollout_id = b.rollout_id AND a.attempt = 0 AND b.attempt = 1 "
            "AND a.kind = 'call_completed' AND b.kind = 'call_completed' "
            "AND split_part(a.data->>'call_id', '.t', 2) = split_part(b.data->>'call_id', '.t', 2) "
            "JOIN rollbook.checkpoints c ON c.checkpoint_id = :ck AND a.position <= c.log_position "
            "WHERE a.rollout_id LIKE :p AND EXISTS (SELECT 1 FROM rollbook.attempts t WHERE t.rollout_id = a.rollout_id "
            "AND t.attempt = 1 AND t.origin_position IS NOT NULL AND a.position <= t.origin_position)"),
            {"p": prefix + "%", "ck": prefix + "-ck"})).scalar_one()
        muts = (await conn.execute(text(
            "SELECT count(*) FROM rollbook.episode_history a JOIN rollbook.episode_history b "
            "ON a.rollout_id = b.rollout_id AND a.attempt = 0 AND b.attempt = 1 AND a.kind = 'mutation_applied' "
            "AND b.kind = 'mutation_applied' AND (a.data->>'revision') = (b.data->>'revision') "
            "JOIN rollbook.attempts t ON t.rollout_id = a.rollout_id AND t.attempt = 1 AND t.origin_position IS NOT NULL "
            "AND a.position <= t.origin_position WHERE a.rollout_id LIKE :p"), {"p": prefix + "%"})).scalar_one()
    return {"repeated_model_calls": int(calls), "repeated_mutations": int(muts)}


def _table(s: dict[str, Any]) -> None:
    rows = [
        ("rollouts", s["rollouts"]),
        ("finished before the checkpoint", s["completed_before_checkpoint"]),
        ("continued from their boundary", s["continued"]),
        ("restarted (fresh_dispatch)", s["restarted"]),
        ("mean reward, checkpointed + crash", s["mean_reward_checkpointed"]),
        ("mean reward, uninterrupted", s["mean_reward_uninterrupted"]),
        ("per-rollout rewards identical", s["rewards_identical"]),
        ("model calls repeated after restore", s["repeated_model_calls"]),
        ("mutations repeated after restore", s["repeated_mutations"]),
        *((f"{k} ms", v) for k, v in s["timings_ms"].items()),
        ("database", s["dsn"]),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")

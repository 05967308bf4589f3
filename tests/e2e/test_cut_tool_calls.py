"""Paused checkpoints every second against a slow vLLM-style upstream: a tool call that needs more
tokens than fit between two checkpoints is cut again and again, and still finishes (the four servers
and the upstream as real processes), on both kinds of vLLM:

- with the derender route (`--enable-scale-out`): every cut is continued as token ids and the whole
  reply parsed by the upstream, nothing is generated twice but the unsaved tail;
- without it: a cut inside a tool call goes to the chat route, whose template closes a partial tool
  call, so it is regenerated from the start, and is not cut again before it has saved more than the
  cut before it kept.

With each cut tool call generated again from scratch and cut again at the next checkpoint, such a call
never gets past the tokens that fit in one interval and its rollout never finishes.
"""

from __future__ import annotations

import asyncio

import pytest

from participants.environments.tasks import make_tasks

from .conftest import assert_invariants

TOKEN_LATENCY_S = 0.05  # a workplace task's first tool call is about 30 tokens: 1.5 s of generation
INTERVAL_S = 1.0
MAX_CHECKPOINTS = 40  # then the checkpoints stop, so a run that cannot finish under them still ends

OUTCOMES = """
SELECT data->'continuation'->>'mode' AS mode, coalesce((data->>'prefix_tokens')::int, 0) AS prefix
FROM rollbook.events WHERE kind = 'call_completed' AND rollout_id LIKE :p AND data ? 'continuation'
"""


@pytest.mark.parametrize("derender", [True, False])
async def test_cut_tool_calls_finish_every_rollout_under_checkpoints_every_second(cluster_factory, rng, derender: bool) -> None:
    c = await cluster_factory(token_latency_s=TOKEN_LATENCY_S, upstream=True, derender=derender)
    coll = c.collection("ctc", make_tasks(4, rng.randrange(1 << 20), ["workplace"]), seed=rng.randrange(1000))
    run = asyncio.create_task(coll.dispatch(c.session))
    await c.wait_count("ctc", "attempt_started", len(coll.tasks))
    taken = 0
    while not run.done() and taken < MAX_CHECKPOINTS:
        await asyncio.wait({run}, timeout=INTERVAL_S)
        if run.done():
            break
        taken += 1
        ck = await coll.checkpoint(c.session, f"ctc-ck{taken}")
        assert ck["published"], ck
    await asyncio.wait_for(run, 120)
    assert taken >= 2, "the run ended before the checkpoints cut anything"
    cuts_in_tool_calls = await c.scalar(
        "SELECT count(*) FROM rollbook.events WHERE kind = 'call_cut' AND rollout_id LIKE 'ctc-%' "
        "AND data->'partial' ? 'tool_calls'")
    assert cuts_in_tool_calls > 0, "no checkpoint fell inside a tool call"
    outcomes = await c.rows(OUTCOMES, p="ctc-%")
    dropped = [o for o in outcomes if o.mode != "continued"]
    unsaved = await c.scalar("SELECT coalesce(sum((data->>'unsaved')::int), 0) FROM rollbook.events "
                             "WHERE kind = 'call_cut' AND rollout_id LIKE 'ctc-%'")
    # Tokens generated again after a cut: every dropped prefix, and what each cut received past its durable prefix.
    again = sum(o.prefix for o in dropped) + unsaved
    print(f"{taken} checkpoints, {cuts_in_tool_calls} cuts inside a tool call, {len(outcomes)} calls cut and finished, "
          f"{again} tokens generated again")
    if derender:
        assert not dropped, f"cut calls generated again from scratch ({again} tokens): {dropped}"
    else:  # each cut of a call keeps more than the one before: the chain of cuts only ever grows
        chains = await c.rows("SELECT stream, array_agg((data->>'tokens')::int ORDER BY stream_version) AS kept FROM "
                              "rollbook.events WHERE kind = 'call_cut' AND rollout_id LIKE 'ctc-%' GROUP BY stream")
        assert all(list(r.kept) == sorted(set(r.kept)) for r in chains), chains
    print(await assert_invariants(c, coll))

"""What `rollbook ui` reads, through the public views only (docs/sql.md), never the private tables.

Every query here names a `rollbook.*` view of the public contract; the token arrays of a model call
come from the token store by the receipt its `model_calls` row carries (digest-checked), as the
training export reads them. A run is the rollouts named `RUN_ID-NNNN` (apps.collection names them
so); a rollout's state is its latest attempt's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from adapters.pg_pool import with_retry
from adapters.pg_reads import RUN_OF
from adapters.postgres import make_engine
from adapters.token_store import PostgresTokenStore
from engine import catalog as ev
from engine.errors import InvalidCheckpointState
from engine.tokens import Receipt

FAILED = "failed"

_ROLLOUTS = f"""
WITH last AS (
    SELECT DISTINCT ON (rollout_id) rollout_id, attempt, status, reward
    FROM rollbook.attempts WHERE {{where}} ORDER BY rollout_id, attempt DESC),
n AS (SELECT rollout_id, count(*) AS attempts,
             count(restored_from_checkpoint) AS restored FROM rollbook.attempts WHERE {{where}} GROUP BY rollout_id),
h AS (SELECT rollout_id,
             max(data->>'task_id') FILTER (WHERE kind IN ('{ev.EPISODE_STARTED}', '{ev.EPISODE_CONTINUED}')) AS task_id,
             max(data->>'env') FILTER (WHERE kind IN ('{ev.EPISODE_STARTED}', '{ev.EPISODE_CONTINUED}')) AS env,
             count(*) FILTER (WHERE kind = '{ev.ROLLOUT_RECOVERED}') AS recoveries,
             bool_or(data->>'status' = '{FAILED}') AS failed
      FROM rollbook.episode_history
      WHERE kind IN ('{ev.EPISODE_STARTED}', '{ev.EPISODE_CONTINUED}', '{ev.EPISODE_STEP}', '{ev.ROLLOUT_RECOVERED}')
        AND {{where}} GROUP BY rollout_id)
SELECT last.rollout_id, {RUN_OF.replace('rollout_id', 'last.rollout_id')} AS run_id, last.attempt, n.attempts,
       n.restored, coalesce(h.recoveries, 0) AS recoveries, h.task_id, h.env, last.reward,
       (SELECT max(position) FROM rollbook.episode_history x WHERE x.rollout_id = last.rollout_id) AS last_position,
       CASE WHEN last.status = 'finished' THEN 'finished'
            WHEN coalesce(h.failed, false) OR last.status IN ('fenced', 'retired') THEN '{FAILED}'
            ELSE 'live' END AS state
FROM last JOIN n USING (rollout_id) LEFT JOIN h USING (rollout_id)
"""


# The checkpoints of each run: the committed cuts that name the run, or (a cut of every rollout) that
# continue or restart one of its rollouts. Never through the view's `completed` rows, which a cut
# naming its run derives from every finish in the log up to its position.
RUN_CHECKPOINTS = (f"(SELECT {RUN_OF} AS run_id, checkpoint_id FROM rollbook.checkpoint_rollouts WHERE disposition <> 'completed' "
                   "UNION SELECT data->>'run', data->>'checkpoint_id' FROM rollbook.events "
                   "WHERE kind = 'checkpoint_committed' AND data->>'run' IS NOT NULL)")


@dataclass
class Rollout:
    rollout_id: str
    attempts: list[dict[str, Any]]
    events: list[dict[str, Any]]
    calls: list[dict[str, Any]]
    cuts: list[dict[str, Any]]
    forks: list[dict[str, Any]]  # the fork tree this rollout is in (rollbook.forks)


class UiReads:
    """The reads of the web UI over one database."""

    def __init__(self, dsn: str) -> None:
        self.engine: AsyncEngine = make_engine(dsn)
        self.tokens = PostgresTokenStore(self.engine)

    async def close(self) -> None:
        await self.engine.dispose()

    async def _rows(self, sql: str, **params: Any) -> list[dict[str, Any]]:
        async def read() -> list[dict[str, Any]]:
            async with self.engine.connect() as conn:
                return [dict(r._mapping) for r in await conn.execute(text(sql), params)]
        return await with_retry(read, what="a page's query")  # a restarted PostgreSQL is not the page's error

    async def head(self) -> dict[str, Any]:
        """What changes whenever anything a page shows changes: the log's newest rollout event and
        the checkpoints' phases."""
        pos = await self._rows("SELECT max(position) AS p FROM rollbook.episode_history")
        cks = await self._rows("SELECT count(*) AS n, coalesce(max(log_position), 0) AS p, "
                               "coalesce(string_agg(phase, ',' ORDER BY checkpoint_id), '') AS phases "
                               "FROM rollbook.checkpoints")
        return {"position": pos[0]["p"] or 0, "checkpoints": cks[0]["n"], "phases": cks[0]["phases"],
                "checkpoint_position": cks[0]["p"]}

    async def rollouts(self, run_id: str | None = None) -> list[dict[str, Any]]:
        where = f"{RUN_OF} = :run" if run_id is not None else "true"
        return await self._rows(_ROLLOUTS.format(where=where) + " ORDER BY last.rollout_id", run=run_id)

    async def runs(self) -> list[dict[str, Any]]:
        """One row per run: its rollouts counted by state, its checkpoints and recoveries, its mean reward."""
        runs: dict[str, dict[str, Any]] = {}
        for r in await self.rollouts():
            run = runs.setdefault(r["run_id"], {"run_id": r["run_id"], "rollouts": 0, "tasks": set(), "finished": 0,
                                                "live": 0, "failed": 0, "restarted": 0, "restored": 0,
                                                "recoveries": 0, "rewards": [], "last_position": 0})
            run["rollouts"] += 1
            run["tasks"].add(r["task_id"])
            run[r["state"]] += 1
            run["restarted"] += r["attempts"] > 1
            run["restored"] += r["restored"]
            run["recoveries"] += r["recoveries"]
            run["last_position"] = max(run["last_position"], r["last_position"] or 0)
            if r["state"] == "finished" and r["reward"] is not None:
                run["rewards"].append(float(r["reward"]))
        cks = await self._rows(f"SELECT run_id, count(DISTINCT checkpoint_id) AS n FROM {RUN_CHECKPOINTS} rc GROUP BY 1")
        per_run = {c["run_id"]: c["n"] for c in cks}
        out = []
        for run in sorted(runs.values(), key=lambda r: -r["last_position"]):
            rewards = run.pop("rewards")
            run["tasks"] = len(run["tasks"] - {None})
            run["mean_reward"] = sum(rewards) / len(rewards) if rewards else None
            run["checkpoints"] = per_run.get(run["run_id"], 0)
            out.append(run)
        return out

    async def run_checkpoints(self, run_id: str) -> list[dict[str, Any]]:
        return await self._rows(
            "SELECT c.checkpoint_id, c.phase, c.log_position, c.scope_size, c.published_at FROM rollbook.checkpoints c "
            f"WHERE c.checkpoint_id IN (SELECT checkpoint_id FROM {RUN_CHECKPOINTS} rc WHERE run_id = :run) "
            "ORDER BY c.log_position", run=run_id)

    async def rollout(self, rollout_id: str) -> Rollout | None:
        attempts = await self._rows("SELECT * FROM rollbook.attempts WHERE rollout_id = :r ORDER BY attempt", r=rollout_id)
        if not attempts:
            return None
        events = await self._rows("SELECT attempt, position, stream, kind, data, recorded_at FROM rollbook.episode_history "
                                  "WHERE rollout_id = :r ORDER BY position", r=rollout_id)
        calls = await self._rows("SELECT * FROM rollbook.model_calls WHERE rollout_id = :r ORDER BY accepted_position",
                                 r=rollout_id)
        cuts = await self._rows("SELECT * FROM rollbook.checkpoint_rollouts WHERE rollout_id = :r ORDER BY log_position",
                                r=rollout_id)
        forks = await self._rows(
            "WITH RECURSIVE tree AS (SELECT rollout_id, origin_rollout_id, origin_attempt, origin_position "
            "FROM rollbook.forks WHERE origin_rollout_id = :r UNION SELECT f.rollout_id, f.origin_rollout_id, "
            "f.origin_attempt, f.origin_position FROM rollbook.forks f JOIN tree t ON f.origin_rollout_id = t.rollout_id) "
            "SELECT rollout_id, origin_rollout_id, origin_attempt, origin_position FROM tree "
            "UNION SELECT rollout_id, origin_rollout_id, origin_attempt, origin_position FROM rollbook.forks "
            "WHERE rollout_id = :r ORDER BY origin_position, rollout_id", r=rollout_id)
        latest = {row["rollout_id"]: row for row in await self._rows(
            "SELECT DISTINCT ON (rollout_id) rollout_id, status, reward FROM rollbook.attempts "
            "WHERE rollout_id = ANY(:ids) ORDER BY rollout_id, attempt DESC", ids=[f["rollout_id"] for f in forks])}
        for f in forks:  # where each fork stands now, so a page following the run watches them finish
            f["state"] = (latest.get(f["rollout_id"]) or {}).get("status") or "not started"
            f["reward"] = (latest.get(f["rollout_id"]) or {}).get("reward")
        return Rollout(rollout_id, attempts, events, calls, cuts, forks)

    async def model_call(self, call_id: str) -> dict[str, Any] | None:
        rows = await self._rows("SELECT * FROM rollbook.model_calls WHERE call_id = :c", c=call_id)
        if not rows:
            return None
        call = rows[0]
        events = await self._rows("SELECT attempt, position, kind, data, recorded_at FROM rollbook.episode_history "
                                  "WHERE rollout_id = :r AND data->>'call_id' = :c ORDER BY position",
                                  r=call["rollout_id"], c=call_id)
        related = await self._rows(
            "SELECT call_id, status, attempt FROM rollbook.model_calls m WHERE rollout_id = :r AND call_id IN ("
            "SELECT data->>'call_id' FROM rollbook.episode_history WHERE rollout_id = :r AND kind = :accepted "
            "AND (data->>'replaces' = :c OR data->'continues'->>'call_id' = :c))",
            r=call["rollout_id"], c=call_id, accepted=ev.CALL_ACCEPTED)
        end = next((e for e in reversed(events) if e["kind"] in (ev.CALL_COMPLETED, ev.CALL_CUT)), None)
        try:
            prompt, generated = await self._tokens(end["data"] if end else {})
            problem = None
        except InvalidCheckpointState as exc:  # the page still shows the call's custody and what the log says
            prompt, generated, problem = [], {"ids": [], "logprobs": []}, exc.detail
        return {"call": call, "events": events, "continued_by": related, "prompt": prompt, "generated": generated,
                "token_problem": problem}

    async def _tokens(self, data: dict[str, Any]) -> tuple[list[int], dict[str, list[Any]]]:
        prompt: list[int] = []
        generated: dict[str, list[Any]] = {"ids": [], "logprobs": []}
        if data.get("prompt_receipt"):
            prompt = list((await self.tokens.get(Receipt.from_json(data["prompt_receipt"]).blob_id)).ids)
        if data.get("receipt"):
            arr = await self.tokens.get(Receipt.from_json(data["receipt"]).blob_id)
            generated = {"ids": list(arr.ids), "logprobs": list(arr.logprobs or ())}
        return prompt, generated

    async def checkpoint(self, checkpoint_id: str) -> dict[str, Any] | None:
        rows = await self._rows("SELECT * FROM rollbook.checkpoints WHERE checkpoint_id = :c", c=checkpoint_id)
        if not rows:
            return None
        cut = await self._rows(
            "SELECT c.rollout_id, c.attempt, c.boundary, c.disposition, b.kind AS boundary_kind, "
            "b.data->>'turn' AS boundary_turn, b.data->>'state' AS boundary_state, b.data->>'step' AS boundary_step, "
            "n.attempt AS next_attempt, n.status AS next_status, n.reward AS next_reward "
            "FROM rollbook.checkpoint_rollouts c "
            "LEFT JOIN rollbook.episode_history b ON b.position = c.boundary "
            "LEFT JOIN rollbook.attempts n ON n.rollout_id = c.rollout_id AND n.restored_from_checkpoint = c.checkpoint_id "
            "WHERE c.checkpoint_id = :c ORDER BY c.disposition, c.rollout_id", c=checkpoint_id)
        return {"checkpoint": rows[0], "rollouts": cut}

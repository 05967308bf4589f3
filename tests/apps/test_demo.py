"""The finished demo: what it reports, then `rollbook history` and `rollbook replay` on the database it
leaves behind, with no server running.

The demo runs once per session (tests/conftest.py `demo_run`); each test that edits reads its own copy
(`demo_db`). Every test that needs the demo lives in this file: the suite's workers take a file each, so
the demo runs on one worker only."""

from __future__ import annotations

import json
import subprocess
import sys

import psycopg

from testkit.pg import DemoRun

ROLLBOOK = [sys.executable, "-m", "apps.cli"]


def test_demo_continues_rollouts_without_repeating_work(demo_run: DemoRun) -> None:
    assert demo_run.returncode == 0, demo_run.stderr[-2000:]  # the session's one demo (tests/conftest.py)
    s = json.loads(demo_run.stdout)
    assert s["continued"] > 0
    # The demo's sandbox rollouts in flight at the checkpoint go on from their snapshot, but for the one
    # (of three) whose episode keeps a watcher in the background: that one restarts.
    assert s["sandbox_continued"] >= 1 and s["sandbox_continued"] + s["sandbox_restarted"] <= 3
    assert s["completed_before_checkpoint"] + s["continued"] + s["restarted"] == s["rollouts"] == 12
    assert s["repeated_model_calls"] == 0 and s["repeated_mutations"] == 0 and s["repeated_mutations_within_attempt"] == 0
    assert s["unfinished"] == 0 and s["finished_twice"] == 0
    # The scripted policy is deterministic, so continuing must not change any reward.
    assert s["mean_reward_checkpointed"] == s["mean_reward_uninterrupted"]


# The first mutation in a continued rollout's replayed history: attempt 0's up to the boundary, then attempt 1's.
FIRST_MUTATION = """
SELECT a.rollout_id, min(h.position) FROM rollbook.attempts a JOIN rollbook.episode_history h ON h.rollout_id = a.rollout_id
AND h.kind = 'mutation_applied' AND (h.attempt = 1 OR (h.attempt = 0 AND h.position <= a.origin_position))
WHERE a.attempt = 1 AND a.origin_position IS NOT NULL AND a.rollout_id LIKE '%%-c-%%'
GROUP BY a.rollout_id ORDER BY a.rollout_id LIMIT 1
"""


def _continued(dsn: str) -> tuple[str, int]:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(FIRST_MUTATION).fetchone()
    assert row is not None, "the demo continued no rollout that mutates its environment"
    return row[0], row[1]


def test_history_shows_every_attempt_with_its_origin(demo_db: str) -> None:
    rid, _ = _continued(demo_db)
    out = subprocess.run([*ROLLBOOK, "history", rid, "--dsn", demo_db, "--json"], check=True, capture_output=True, text=True)
    h = json.loads(out.stdout)
    assert [(a["attempt"], a["status"]) for a in h["attempts"]] == [(0, "fenced"), (1, "finished")]
    assert h["attempts"][1]["parent_attempt"] == 0 and h["attempts"][1]["restored_from"].endswith("-ck1")
    positions = [t["position"] for t in h["timeline"]]
    assert positions == sorted(positions)


def test_replay_rebuilds_the_continued_attempt_from_its_origin(demo_db: str) -> None:
    rid, _ = _continued(demo_db)
    out = subprocess.run([*ROLLBOOK, "replay", rid, "--attempt", "1", "--dsn", demo_db, "--json"],
                         check=True, capture_output=True, text=True)
    r = json.loads(out.stdout)
    attempts = {s["attempt"] for s in r["steps"]}
    assert attempts == {0, 1}  # attempt 0's events up to the boundary, then attempt 1's own
    assert r["revision"] >= 1 and r["reward"] is not None
    with psycopg.connect(demo_db) as conn:
        reward = conn.execute("SELECT reward FROM rollbook.attempts WHERE rollout_id = %s AND attempt = 1", (rid,)).fetchone()[0]
    assert r["reward"] == reward


def test_replay_reports_a_divergence_as_an_error(demo_db: str) -> None:
    rid, position = _continued(demo_db)
    with psycopg.connect(demo_db, autocommit=True) as conn:
        # The bad input: a mutation whose recorded revision skips one, as a lost event would leave it.
        conn.execute("UPDATE rollbook.events SET data = jsonb_set(data, '{revision}', '7') WHERE position = %s", (position,))
    out = subprocess.run([*ROLLBOOK, "replay", rid, "--attempt", "1", "--dsn", demo_db], capture_output=True, text=True)
    assert out.returncode == 2
    err = json.loads(out.stderr.strip().splitlines()[-1])["error"]
    assert err["code"] == "replay_divergence" and "revision 7 follows 0" in err["detail"]
